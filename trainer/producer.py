"""Trainer-side chunk export: copy a bucket of tensors into a transport buffer and describe it.

A producer hands out ``ExportedPart`` objects, released only after the daemon acked the chunk (every engine
consumed it): SGLang replies before its copy has finished (research/engine-apis.md §6.4 #6), so the ack is
what licenses reuse. One ``Producer`` per ``Transport``.
"""

from __future__ import annotations

import base64
import logging
import os
import pickle
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..engines.chunks import ChunkLayout, SharedSegment, flatten_into
from ..engines.segments import reclaim_dead_segments
from ..policies import Transport
from .leases import LeaseBook, RefCounter, ipc_collect

__all__ = ["ExportedPart", "Producer", "transport_named"]

logger = logging.getLogger(__name__)


@dataclass(eq=False)
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
    the call is held here until its chunk's ``release`` (or ``close``, on abort and error paths). Its exported
    buffers are leases in ``leases`` (default: its own book). An ``shm`` producer first unlinks the segments of
    trainers that died on this node without unlinking theirs (``engines/segments.py``)."""

    def __init__(self, transport: Transport | str, *, leases: LeaseBook | None = None) -> None:
        self.transport = transport_named(transport)
        self.leases = leases or LeaseBook()
        self._live: set[ExportedPart] = set()
        self._dir: str | None = None  # disk: this producer's folder, made at its first chunk
        if self.transport is Transport.SHM and (reclaimed := reclaim_dead_segments()):
            logger.info("unlinked %d shared-memory segment(s) of dead processes (%d bytes): %s", len(reclaimed),
                        sum(r.nbytes for r in reclaimed), ", ".join(r.name for r in reclaimed))

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        layout = ChunkLayout.for_tensors(named)
        if self.transport is Transport.SHM:
            return self._shm(named, layout)
        if self.transport is Transport.DISK:
            return self._disk(named, layout)
        if self.transport is Transport.INLINE:
            return self._inline(named, layout)
        return self._cuda_ipc(named, layout)

    def close(self) -> None:
        """Free every buffer still held: nothing left in /dev/shm, on disk or exported."""
        for part in list(self._live):
            part.release()

    def _part(self, handle: dict[str, Any], layout: ChunkLayout,
              drop: Callable[[], None] | None = None) -> ExportedPart:
        """The chunk (``handle`` plus its layout); ``drop`` (what frees its buffer) runs once, at release or close."""
        part = ExportedPart(self.transport.wire, layout.nbytes, {**handle, "layout": layout.to_json()}, layout)
        if drop is not None:
            def release() -> None:
                self._live.discard(part)
                drop()

            part._release = release
            self._live.add(part)
        return part

    def _shm(self, named: Sequence[tuple[str, torch.Tensor]], layout: ChunkLayout) -> ExportedPart:
        """POSIX shared memory by name: one fresh segment per chunk, unlinked on release."""
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
        return self._part({"shm_name": segment.name, "nbytes": layout.nbytes}, layout, drop)

    def _disk(self, named: Sequence[tuple[str, torch.Tensor]], layout: ChunkLayout) -> ExportedPart:
        """A safetensors file per chunk: the fallback when no shared memory or IPC path is available."""
        from safetensors.torch import save_file

        self._dir = self._dir or tempfile.mkdtemp(prefix="colocd-disk-")
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._dir)
        os.close(fd)
        part = self._part({"path": path}, layout, lambda: Path(path).unlink(missing_ok=True))
        # The layout travels with every chunk (the daemon checks it); the file's own header says where each lies.
        save_file({n: t.detach().to("cpu").contiguous() for n, t in named}, path)
        return part

    def _inline(self, named: Sequence[tuple[str, torch.Tensor]], layout: ChunkLayout) -> ExportedPart:
        """The chunk's bytes in its descriptor: base64 of a plain ``pickle`` of SGLang's ``flattened_bucket``, the
        CPU format a real SGLang's ``update_weights_from_tensor`` loads on any device. Plain pickle carries the
        tensor by value (ForkingPickler's fd sharing needs the sender's multiprocessing key; SGLang's scheduler
        dies on it). Bounded by the daemon's request size. The daemon never unpickles it (``engines/inline.py``)."""
        from ..engines.sglang.payload import FLATTENED_BUCKET, metadata_for_layout

        buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
        flatten_into(buffer, layout, [(n, t.detach().to("cpu")) for n, t in named])
        payload = pickle.dumps({"flattened_tensor": buffer, "metadata": list(metadata_for_layout(layout))})
        handle = {"payload_b64": base64.b64encode(payload).decode("ascii"), "load_format": FLATTENED_BUCKET}
        return self._part(handle, layout)  # nothing outlives the call: the bytes are in it

    def _cuda_ipc(self, named: Sequence[tuple[str, torch.Tensor]], layout: ChunkLayout) -> ExportedPart:
        """A fresh IPC-exported GPU bucket per chunk (SGLang's ``flattened_bucket``); ``per_tensor``: SGLang's
        default list of ``(name, tensor)``, one IPC handle per tensor (the slow baseline the buckets replace)."""
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
        shares: list[tuple[bytes, int]] = []  # the consumers' counts torch keeps the buffer alive for
        if self.transport is Transport.PER_TENSOR:
            payload, load_format = serialize(named_tensors_payload(named), shares), "direct"
            buffers, free = [t for _, t in named], ipc_collect
        else:
            # The flatten is queued on this stream; torch's IPC export records an event on it that
            # the engine waits for before reading, so no host sync is needed here.
            payload, bucket = export_flattened_bucket(named, shares)
            load_format, buffers = FLATTENED_BUCKET, [bucket.tensor]
            free = bucket.release  # drops the bucket and runs torch.cuda.ipc_collect() (THUDM/slime#1731)
        # Each share's ``ref_counter_handle``/``ref_counter_offset`` (``_share_cuda_()``): a consumer's count.
        counters = [RefCounter(handle.decode(), offset) for handle, offset in shares]
        lease = self.leases.export(self.transport, layout.nbytes, counters, buffers=buffers)

        def drop() -> None:
            free()
            self.leases.release(lease)  # retained while the engine's count says it still holds the buffer

        # The layout is what the daemon reads of the payload (checked against the manifest and the other ranks').
        handle = {"payload_b64": payload, "load_format": load_format, "device_uuid": device_uuid(device.index or 0)}
        return self._part(handle, layout, drop)


def transport_named(name: Transport | str) -> Transport:
    """The transport of that name; an unknown one is a ValueError naming the known."""
    try:
        return Transport(name)
    except ValueError:
        raise ValueError(f"unknown transport {name!r}; known: {[t.value for t in Transport]}") from None

