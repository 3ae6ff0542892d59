"""The ``ipc_ring`` transport, both ends: GPU buffers exported once, then per chunk only (slot, layout).

Trainer side, ``IpcRingProducer``: ``slots`` persistent buffers of ``slot_bytes`` on the trainer's GPU.
A chunk is flattened into a free slot and described as ``{ring, slot, layout}``; the first chunk
on each slot in a stream also carries the slot's CUDA IPC handle under ``open``. A slot is refilled
only after the chunk's ack (``ExportedChunk.release`` returns it), because SGLang replies before
its copy is done (research/engine-apis.md §6.4 #6). A tensor larger than a slot travels alone,
straight from its own storage (no flatten), and with ``zero_copy=True`` every tensor does: the
trainer's parameter storages are then the ring's slots, registered once, and the engine copies
from them directly (one copy of every byte instead of two).

Engine side, ``RingTable``: opens each (ring, slot) handle once and keeps it for the engine's
lifetime, so a chunk costs a dict lookup plus the copy. Opened rings are few and evicted oldest
first, since every mapping keeps the trainer's memory alive.

The wire is JSON (never a pickle): a handle is the fields of torch's own CUDA IPC reduction
(``torch/multiprocessing/reductions.py``) with the GPU named by UUID, so trainer and engine may
number GPUs differently and a handle opened on the wrong GPU is an error, not a silent P2P copy.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import socket
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.multiprocessing import reductions

from ..chunks import ChunkLayout, TensorSpec, dtype_from_name, dtype_name
from .producer import ExportedChunk

__all__ = [
    "RING_LOAD_FORMAT",
    "IpcRingProducer",
    "RingTable",
    "device_index",
    "device_uuid",
    "export_cuda_handle",
    "open_cuda_handle",
]

RING_LOAD_FORMAT = "colocd_ring"  # the load_format engines dispatch on for this transport

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


_MAX_PLANS = 4096


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a repeated chunk needs, computed once: its layout as JSON, and the slot views or regions."""

    layout: ChunkLayout
    layout_json: list[dict[str, Any]]
    views: list[torch.Tensor]  # typed views of each tensor inside its ring slot
    regions: dict[int, torch.Tensor]  # zero copy: the registered storages the layout refers to


def _device_of(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    devices = {t.device for _, t in named}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"an ipc_ring chunk needs its tensors on one CUDA device; got {sorted(map(str, devices))}")
    return devices.pop()


