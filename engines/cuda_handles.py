"""CUDA IPC handles as JSON, and the engine side of the ``ipc_ring`` transport.

Both ends use this module: the trainer (``colocd.trainer.ring``) exports GPU buffers with
``export_cuda_handle``; an engine opens them with ``open_cuda_handle`` and keeps each ring's slots
in a ``RingTable``. A handle is the fields of torch's own CUDA IPC reduction
(``torch/multiprocessing/reductions.py``) with the GPU named by UUID, so trainer and engine may
number GPUs differently and a handle opened on the wrong GPU is an error, not a silent P2P copy.
The wire is JSON, never a pickle.

``RingTable`` opens each (ring, slot) handle once and keeps it for the engine's lifetime, so a chunk
costs a dict lookup plus the copy. Opened rings are few and evicted oldest first, since every mapping
keeps the trainer's memory alive. A descriptor may name its layout by ``layout_ref`` alone once the
table has seen that layout (``colocd.engines.ring_refs``): a ref or slot it does not hold is refused
with ``UNKNOWN_REF_MARK`` in the message, so the sender re-sends the chunk in full.
"""

from __future__ import annotations

import base64
import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing import reductions

from ..recent import remember
from .chunks import TensorSpec, dtype_from_name
from .ring_refs import UNKNOWN_REF_MARK, handle_key, layout_digest

__all__ = [
    "RingTable",
    "device_index",
    "device_uuid",
    "export_cuda_handle",
    "open_cuda_handle",
]


# reduce_tensor's CUDA argument tuple (torch/multiprocessing/reductions.py), by index.
_DEVICE, _HANDLE, _SIZE, _OFFSET = 6, 7, 8, 9
_REF_HANDLE, _REF_OFFSET, _EVENT_HANDLE, _EVENT_SYNC = 11, 12, 13, 14


def device_uuid(index: int) -> str:
    """The GPU's UUID in SGLang's spelling (utils/patch_torch.py:86), stable across CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; a clear error if it cannot see that GPU."""
    visible = [device_uuid(i) for i in range(torch.cuda.device_count())]
    if uuid not in visible:
        raise ValueError(f"CUDA IPC handle names GPU {uuid}, which this process cannot see (it sees {visible})")
    return visible.index(uuid)


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode("ascii")


def _unb64(text: Any, what: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"CUDA IPC handle field {what!r} must be a base64 string")
    return base64.b64decode(text, validate=True)


def export_cuda_handle(buffer: torch.Tensor) -> dict[str, Any]:
    """A JSON handle for a contiguous 1-D uint8 CUDA tensor; ``buffer`` must outlive every user."""
    if not (buffer.is_cuda and buffer.dtype == torch.uint8 and buffer.dim() == 1 and buffer.is_contiguous()):
        raise ValueError("only a contiguous 1-D uint8 CUDA tensor can be exported as a ring slot")
    _, args = reductions.reduce_tensor(buffer)  # type: ignore[no-untyped-call]
    return {
        "device_uuid": device_uuid(int(args[_DEVICE])),
        "handle": _b64(args[_HANDLE]),
        "storage_bytes": int(args[_SIZE]),
        "storage_offset": int(args[_OFFSET]),
        "tensor_offset": int(buffer.storage_offset()),
        "nbytes": int(buffer.numel()),
        "ref_counter_handle": _b64(args[_REF_HANDLE]),
        "ref_counter_offset": int(args[_REF_OFFSET]),
        "event_handle": _b64(args[_EVENT_HANDLE]),
        "event_sync_required": bool(args[_EVENT_SYNC]),
    }


def open_cuda_handle(data: dict[str, Any]) -> torch.Tensor:
    """The uint8 tensor an ``export_cuda_handle`` dict describes, mapped into this process."""
    try:
        event = data.get("event_handle")
        args = (
            torch.Tensor,
            (int(data["nbytes"]),),
            (1,),
            int(data["tensor_offset"]),
            torch.UntypedStorage,
            torch.uint8,
            device_index(str(data["device_uuid"])),
            _unb64(data["handle"], "handle"),
            int(data["storage_bytes"]),
            int(data["storage_offset"]),
            False,
            _unb64(data["ref_counter_handle"], "ref_counter_handle"),
            int(data["ref_counter_offset"]),
            None if event is None else _unb64(event, "event_handle"),
            bool(data["event_sync_required"]),
        )
    except KeyError as exc:
        raise ValueError(f"CUDA IPC handle lacks field {exc.args[0]!r}") from None
    tensor: torch.Tensor = reductions.rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
    return tensor


@dataclass
class _OpenRing:
    """One ring as an engine holds it: opened slots (by handle key) and views built for seen layouts."""

    slots: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    views: OrderedDict[str, list[tuple[str, torch.Tensor]]] = field(default_factory=OrderedDict)
    layouts: OrderedDict[str, list[Any]] = field(default_factory=OrderedDict)  # layout_ref -> its layout list


