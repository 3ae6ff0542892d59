"""Trainer-side chunk export: copy a bucket of tensors into a transport buffer and describe it.

A producer hands out ``ExportedChunk`` objects; the trainer must call ``release()`` only after the
daemon acked the chunk (every engine consumed it). Until then the buffer stays alive and untouched.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..chunks import ChunkLayout, SharedSegment, flatten_into

__all__ = ["DiskProducer", "ExportedChunk", "Producer", "ShmProducer", "producer_for"]


@dataclass
class ExportedChunk:
    """A chunk ready to describe to the daemon; ``release`` frees its buffer (after the ack)."""

    transport: str
    nbytes: int
    handle: dict[str, Any]
    layout: ChunkLayout
    _release: Any = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()


class Producer(Protocol):
    transport: str

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedChunk: ...
    def close(self) -> None: ...


class ShmProducer:
    """POSIX shared memory by name: the CPU path. One fresh segment per chunk, unlinked on release."""

    transport = "shm"

    def __init__(self) -> None:
        self._live: dict[str, SharedSegment] = {}

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedChunk:
        layout = ChunkLayout.for_tensors(named)
        segment = SharedSegment.create(layout.nbytes)
        self._live[segment.name] = segment
        try:
            cpu_named = [(n, t.detach().to("cpu")) for n, t in named]
            flatten_into(segment.tensor(), layout, cpu_named)
        except BaseException:
            self._drop(segment.name)
            raise
        handle = {"shm_name": segment.name, "nbytes": layout.nbytes, "layout": layout.to_json()}
        return ExportedChunk("shm", layout.nbytes, handle, layout, lambda: self._drop(segment.name))

    def _drop(self, name: str) -> None:
        segment = self._live.pop(name, None)
        if segment is not None:
            segment.close()
            segment.unlink()

    def close(self) -> None:
        """Unlink every segment still alive (abort / error paths): nothing left in /dev/shm."""
        for name in list(self._live):
            self._drop(name)


class DiskProducer:
    """A safetensors file per chunk: the fallback when no shared memory or IPC path is available."""

    transport = "disk"

    def __init__(self, directory: str | None = None) -> None:
        self._dir = directory or tempfile.mkdtemp(prefix="colocd-disk-")
        self._live: set[str] = set()

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedChunk:
        from safetensors.torch import save_file

        layout = ChunkLayout.for_tensors(named)
        fd, path = tempfile.mkstemp(suffix=".safetensors", dir=self._dir)
        os.close(fd)
        self._live.add(path)
        save_file({n: t.detach().to("cpu").contiguous() for n, t in named}, path)
        return ExportedChunk("disk", layout.nbytes, {"path": path}, layout, lambda: self._drop(path))

    def _drop(self, path: str) -> None:
        self._live.discard(path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        for path in list(self._live):
            self._drop(path)


def producer_for(transport: str) -> Producer:
    if transport == "shm":
        return ShmProducer()
    if transport == "disk":
        return DiskProducer()
    raise ValueError(f"transport {transport!r} has no producer here (CUDA transports come with a GPU)")
