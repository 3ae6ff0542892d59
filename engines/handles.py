"""What the daemon reads of a chunk handle, parsed once where the chunk enters (``ChunkPart``), one type per
transport on the wire.

A handle is otherwise opaque to the daemon: the rest of it (layouts, IPC payloads, ring slots) is the
trainer's description of its bytes, which only the node-side checks (``engines/chunks.py``) and the
adapters read. The orchestration never looks a key up in a handle; it reads these fields.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import RequestInvalid
from ..policies import Transport

__all__ = ["CudaIpcRoute", "HandleRoute", "HostRoute", "RingRoute", "ShmRoute", "route_of"]


# Every route says ``device_uuid``: the GPU the trainer exported the bytes from, where its handle names one as a
# string (None: not known). A rank that did not join joins on it; CUDA IPC must land on that GPU.


@dataclass(frozen=True, slots=True)
class ShmRoute:
    """A shared-memory segment by name (checked against the colocd pattern before any engine sees it)."""

    device_uuid: str | None
    shm_name: str | None


@dataclass(frozen=True, slots=True)
class CudaIpcRoute:
    """A GPU bucket (or per-tensor handles) exported by the trainer."""

    device_uuid: str | None


@dataclass(frozen=True, slots=True)
class RingRoute:
    """A chunk in the trainer's persistent GPU ring; ``layout_ref``: the announced layout it names instead of
    carrying one (None: it carries its layout)."""

    device_uuid: str | None
    layout_ref: str | None


@dataclass(frozen=True, slots=True)
class HostRoute:
    """Bytes the engine reads from this host without a device: a file (disk) or the handle itself (inline)."""

    device_uuid: str | None


HandleRoute = ShmRoute | CudaIpcRoute | RingRoute | HostRoute


def route_of(transport: Transport, handle: Mapping[str, object]) -> HandleRoute:
    """The typed part of ``handle`` for ``transport`` (as the chunk travels: ``Transport.wire``); a
    ``layout_ref`` that is not a string is the caller's 422 naming it."""
    try:
        wire = Transport(transport).wire
    except ValueError:  # no such transport: refused, naming it, where the handle is inspected (chunks.py)
        return HostRoute(_device(handle))
    if wire is Transport.SHM:
        name = handle.get("shm_name")
        return ShmRoute(_device(handle), name if isinstance(name, str) else None)
    if wire is Transport.CUDA_IPC:
        return CudaIpcRoute(_device(handle))
    if wire is Transport.IPC_RING:
        ref = handle.get("layout_ref")
        if ref is not None and not isinstance(ref, str):
            raise RequestInvalid(f"handle.layout_ref must be a string, got {type(ref).__name__}",
                                 field="handle.layout_ref")
        return RingRoute(_device(handle), ref)
    return HostRoute(_device(handle))


def _device(handle: Mapping[str, object]) -> str | None:
    uuid = handle.get("device_uuid")
    return uuid if isinstance(uuid, str) else None