class RingTable:
    """Engine side of ``ipc_ring``: opened slots per ring, kept while the ring is among the newest."""

    def __init__(self, max_rings: int = 4, max_layouts: int = 1024) -> None:
        self.max_rings = max_rings
        self.max_layouts = max_layouts
        self._rings: OrderedDict[str, _OpenRing] = OrderedDict()
        self.opened = 0  # handles opened so far (each costs a cudaIpcOpenMemHandle)
        # The last named_tensors call: seconds opening (or re-checking) announced handles, and building or
        # looking up the views (the engine's per-stage breakdown of a load).
        self.last_stages: dict[str, float] = {}

    def named_tensors(self, descriptor: dict[str, Any], device: torch.device) -> list[tuple[str, torch.Tensor]]:
        """Views of a chunk's tensors in the ring's slots, opening the handles it announces; no copy.

        Views are cached per layout: a trainer sends the same buckets every step, and building
        hundreds of views per chunk would cost more than the copy.
        """
        if device.type != "cuda":
            raise ValueError(f"ipc_ring chunks are CUDA memory; this engine runs on {device}")
        ring_id = descriptor.get("ring")
        if not isinstance(ring_id, str) or not ring_id:
            raise ValueError("ipc_ring descriptor needs a 'ring' id")
        ring = self._ring(ring_id)
        t0 = time.perf_counter()
        for key, handle in dict(descriptor.get("open") or {}).items():
            self._open(ring_id, ring, int(key), handle, device)
        t1 = time.perf_counter()
        layout, key = self._layout(ring_id, ring, descriptor)
        named = ring.views.get(key)
        if named is None:
            if layout is None:
                layout = self._known_layout(ring_id, ring, str(descriptor["layout_ref"]))
            named = self._views(ring_id, ring, descriptor.get("slot"), layout, by_ref="layout_ref" in descriptor)
            remember(ring.views, key, named, self.max_layouts)
        self.last_stages = {"open_s": t1 - t0, "views_s": time.perf_counter() - t1}
        return list(named)

    def _layout(self, ring_id: str, ring: _OpenRing, descriptor: dict[str, Any]) -> tuple[list[Any] | None, str]:
        """The descriptor's layout list where it carries one (recorded under its ref), and its views' cache key.

        By ref the key is (slot, ref), so a repeated chunk costs no JSON at all; without one, (slot, layout)."""
        layout = descriptor.get("layout")
        if layout is not None and not isinstance(layout, list):
            raise ValueError("ipc_ring descriptor needs a 'layout' list")
        ref = descriptor.get("layout_ref")
        if ref is None:
            if layout is None:
                raise ValueError("ipc_ring descriptor needs a 'layout' list (or a 'layout_ref' to one sent before)")
            return layout, json.dumps([descriptor.get("slot"), layout], separators=(",", ":"))
        if not isinstance(ref, str) or not ref:
            raise ValueError("layout_ref must be a non-empty string")
        if layout is not None:
            if layout_digest(layout) != ref:
                raise ValueError(f"ring {ring_id}: layout_ref {ref!r} is not the digest of the layout it carries")
            remember(ring.layouts, ref, layout, self.max_layouts)
        return layout, json.dumps([descriptor.get("slot"), ref])

    def _known_layout(self, ring_id: str, ring: _OpenRing, ref: str) -> list[Any]:
        layout = ring.layouts.get(ref)
        if layout is None:
            raise ValueError(f"ring {ring_id}: layout_ref {ref!r} is not held here ({UNKNOWN_REF_MARK}): "
                             "this engine restarted or dropped the ring since that layout was sent; send it again")
        ring.layouts.move_to_end(ref)
        return layout

    def _views(
        self, ring_id: str, ring: _OpenRing, default_slot: Any, layout: list[Any], *, by_ref: bool = False
    ) -> list[tuple[str, torch.Tensor]]:
        out = []
        for entry in layout:
            slot = entry.get("slot", default_slot)
            if slot not in ring.slots:
                if by_ref:  # the sender believed this engine holds the slot: it must re-send the handle
                    raise ValueError(f"ring {ring_id} slot {slot} was never opened here ({UNKNOWN_REF_MARK}): "
                                     "this engine restarted or dropped the ring; send the slot's handle again")
                raise ValueError(
                    f"ring {ring_id} slot {slot} was never opened here: the first chunk on a slot in a "
                    "stream carries its handle (did the engine restart mid-stream?)"
                )
            spec = TensorSpec.from_json(entry)
            base = ring.slots[slot][1]
            if spec.offset + spec.nbytes > base.numel():
                raise ValueError(
                    f"tensor {spec.name!r} ends at byte {spec.offset + spec.nbytes}, past ring {ring_id} "
                    f"slot {slot}'s {base.numel()} bytes"
                )
            raw = base[spec.offset : spec.offset + spec.nbytes]
            out.append((spec.name, raw.view(dtype_from_name(spec.dtype)).reshape(spec.shape)))
        return out

    def _ring(self, ring_id: str) -> _OpenRing:
        ring = self._rings.get(ring_id) or _OpenRing()
        remember(self._rings, ring_id, ring, self.max_rings)  # a dropped ring's mappings close with its last view
        return ring

    def _open(self, ring_id: str, ring: _OpenRing, slot: int, handle: dict[str, Any], device: torch.device) -> None:
        key = handle_key(handle)
        if slot in ring.slots and ring.slots[slot][0] == key:
            return  # announced again in a new stream; already open
        tensor = open_cuda_handle(handle)
        if tensor.device != device:
            raise ValueError(
                f"ring {ring_id} slot {slot} lives on GPU {handle.get('device_uuid')} ({tensor.device} "
                f"here) but this engine runs on {device}: trainer rank and engine TP rank must "
                "share a GPU"
            )
        ring.slots[slot] = (key, tensor)
        ring.views.clear()  # views into the slot's old mapping are stale
        self.opened += 1
