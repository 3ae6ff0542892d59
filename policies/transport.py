"""``Transport``: how chunk bytes travel trainer → engine, the one vocabulary of every layer (policies choose,
engines advertise, producers are keyed by it, the chunk descriptor carries it); broadcasts have their own API."""

from __future__ import annotations

from enum import StrEnum

__all__ = ["AUTO_ORDER", "Transport"]


class Transport(StrEnum):
    """A way to move one chunk (DESIGN.md §4); each is one a real engine loads (SGLang, or vLLM through
    colocd's worker extension). ``per_tensor`` is a variant of ``cuda_ipc`` on the wire (``wire``)."""

    SHM = "shm"  # POSIX shared memory by name: the CPU path
    DISK = "disk"  # a safetensors file: the fallback
    INLINE = "inline"  # the tensors' bytes in the descriptor, plainly pickled (what SGLang loads from CPU)
    CUDA_IPC = "cuda_ipc"  # a fresh IPC-exported GPU bucket per chunk (SGLang's flattened_bucket)
    PER_TENSOR = "per_tensor"  # cuda_ipc with one IPC handle per tensor (SGLang's default list format)

    @property
    def wire(self) -> Transport:
        """What a chunk of this transport says it is on the wire: a variant travels as its base transport,
        with the difference carried in its handle (``load_format: direct``)."""
        return _WIRE.get(self, self)


_WIRE = {Transport.PER_TENSOR: Transport.CUDA_IPC}


# ``transport: auto``, first choice first, in the daemon's plan and in ``WeightPusher`` alike: only transports that
# keep nothing exported between pushes, so the trainer holds no staging memory through the rollout. Auto never picks
# ``per_tensor`` (one handle per tensor); ``inline`` before ``disk``: what a real SGLang loads from CPU.
AUTO_ORDER: tuple[Transport, ...] = (Transport.CUDA_IPC, Transport.SHM, Transport.INLINE, Transport.DISK)
