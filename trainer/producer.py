"""Trainer-side chunk export: copy a bucket of tensors into a transport buffer and describe it.

A producer hands out ``ExportedPart`` objects; the trainer must call ``release()`` only after the
daemon acked the chunk (every engine consumed it). Until then the buffer stays alive and untouched:
SGLang replies before its copy has finished (research/engine-apis.md §6.4 #6), so the ack, not the
engine's HTTP reply seen by anyone else, is what licenses reuse.

Producers by name (``producer_for``): ``shm`` and ``disk`` (CPU paths), ``inline`` (the bytes in the
descriptor as SGLang's plainly pickled ``flattened_bucket``: what a real SGLang loads from CPU), ``cuda_ipc`` (a fresh
IPC-exported bucket per chunk, SGLang's ``flattened_bucket``), ``per_tensor`` (one IPC handle per
tensor, SGLang's default format).
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import tempfile
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ..engines.chunks import ChunkLayout, SharedSegment, flatten_into
from ..engines.segments import reclaim_dead_segments
from ..policies import Transport
from .exported import ExportedPart, Producer
from .leases import Lease, LeaseBook, RefCounter

if TYPE_CHECKING:
    from ..engines.sglang.payload import BufferLease

__all__ = [
    "PRODUCERS",
    "CudaIpcProducer",
    "DiskProducer",
    "ExportedPart",
    "InlineProducer",
    "Producer",
    "ShmProducer",
    "producer_for",
]

PRODUCERS: tuple[Transport, ...] = tuple(Transport)  # one producer (or variant) for every transport

logger = logging.getLogger(__name__)


class ShmProducer:
    """POSIX shared memory by name: the CPU path. One fresh segment per chunk, unlinked on release.

    Starting one first reclaims the segments of trainers that died on this node without unlinking
    theirs (``engines/segments.py``); ``reclaim=False`` skips that.
    """

    transport = Transport.SHM

    def __init__(self, *, reclaim: bool = True, leases: LeaseBook | None = None) -> None:
        self.leases = leases or LeaseBook()
        self._live: dict[str, tuple[SharedSegment, Lease]] = {}
        if reclaim:
            reclaimed = reclaim_dead_segments()
            if reclaimed:
                logger.info(
                    "unlinked %d shared-memory segment(s) of dead processes (%d bytes): %s",
                    len(reclaimed),
                    sum(r.nbytes for r in reclaimed),
                    ", ".join(r.name for r in reclaimed),
                )

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        layout = ChunkLayout.for_tensors(named)
        segment = SharedSegment.create(layout.nbytes)
        self._live[segment.name] = (segment, self.leases.export(self.transport, layout.nbytes))
        try:
            cpu_named = [(n, t.detach().to("cpu")) for n, t in named]
            flatten_into(segment.tensor(), layout, cpu_named)
        except BaseException:
            self._drop(segment.name)
            raise
        handle = {"shm_name": segment.name, "nbytes": layout.nbytes, "layout": layout.to_json()}
        return ExportedPart(Transport.SHM, layout.nbytes, handle, layout, lambda: self._drop(segment.name))

    def _drop(self, name: str) -> None:
        entry = self._live.pop(name, None)
        if entry is not None:
            segment, lease = entry
            segment.close()
            segment.unlink()
            self.leases.release(lease)

    def close(self) -> None:
        """Unlink every segment still alive (abort / error paths): nothing left in /dev/shm."""
        for name in list(self._live):
            self._drop(name)


class DiskProducer:
    """A safetensors file per chunk: the fallback when no shared memory or IPC path is available."""

    transport = Transport.DISK

    def __init__(self, directory: str | None = None) -> None:
        self._dir = directory or tempfile.mkdtemp(prefix="colocd-disk-")
        self._live: set[str] = set()

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        from safetensors.torch import save_file

        layout = ChunkLayout.for_tensors(named)
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._dir)
        os.close(fd)
        self._live.add(path)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in named}, path)
        # The layout travels with every chunk (the daemon checks it); the file's own header says where each lies.
        handle = {"path": path, "layout": layout.to_json()}
        return ExportedPart(Transport.DISK, layout.nbytes, handle, layout, lambda: self._drop(path))

    def _drop(self, path: str) -> None:
        self._live.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for path in list(self._live):
            self._drop(path)


class InlineProducer:
    """The chunk's bytes in its descriptor: base64 of a plain ``pickle`` of SGLang's ``flattened_bucket``
    (``{"flattened_tensor": uint8 CPU tensor, "metadata": [...]}``), the CPU format a real SGLang's
    ``update_weights_from_tensor`` loads on any device. Plain pickle carries the tensor by value, so nothing
    is shared with the engine (ForkingPickler's file-descriptor sharing needs the sender's multiprocessing
    key, and SGLang's scheduler dies on it). Bounded by the daemon's request size (limits.max_body_bytes):
    ``INLINE_BUCKET_MB`` by default. The handle also carries the layout, which the daemon checks against the
    manifest; the daemon itself never unpickles the payload (``engines/inline.py`` checks its opcodes)."""

    transport = Transport.INLINE

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        from ..engines.sglang.payload import FLATTENED_BUCKET, metadata_for_layout

        layout = ChunkLayout.for_tensors(named)
        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        flatten_into(buffer, layout, [(n, t.detach().to("cpu")) for n, t in named])
        payload = pickle.dumps({"flattened_tensor": buffer, "metadata": list(metadata_for_layout(layout))})
        handle = {"payload_b64": base64.b64encode(payload).decode("ascii"), "load_format": FLATTENED_BUCKET,
                  "layout": layout.to_json()}
        return ExportedPart(Transport.INLINE, layout.nbytes, handle, layout)

    def close(self) -> None:
        return None  # nothing outlives a chunk: its bytes are in the descriptor


class CudaIpcProducer:
    """A fresh IPC-exported GPU bucket per chunk (what SGLang's ``flattened_bucket`` expects).

    With ``per_tensor=True`` nothing is flattened: the chunk is SGLang's default list of
    ``(name, tensor)``, one IPC handle per tensor (the slow baseline the buckets replace).
    """

    transport = Transport.CUDA_IPC  # per_tensor too: on the wire it is cuda_ipc, load_format "direct"

    def __init__(self, *, per_tensor: bool = False, leases: LeaseBook | None = None) -> None:
        self.per_tensor = per_tensor
        self.leases = leases or LeaseBook()
        self._live: dict[int, tuple[BufferLease | None, Lease]] = {}

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        from ..engines.cuda_handles import device_uuid
        from ..engines.sglang.payload import (
            FLATTENED_BUCKET,
            export_flattened_bucket,
            named_tensors_payload,
            serialize,
        )

        devices = {t.device for _, t in named}
        if len(devices) != 1 or (device := devices.pop()).type != "cuda":
            raise ValueError(f"cuda_ipc needs a chunk's tensors on one CUDA device; got {sorted(map(str, devices))}")
        layout = ChunkLayout.for_tensors(named)
        bucket: BufferLease | None = None
        shares: list[tuple[bytes, int]] = []  # the consumers' counts torch keeps the buffer alive for
        if self.per_tensor:
            payload, load_format = serialize(named_tensors_payload(named), shares), "direct"
        else:
            # The flatten is queued on this stream; torch's IPC export records an event on it that
            # the engine waits for before reading, so no host sync is needed here.
            payload, bucket = export_flattened_bucket(named, shares)
            load_format = FLATTENED_BUCKET
        lease = self.leases.export(Transport.PER_TENSOR if self.per_tensor else self.transport, layout.nbytes,
                                   [RefCounter.of(h, offset) for h, offset in shares],
                                   buffers=[t for _, t in named] if bucket is None else [bucket.tensor])
        key = lease.id
        self._live[key] = (bucket, lease)
        handle = {
            "payload_b64": payload,
            "load_format": load_format,
            "device_uuid": device_uuid(device.index or 0),
            # What the payload holds, in words the daemon reads (it never unpickles the payload): checked
            # against the manifest and the other ranks' chunk, and counted for the commit's completeness.
            "layout": layout.to_json(),
        }
        return ExportedPart(self.transport, layout.nbytes, handle, layout, lambda: self._drop(key))

    def _drop(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is None:
            return
        bucket, lease = entry
        if bucket is not None:
            bucket.release()  # drops the bucket and runs torch.cuda.ipc_collect() (THUDM/slime#1731)
        else:
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
        self.leases.release(lease)  # retained while the engine's count says it still holds the buffer

    def close(self) -> None:
        """Release every bucket still held (abort and error paths)."""
        for key in list(self._live):
            self._drop(key)


def producer_for(transport: Transport | str, *, leases: LeaseBook | None = None) -> Producer:
    """The producer of ``transport`` (a name is accepted; an unknown one is a ValueError naming the known).
    Its exported buffers are leases in ``leases`` (default: its own book)."""
    try:
        transport = Transport(transport)
    except ValueError:
        raise ValueError(f"unknown transport {transport!r}; known: {[t.value for t in PRODUCERS]}") from None
    if transport is Transport.SHM:
        return ShmProducer(leases=leases)
    if transport is Transport.DISK:
        return DiskProducer()
    if transport is Transport.INLINE:
        return InlineProducer()
    return CudaIpcProducer(per_tensor=transport is Transport.PER_TENSOR, leases=leases)
