"""The trainer side of the ``ipc_ring`` transport: GPU buffers exported once, then per chunk only (slot, layout).

``IpcRingProducer``: ``slots`` persistent buffers of ``slot_bytes`` on the trainer's GPU.
A chunk is flattened into a free slot and described as ``{ring, slot, layout_ref}``: toward a daemon
that keeps ring records (``begin_stream(receiver)``, its join reply's ``ring_refs``) the ``layout``
list and the slots' CUDA IPC handles (``open``) travel only until that daemon acknowledged them
once (``colocd.engines.ring_refs``); toward one that does not, every chunk carries its ``layout``
and the first chunk on each slot in a stream its handle, as before. A slot is refilled
only after the chunk's ack (``ExportedPart.release`` returns it), because SGLang replies before
its copy is done (research/engine-apis.md §6.4 #6). A tensor larger than a slot travels alone,
straight from its own storage (no flatten), and with ``zero_copy=True`` every tensor does: the
trainer's parameter storages are then the ring's slots, registered once, and the engine copies
from them directly (one copy of every byte instead of two).

The engine side (``RingTable``) and the JSON handle format (GPU named by UUID, never a pickle)
live in ``colocd.engines.cuda_handles``, so no engine imports trainer code.
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..engines.chunks import ChunkLayout, LayoutEntry, TensorSpec, copy_tensors, dtype_from_name, dtype_name
from ..engines.cuda_handles import device_uuid, export_cuda_handle
from ..engines.ring_refs import layout_digest
from ..policies import Transport
from .exported import ExportedPart
from .leases import LeaseBook, RefCounter

__all__ = ["IpcRingProducer"]

_MAX_PLANS = 4096


@dataclass(frozen=True, slots=True)
class _Plan:
    """What a repeated chunk needs, computed once: its layout as JSON, and the slot views or regions."""

    layout: ChunkLayout
    layout_json: list[LayoutEntry]
    views: list[torch.Tensor]  # typed views of each tensor inside its ring slot
    regions: dict[int, torch.Tensor]  # zero copy: the registered storages the layout refers to
    ref: str  # layout_digest(layout_json)


def _device_of(named: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    devices = {t.device for _, t in named}
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"an ipc_ring chunk needs its tensors on one CUDA device; got {sorted(map(str, devices))}")
    return devices.pop()


class IpcRingProducer:
    """Trainer side of ``ipc_ring``: persistent slot buffers, or the trainer's own storages (zero copy)."""

    transport = Transport.IPC_RING  # zero_copy too: on the wire it is ipc_ring

    def __init__(self, *, slot_bytes: int, slots: int = 2, zero_copy: bool = False,
                 leases: LeaseBook | None = None) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a ring needs slots >= 1 and slot_bytes >= 1, got {slots} x {slot_bytes}")
        self.ring_id = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.slot_bytes = slot_bytes
        self.slots = slots
        self.zero_copy = zero_copy
        # Each exported slot or registered storage is a lease of this ring, released when the producer is dropped.
        self.leases = leases or LeaseBook()
        self._buffers: list[torch.Tensor] = []  # allocated on the first chunk's device
        self._free: deque[int] = deque(range(slots))
        # Registered trainer storages, by (device, data pointer), as uint8 views. Holding the view
        # keeps the storage, so its address is not reused by another tensor while an engine maps it.
        self._regions: dict[tuple[int, int], tuple[int, torch.Tensor]] = {}
        self._handles: dict[int, dict[str, Any]] = {}  # slot -> its handle, exported once
        self._announced: set[int] = set()  # no receiver: slots whose handle went out in this stream
        # The daemon ring record (RingDirectory.id) this stream goes to, and what it acknowledged holding.
        self._receiver: str | None = None
        self._held_layouts: set[str] = set()
        self._held_slots: set[int] = set()
        self._plans: dict[Any, _Plan] = {}

    def begin_stream(self, receiver: str | None = None) -> None:
        """A stream to the daemon record ``receiver``: what that record acknowledged goes by ref only. Another
        record (a restarted daemon) holds nothing, so everything is announced again. None (a daemon without
        records): every slot is announced again on its first use, since an engine restarted since the last
        stream has none."""
        if receiver is None or receiver != self._receiver:
            self._held_layouts.clear()
            self._held_slots.clear()
        self._receiver = receiver
        self._announced.clear()

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
        """Describe one chunk; flattened into a free slot unless it travels from its own storages."""
        device = _device_of(named)
        if self.zero_copy:
            chunk = self._export_in_place(named, device)  # the layout is built once per set of storages
        else:
            layout = ChunkLayout.for_tensors(named)
            if layout.nbytes > self.slot_bytes:
                if len(named) > 1:
                    raise ValueError(
                        f"chunk of {layout.nbytes} bytes does not fit a {self.slot_bytes}-byte slot; "
                        "plan it with plan_chunks(bucket_bytes=slot_bytes)"
                    )
                chunk = self._export_in_place(named, device)
            else:
                chunk = self._export_to_slot(named, device, layout)
        # The engine reads these bytes as soon as it gets the descriptor, on its own stream: every
        # write queued here (the flatten, or the trainer's last optimizer step) must be done first.
        torch.cuda.current_stream(device).synchronize()
        return chunk

    def _export_to_slot(
        self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device, layout: ChunkLayout
    ) -> ExportedPart:
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
        return self._describe({slot: self._buffers[slot]}, device, plan, slot, lambda: self._free.append(slot))

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
            layout_json = layout.to_json()
            plan = self._plans[key] = _Plan(layout, layout_json, views, {}, layout_digest(layout_json))
            self._trim()
        return plan

    def _export_in_place(self, named: Sequence[tuple[str, torch.Tensor]], device: torch.device) -> ExportedPart:
        # Keyed on where each tensor lives now: a storage that moved (an onload) is a new plan.
        key = tuple((name, t.data_ptr(), t.dtype, t.shape) for name, t in named)
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = self._in_place_plan(named, ChunkLayout.for_tensors(named).nbytes)
            self._trim()
        # Nothing to give back: the engine reads the trainer's own tensors, which must simply stay
        # unchanged until the ack (the trainer is waiting for the sync anyway).
        return self._describe(plan.regions, device, plan, None)

    def _in_place_plan(self, named: Sequence[tuple[str, torch.Tensor]], nbytes: int) -> _Plan:
        entries: list[LayoutEntry] = []
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
        return _Plan(ChunkLayout(tuple(specs), nbytes), entries, [], regions, layout_digest(entries))

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

    def _describe(self, used: dict[int, torch.Tensor], device: torch.device, plan: _Plan,
                  slot: int | None, release: Callable[[], None] | None = None) -> ExportedPart:
        """The chunk's descriptor: ring id, GPU and slot, with the layout and the slots' handles inline only
        where the receiver does not hold them yet (no receiver: the layout always, handles once a stream)."""
        for s, buffer in used.items():
            if s not in self._handles:
                self._handles[s] = handle = export_cuda_handle(buffer)
                counter = handle["ref_counter_handle"]
                self.leases.export(Transport.ZERO_COPY if self.zero_copy else self.transport, buffer.numel(),
                                   [RefCounter.of(base64.b64decode(counter), handle["ref_counter_offset"])
                                    if counter is not None else None], owner=f"ring {self.ring_id}", buffers=[buffer])
        base: dict[str, Any] = {"ring": self.ring_id, "device_uuid": device_uuid(device.index or 0)}
        if slot is not None:
            base["slot"] = slot
        if self._receiver is None:
            opening = {str(s): self._handles[s] for s in used if s not in self._announced}
            self._announced.update(used)
            handle = {**base, "layout": plan.layout_json, **({"open": opening} if opening else {})}
            return ExportedPart(self.transport, plan.layout.nbytes, handle, plan.layout, release)
        base["layout_ref"] = plan.ref
        handle = dict(base)
        if plan.ref not in self._held_layouts:
            handle["layout"] = plan.layout_json
        opening = {str(s): self._handles[s] for s in used if s not in self._held_slots}
        if opening:
            handle["open"] = opening
        receiver, slots, handles = self._receiver, tuple(used), self._handles

        def inline() -> dict[str, Any]:  # built only if the daemon turns the refs down (a 409)
            return {**base, "layout": plan.layout_json, "open": {str(s): handles[s] for s in slots}}

        def acked() -> None:
            if self._receiver == receiver:  # not a record this producer has since moved away from
                self._held_layouts.add(plan.ref)
                self._held_slots.update(slots)

        return ExportedPart(self.transport, plan.layout.nbytes, handle, plan.layout, release,
                             announce=inline, acked=acked)

    def close(self) -> None:
        """End of a stream: every slot is free again. Buffers and registrations persist with the producer."""
        self._free = deque(range(self.slots))