class IpcRingProducer:
    """Trainer side of ``ipc_ring``: persistent slot buffers, or the trainer's own storages (zero copy)."""

    transport = "ipc_ring"

    def __init__(self, *, slot_bytes: int, slots: int = 2, zero_copy: bool = False) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots >= 1 and slot_bytes >= 1, got {slots} x {slot_bytes}")
        self.ring_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.zero_copy = zero_copy
        self._buffers: list[torch.Tensor] = []  # allocated on the first chunk's device
        self._free: deque[int] = deque(range(slots))
        # Registered trainer storages, by (device, data pointer), as uint8 views. Holding the view
        # keeps the storage, so its address is not reused by another tensor while an engine maps it.
        self._regions: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self._handles: dict[int, dict[str, Any]] = {}  # slot -> its handle, exported once
        self._announced: set[int] = set()  # slots whose handle went out in this stream
        self._plans: dict[Any, _Plan] = {}

    def begin_stream(self) -> None:
        """Announce every slot again on its first use: an engine restarted since the last stream has none."""
        self._announced.clear()

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedChunk:
        """Describe one chunk; flattened into a free slot unless it travels from its own storages."""
        device = _device_of(named)
        layout = ChunkLayout.for_tensors(named)
        oversize = layout.nbytes > self.slot_bytes
        if self.zero_copy or oversize:
            if oversize and len(named) > 1:
                raise ValueError(
                    f"chunk of {layout.nbytes} bytes does not fit a {self.slot_bytes}-byte slot; "
                    "plan it with plan_buckets(bucket_bytes=slot_bytes)"
                )
            chunk = self._export_in_place(named, device, layout.nbytes)
        else:
            chunk = self._export_to_slot(named, device, layout)
        # The engine reads these bytes as soon as it gets the descriptor, on its own stream: every
        # write queued here (the flatten, or the trainer's last optimizer step) must be done first.
        torch.cuda.current_stream(device).synchronize()
        return chunk

    def _export_to_slot(
        self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device, layout: ChunkLayout
    ) -> ExportedChunk:
        if not self._buffers:
            self._buffers = [torch.empty(self.slot_bytes, dtype=torch.uint8, device=device) for _ in range(self.slots)]
        if not self._free:
            raise RuntimeError(
                f"ring {self.ring_id}: all {self.slots} slots await their ack; keep at most "
                f"{self.slots} chunks in flight"
            )
        slot = self._free.popleft()
        try:
            plan = self._slot_plan(slot, layout)
            with torch.no_grad():
                # One call per chunk: per-tensor copy_ dispatch would cost more than the copies.
                torch._foreach_copy_(plan.views, [t for _, t in named])
        except BaseException:
            self._free.append(slot)
            raise
        handle = self._describe({slot: self._buffers[slot]}, device)
        handle.update(slot=slot, layout=plan.layout_json)
        return ExportedChunk(self.transport, layout.nbytes, handle, layout, lambda: self._free.append(slot))

    def _slot_plan(self, slot: int, layout: ChunkLayout) -> _Plan:
        """Typed views of ``layout``'s tensors in ``slot``, built once per (slot, layout): a trainer
        pushes the same buckets every step."""
        key = (slot, layout)
        plan = self._plans.get(key)
        if plan is None:
            views = [
                self._buffers[slot][s.offset : s.offset + s.nbytes].view(dtype_from_name(s.dtype)).view(s.shape)
                for s in layout.tensors
            ]
            plan = self._plans[key] = _Plan(layout, layout.to_json(), views, {})
            self._trim()
        return plan

    def _export_in_place(
        self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device, nbytes: int
    ) -> ExportedChunk:
        key = tuple((name, t.data_ptr(), t.dtype, t.shape) for name, t in named)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._in_place_plan(named, nbytes)
            self._trim()
        handle = self._describe(plan.regions, device)
        handle["layout"] = plan.layout_json
        # Nothing to give back: the engine reads the trainer's own tensors, which must simply stay
        # unchanged until the ack (the trainer is waiting for the sync anyway).
        return ExportedChunk(self.transport, nbytes, handle, plan.layout)

    def _in_place_plan(self, named: Sequence[tuple[str, torch.Tensor]], nbytes: int) -> _Plan:
        entries: list[dict[str, Any]] = []
        specs: list[TensorSpec] = []
        regions: dict[int, torch.Tensor] = {}
        for name, t in named:
            if not t.is_contiguous():
                raise ValueError(
                    f"tensor {name!r} is not contiguous: it cannot be read in place; "
                    "flatten it through a ring slot (zero_copy=False) instead"
                )
            slot, base = self._region(t)
            regions[slot] = base
            spec = TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), int(t.storage_offset()) * t.element_size())
            specs.append(spec)
            entries.append({**spec.to_json(), "slot": slot})
        return _Plan(ChunkLayout(tuple(specs), nbytes), entries, [], regions)

    def _trim(self) -> None:
        if len(self._plans) > _MAX_PLANS:  # a trainer whose buckets keep changing: start over
            self._plans.clear()

    def _region(self, t: torch.Tensor) -> tuple[int, torch.Tensor]:
        """The slot id of ``t``'s storage and a uint8 view of that whole storage (registered once)."""
        storage = t.untyped_storage()
        key = (t.device.index or 0, storage.data_ptr())
        if key not in self._regions:
            base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
            self._regions[key] = (self.slots + len(self._regions), base)
        return self._regions[key]

    def _describe(self, used: dict[int, torch.Tensor], device: torch.device) -> dict[str, Any]:
        """Ring id and GPU, plus the handles of slots this stream has not announced yet."""
        opening = {}
        for slot, buffer in used.items():
            if slot not in self._announced:
                if slot not in self._handles:
                    self._handles[slot] = export_cuda_handle(buffer)
                opening[str(slot)] = self._handles[slot]
                self._announced.add(slot)
        handle: dict[str, Any] = {"ring": self.ring_id, "device_uuid": device_uuid(device.index or 0)}
        if opening:
            handle["open"] = opening
        return handle

    def close(self) -> None:
        """End of a stream: every slot is free again. Buffers and registrations persist with the producer."""
        self._free = deque(range(self.slots))


@dataclass
class _OpenRing:
    """One ring as an engine holds it: opened slots (by handle key) and views built for seen layouts."""

    slots: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    views: OrderedDict[str, list[tuple[str, torch.Tensor]]] = field(default_factory=OrderedDict)


class RingTable:
    """Engine side of ``ipc_ring``: opened slots per ring, kept while the ring is among the newest."""

    def __init__(self, max_rings: int = 4, max_layouts: int = 1024) -> None:
        self.max_rings = max_rings
        self.max_layouts = max_layouts
        self._rings: OrderedDict[str, _OpenRing] = OrderedDict()
        self.opened = 0  # handles opened so far (each costs a cudaIpcOpenMemHandle)

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
        for key, handle in dict(descriptor.get("open") or {}).items():
            self._open(ring_id, ring, int(key), handle, device)
        layout = descriptor.get("layout")
        if not isinstance(layout, list):
            raise ValueError("ipc_ring descriptor needs a 'layout' list")
        key = json.dumps([descriptor.get("slot"), layout], separators=(",", ":"))
        named = ring.views.get(key)
        if named is None:
            named = ring.views[key] = self._views(ring_id, ring, descriptor.get("slot"), layout)
            while len(ring.views) > self.max_layouts:
                ring.views.popitem(last=False)
        return list(named)

    def _views(
        self, ring_id: str, ring: _OpenRing, default_slot: Any, layout: list[Any]
    ) -> list[tuple[str, torch.Tensor]]:
        out = []
        for entry in layout:
            slot = entry.get("slot", default_slot)
            if slot not in ring.slots:
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
        if ring_id in self._rings:
            self._rings.move_to_end(ring_id)
        else:
            self._rings[ring_id] = _OpenRing()
            while len(self._rings) > self.max_rings:
                self._rings.popitem(last=False)  # its mappings close once the last view is gone
        return self._rings[ring_id]

    def _open(self, ring_id: str, ring: _OpenRing, slot: int, handle: dict[str, Any], device: torch.device) -> None:
        key = str(handle.get("handle")) + f"@{handle.get('storage_offset')}"
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
