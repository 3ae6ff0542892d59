"""The trainer side of the ``ipc_ring`` transport: GPU buffers exported once, then per chunk only (slot, layout).

``IpcRingProducer``: ``slots`` persistent buffers of ``slot_bytes`` on the trainer's GPU.
A chunk is flattened into a free slot and described as ``{ring, slot, layout}``; the first chunk
on each slot in a stream also carries the slot's CUDA IPC handle under ``open``. A slot is refilled
only after the chunk's ack (``ExportedChunk.release`` returns it), because SGLang replies before
its copy is done (research/engine-apis.md §6.4 #6). A tensor larger than a slot travels alone,
straight from its own storage (no flatten), and with ``zero_copy=True`` every tensor does: the
trainer's parameter storages are then the ring's slots, registered once, and the engine copies
from them directly (one copy of every byte instead of two).

The engine side (``RingTable``) and the JSON handle format (GPU named by UUID, never a pickle)
live in ``colocd.engines.cuda_handles``, so no engine imports trainer code.
"""

from __future__ import annotations

import os
import secrets
import socket
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engines.chunks import ChunkLayout, TensorSpec, copy_tensors, dtype_from_name, dtype_name
from ..engines.cuda_handles import device_uuid, export_cuda_handle
from ..policies import Transport
from .exported import ExportedChunk

__all__ = ["IpcRingProducer"]

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

    transport = Transport.IPC_RING  # zero_copy too: on the wire it is ipc_ring

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
                # Small tensors in one launch, large ones at memcpy bandwidth (engines.chunks.copy_tensors).
                copy_tensors(plan.views, [t for _, t in named])
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
