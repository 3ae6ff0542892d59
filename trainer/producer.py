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
import contextlib
import itertools
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..engines.chunks import ChunkLayout, SharedSegment, flatten_into
from ..engines.segments import reclaim_dead_segments
from ..policies import Transport
from .leases import LeaseBook, RefCounter

__all__ = ["PRODUCERS", "ExportedPart", "Producer", "producer_for"]

PRODUCERS: tuple[Transport, ...] = tuple(Transport)  # one producer (or variant) for every transport

logger = logging.getLogger(__name__)


@dataclass
class ExportedPart:
    """A chunk ready to describe to the daemon; ``release`` frees its buffer (after the ack)."""

    transport: Transport  # as on the wire (Transport.wire)
    nbytes: int
    handle: dict[str, Any]
    layout: ChunkLayout
    _release: Callable[[], None] | None = field(default=None, repr=False)
    # Each tensor's digest (engines/digest.py) computed on its device at export; None: not asked for.
    digests: dict[str, str] | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()


class Producer:
    """Exports chunks for one transport; may be reused across streams. Every buffer it hands out that outlives
    the call is held here until its chunk's ``release`` (or ``close``, on abort and error paths)."""

    transport: Transport

    def __init__(self, leases: LeaseBook | None = None) -> None:
        self.leases = leases or LeaseBook()
        self._live: dict[int, Callable[[], None]] = {}
        self._keys = itertools.count()

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        raise NotImplementedError

    def _part(self, nbytes: int, handle: dict[str, Any], layout: ChunkLayout,
              drop: Callable[[], None] | None = None) -> ExportedPart:
        """The chunk, with ``drop`` (what frees its buffer) run once, at its release or at ``close``."""
        if drop is None:
            return ExportedPart(self.transport.wire, nbytes, handle, layout)
        key = next(self._keys)
        self._live[key] = drop
        return ExportedPart(self.transport.wire, nbytes, handle, layout, lambda: self._drop(key))

    def _drop(self, key: int) -> None:
        if (drop := self._live.pop(key, None)) is not None:
            drop()

    def close(self) -> None:
        """Free every buffer still held: nothing left in /dev/shm, on disk or exported."""
        for key in list(self._live):
            self._drop(key)


class ShmProducer(Producer):
    """POSIX shared memory by name: the CPU path. One fresh segment per chunk, unlinked on release.

    Starting one first reclaims the segments of trainers that died on this node without unlinking
    theirs (``engines/segments.py``); ``reclaim=False`` skips that.
    """

    transport = Transport.SHM

    def __init__(self, *, reclaim: bool = True, leases: LeaseBook | None = None) -> None:
        super().__init__(leases)
        if reclaim and (reclaimed := reclaim_dead_segments()):
            logger.info("unlinked %d shared-memory segment(s) of dead processes (%d bytes): %s", len(reclaimed),
                        sum(r.nbytes for r in reclaimed), ", ".join(r.name for r in reclaimed))

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        layout = ChunkLayout.for_tensors(named)
        segment = SharedSegment.create(layout.nbytes)
        lease = self.leases.export(self.transport, layout.nbytes)

        def drop() -> None:
            segment.close()
            segment.unlink()
            self.leases.release(lease)

        try:
            flatten_into(segment.tensor(), layout, [(n, t.detach().to("cpu")) for n, t in named])
        except BaseException:
            drop()
            raise
        handle = {"shm_name": segment.name, "nbytes": layout.nbytes, "layout": layout.to_json()}
        return self._part(layout.nbytes, handle, layout, drop)


class DiskProducer(Producer):
    """A safetensors file per chunk: the fallback when no shared memory or IPC path is available."""

    transport = Transport.DISK

    def __init__(self, directory: str | None = None) -> None:
        super().__init__()
        self._dir = directory or tempfile.mkdtemp(prefix="colocd-disk-")

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        from safetensors.torch import save_file

        layout = ChunkLayout.for_tensors(named)
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._dir)
        os.close(fd)
        part = self._part(layout.nbytes, {"path": path, "layout": layout.to_json()}, layout, lambda: _unlink(path))
        # The layout travels with every chunk (the daemon checks it); the file's own header says where each lies.
        save_file({n: t.detach().to("cpu").contiguous() for n, t in named}, path)
        return part


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class InlineProducer(Producer):
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
        return self._part(layout.nbytes, handle, layout)  # nothing outlives the call: the bytes are in it


class CudaIpcProducer(Producer):
    """A fresh IPC-exported GPU bucket per chunk (what SGLang's ``flattened_bucket`` expects).

    ``per_tensor`` (``Transport.PER_TENSOR``): nothing is flattened; the chunk is SGLang's default list of
    ``(name, tensor)``, one IPC handle per tensor (the slow baseline the buckets replace).
    """

    def __init__(self, transport: Transport, *, leases: LeaseBook | None = None) -> None:
        super().__init__(leases)
        self.transport = transport

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
        shares: list[tuple[bytes, int]] = []  # the consumers' counts torch keeps the buffer alive for
        if self.transport is Transport.PER_TENSOR:
            payload, load_format = serialize(named_tensors_payload(named), shares), "direct"
            buffers, free = [t for _, t in named], _ipc_collect
        else:
            # The flatten is queued on this stream; torch's IPC export records an event on it that
            # the engine waits for before reading, so no host sync is needed here.
            payload, bucket = export_flattened_bucket(named, shares)
            load_format, buffers = FLATTENED_BUCKET, [bucket.tensor]
            free = bucket.release  # drops the bucket and runs torch.cuda.ipc_collect() (THUDM/slime#1731)
        lease = self.leases.export(self.transport, layout.nbytes, [RefCounter.of(h, off) for h, off in shares],
                                   buffers=buffers)

        def drop() -> None:
            free()
            self.leases.release(lease)  # retained while the engine's count says it still holds the buffer

        # The layout says what the payload holds in words the daemon reads (it never unpickles the payload):
        # checked against the manifest and the other ranks' chunk, and counted for the commit's completeness.
        handle = {"payload_b64": payload, "load_format": load_format, "device_uuid": device_uuid(device.index or 0),
                  "layout": layout.to_json()}
        return self._part(layout.nbytes, handle, layout, drop)


def _ipc_collect() -> None:
    torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


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
    return CudaIpcProducer(transport, leases=leases)
