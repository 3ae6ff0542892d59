"""Trainer-side ``update_weights_from_tensor`` payloads in SGLang's pickle format; no HTTP, no sglang import.

Runs in the trainer process. A payload is one base64 string per engine TP rank, each its own
``ForkingPickler`` serialisation (SGLang ``utils/common.py:3060-3082``), so every rank's CUDA-IPC
refcount slot is opened and closed exactly once (``engine.py:1743-1750``; sgl-project/sglang#4446).
CUDA tensors carry the GPU UUID instead of the device index (``utils/patch_torch.py:64-99``), so
trainer and engine may number GPUs differently. Everything a payload pickles is on SGLang's
``SafeUnpickler`` allow-list (``utils/common.py:3148-3371``), metadata included: it travels as
``types.SimpleNamespace``, never as a colocd class the engine could not (and should not) import.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from ..chunks import ChunkLayout, dtype_from_name, flatten_into
from ..cuda_handles import device_uuid

__all__ = [
    "FLATTENED_BUCKET",
    "BufferLease",
    "BufferLeaseState",
    "FlattenedBucket",
    "export_flattened_bucket",
    "flatten_bucket",
    "metadata_for_layout",
    "named_tensors_payload",
    "serialize",
    "with_device_uuid",
]

FLATTENED_BUCKET = (
    "flattened_bucket"  # load_format SGLang dispatches on (model_runner_components/weight_updater.py:354)
)

# reduce_tensor's CUDA tuple: index 6 is storage_device (torch/multiprocessing/reductions.py;
# SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX, patch_torch.py:66). 15 positional arguments in all.
_DEVICE_ARG = 6
_CUDA_ARGS = 15
_REF_HANDLE, _REF_OFFSET = 11, 12  # the consumer's reference count: torch's ref-counter file and slot


def with_device_uuid(args: tuple[Any, ...], uuid_of: Callable[[int], str]) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor`` arguments with the device index replaced by that GPU's UUID string.

    SGLang's consumer maps the UUID back to its own local index (patch_torch.py:89-99) and
    uses a plain int as-is, which is wrong whenever the two processes see different
    ``CUDA_VISIBLE_DEVICES``.
    """
    if len(args) != _CUDA_ARGS or not isinstance(args[_DEVICE_ARG], int):
        raise ValueError(
            f"unexpected rebuild_cuda_tensor arguments ({len(args)} items, "
            f"device {args[_DEVICE_ARG : _DEVICE_ARG + 1]!r}); "
            "torch's CUDA IPC reduction changed shape"
        )
    return (*args[:_DEVICE_ARG], uuid_of(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    if rebuild is reductions.rebuild_cuda_tensor:
        args = with_device_uuid(args, device_uuid)
    return rebuild, args


def serialize(obj: Any, shares: list[tuple[bytes, int]] | None = None) -> str:
    """One SGLang ``serialized_named_tensors`` entry: ``obj`` pickled by ForkingPickler, base64 text.

    ``shares`` collects each CUDA share's ``(ref_counter_handle, ref_counter_offset)``: the consumer's count
    torch keeps the storage alive for (``colocd.trainer.leases``).

    The UUID reducer is installed on this pickler instance only (its own ``dispatch_table``), so
    nothing process-wide is patched, unlike SGLang's ``monkey_patch_torch_reductions``. The
    pickle names ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which SGLang allow-lists
    and, having patched that name in its own process, resolves to its UUID-aware rebuild.

    Payloads are meant for CUDA tensors. A CPU tensor pickles by file-descriptor sharing
    (``rebuild_storage_fd`` + ``DupFd``), which only this process's own family can open; the
    reference engine refuses it, and CPU weights travel by the ``shm`` transport instead.
    """
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    reduce = _reduce_tensor
    if shares is not None:
        def reduce(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
            rebuild, args = _reduce_tensor(tensor)
            if rebuild is reductions.rebuild_cuda_tensor and args[_REF_HANDLE] is not None:
                shares.append((args[_REF_HANDLE], int(args[_REF_OFFSET])))
            return rebuild, args
    pickler.dispatch_table[torch.Tensor] = reduce
    pickler.dispatch_table[torch.nn.Parameter] = reduce
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def named_tensors_payload(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The plain format (``load_format=None``): a list of ``(name, tensor)`` for ``model.load_weights``."""
    return [(name, tensor.detach()) for name, tensor in named]


def metadata_for_layout(layout: ChunkLayout) -> tuple[SimpleNamespace, ...]:
    """SGLang's per-tensor metadata (tensor_bucket.py:8-16) for a colocd chunk layout.

    Attribute names are FlattenedTensorMetadata's: byte offsets ``start_idx``/``end_idx`` into the
    uint8 buffer and ``numel`` the byte count. Offsets come from ``ChunkLayout`` and are aligned,
    which SGLang's own producer does not guarantee but its ``.view(dtype)`` needs.
    """
    out = []
    for spec in layout.tensors:
        start = spec.offset
        out.append(
            SimpleNamespace(
                name=spec.name,
                shape=torch.Size(spec.shape),
                dtype=dtype_from_name(spec.dtype),
                start_idx=start,
                end_idx=start + spec.nbytes,
                numel=spec.nbytes,
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class FlattenedBucket:
    """One uint8 buffer holding a bucket's tensors back to back, and SGLang's metadata for it."""

    flattened_tensor: torch.Tensor
    metadata: tuple[SimpleNamespace, ...]

    def payload(self) -> dict[str, Any]:
        """What one rank's entry deserialises to under ``load_format="flattened_bucket"``
        (model_runner_components/weight_updater.py:383-411 reads exactly these two keys)."""
        return {"flattened_tensor": self.flattened_tensor, "metadata": list(self.metadata)}


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> FlattenedBucket:
    """Copy tensors into a freshly allocated uint8 buffer on their device (one bucket, never reused)."""
    if not named:
        raise ValueError("cannot build an empty bucket")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"a bucket's tensors must share one device; got {sorted(map(str, devices))}")
    layout = ChunkLayout.for_tensors(named)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=devices.pop())
    # Copies are enqueued on the current stream; torch's CUDA IPC export records an event on it
    # that the consumer waits for, so the engine never reads a half-written buffer.
    flatten_into(buffer, layout, named)
    return FlattenedBucket(buffer, metadata_for_layout(layout))


def export_flattened_bucket(named: Sequence[tuple[str, torch.Tensor]],
                            shares: list[tuple[bytes, int]] | None = None) -> tuple[str, BufferLease]:
    """This rank's ``serialized_named_tensors`` entry for one bucket, and the lease on its buffer.

    The trainer sends the string (through the daemon) and calls ``lease.release()`` once the
    daemon acked the chunk; nothing else holds the buffer.
    """
    bucket = flatten_bucket(named)
    return serialize(bucket.payload(), shares), BufferLease(bucket.flattened_tensor)


class BufferLeaseState(Enum):
    HELD = "held"
    RELEASED = "released"


class BufferLease:
    """Keeps one exported bucket alive until the engine has confirmed it, then lets it go for good.

    SGLang answers ``update_weights_from_tensor`` once the copy is *enqueued*, not done
    (slime update_weight_from_tensor.py:39-47, THUDM/slime#929), so a buffer is never refilled
    after a reply: ``release()`` drops the only reference and the next bucket gets a fresh one.
    PyTorch then frees the memory once the engine has dropped its IPC mapping, which
    ``torch.cuda.ipc_collect()`` notices (THUDM/slime#1731). Measured on an H200: a 256 MiB bucket
    is back after ``release()`` once the consumer dropped its view; a bucket exported but never
    consumed stays in PyTorch's IPC sent-data list until this process exits.
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._cuda = tensor.is_cuda
        self.state = BufferLeaseState.HELD

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("bucket lease already released; its buffer must not be reused")
        return self._tensor

    def release(self) -> None:
        """Call after the engine confirmed this bucket; repeated calls do nothing."""
        if self.state is BufferLeaseState.RELEASED:
            return
        self._tensor = None
        self.state = BufferLeaseState.RELEASED
        if self._cuda and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]

    def __enter__(self) -> BufferLease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
