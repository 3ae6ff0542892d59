"""Asynchronous weight sync: snapshot the weights into a second buffer, push from it in the background.

``AsyncWeightSync(WeightPusher(client))`` (or a ``DistributedWeightSender``) goes to ``TrainerAgent(weight_sync=)``,
which makes it follow the replies' directives and joins the push before ``rollout``; ``start()`` after ``sync``
returns once the copy is made. The push runs as a task on this event loop, so the trainer's work must yield to it
(``asyncio.to_thread``); the snapshot is freed as the push ends. Where the second buffer goes, and the fallback when
none fits: docs/policies.md, "sync". It pays on separated GPUs (the broadcast runs while the trainer computes);
colocated, what overlaps is the trainer's post-step work, at the cost of a second copy of the weights meanwhile."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable
from typing import Any, Literal

import torch

from .broadcast import DistributedWeightSender
from .push import PushReport, WeightPusher, free_bytes

__all__ = ["AsyncWeightSync", "WeightSender", "choose_buffer"]

_MIB = 1 << 20
BufferKind = Literal["device", "pinned_cpu", "none"]
# Producers that read host tensors; the others need each chunk's tensors on a CUDA device.
_HOST_READABLE = frozenset({"shm", "disk", "inline"})
WeightSender = WeightPusher | DistributedWeightSender  # what ``AsyncWeightSync`` drives


def choose_buffer(nbytes: int, device: torch.device, *, wanted: str = "auto", margin_bytes: int,
                  host_ok: bool) -> tuple[BufferKind, str]:
    """Where a snapshot of ``nbytes`` goes, and why: the device if it fits there with the margin, else pinned host
    memory (for CUDA tensors and a sender that reads host tensors: ``host_ok``), else none (push synchronously)."""
    need = nbytes + margin_bytes
    notes = []

    def mib(n: int | None) -> str:
        return "unknown" if n is None else f"{n / _MIB:.0f} MiB"

    if wanted in ("auto", "device"):
        if (free := free_bytes(device)) is not None and free >= need:
            return "device", f"{mib(nbytes)} copy on {device} ({mib(free)} free)"
        notes.append(f"{device} has {mib(free)} free, needs {mib(need)} (copy + margin)")
    if wanted in ("auto", "pinned_cpu"):
        if device.type != "cuda":
            notes.append("pinned host memory only stages CUDA tensors")
        elif not host_ok:
            notes.append("the sender's transport needs device tensors, not a host snapshot")
        elif (free := free_bytes(torch.device("cpu"))) is not None and free >= need:
            return "pinned_cpu", f"{mib(nbytes)} pinned host copy ({mib(free)} available)"
        else:
            notes.append(f"host has {mib(free)} available, needs {mib(need)}")
    return "none", "no room for a second buffer: " + "; ".join(notes)


def _snapshot(named: list[tuple[str, torch.Tensor]], kind: BufferKind) -> list[tuple[str, torch.Tensor]]:
    """Copy every tensor into the second buffer: device copies queued on the current stream (the trainer's later
    kernels cannot overwrite a source first), host copies waited for (the push reads finished bytes)."""
    out = []
    for name, tensor in named:
        src = tensor.detach()
        if kind == "pinned_cpu":
            dst = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
            dst.copy_(src, non_blocking=True)
        else:
            dst = torch.empty_like(src, memory_format=torch.contiguous_format).copy_(src)
        out.append((name, dst))
    if kind == "pinned_cpu":
        torch.cuda.current_stream().synchronize()
    return out


class AsyncWeightSync:
    """One push at a time, from a snapshot, in the background (``mode="async"``) or awaited (``"sync"``).
    ``mode``, ``second_buffer`` and ``margin_mb`` are the policy's ``sync`` section (``follow``)."""

    def __init__(self, sender: WeightSender, *, mode: str = "async", second_buffer: str = "auto",
                 margin_mb: float = 1024) -> None:
        self._sender = sender
        self.mode = mode
        self.second_buffer = second_buffer
        self.margin_bytes = int(margin_mb * _MIB)
        self._task: asyncio.Task[PushReport] | None = None
        self._report: dict[str, Any] | None = None
        self.last_push: PushReport | None = None

    def follow(self, directive: dict[str, Any] | None) -> None:
        """Adopt a phase reply's ``directives["weight_sync"]``, as ``TrainerAgent`` does."""
        if not directive:
            return
        self.mode = str(directive.get("mode", self.mode))
        self.second_buffer = str(directive.get("second_buffer", self.second_buffer))
        if directive.get("buffer_margin_mb") is not None:
            self.margin_bytes = int(directive["buffer_margin_mb"]) * _MIB

    async def start(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str,
                    step: int | None = None) -> None:
        """Join the previous push, then push ``named`` as ``version``: returns after the snapshot (async) or the
        commit (sync, or a fallback)."""
        await self.join()
        named = list(named)
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        device = next((t.device for _, t in named), torch.device("cpu"))
        report: dict[str, Any] = {"requested": self.mode, "version": version, "started_version": version,
                                  "buffer": "none", "fallback_reason": None}
        if self.mode == "async":
            # The broadcast sender stages each bucket onto its device itself.
            host_ok = not isinstance(self._sender, WeightPusher) or self._sender.transport_for(device) in _HOST_READABLE
            kind, why = choose_buffer(nbytes, device, wanted=self.second_buffer, margin_bytes=self.margin_bytes,
                                      host_ok=host_ok)
            if kind == "none":
                report["fallback_reason"] = why
            else:
                t0 = time.perf_counter()
                snapshot = await asyncio.to_thread(_snapshot, named, kind)
                report.update(mode="async", buffer=kind, buffer_bytes=nbytes, snapshot_s=time.perf_counter() - t0)
                self._report = report

                async def push() -> PushReport:  # the task alone holds the snapshot: freed once the push ended
                    t0 = time.perf_counter()
                    try:
                        return await self._sender.push(snapshot, version=version, step=step)
                    finally:
                        report["push_s"] = time.perf_counter() - t0

                self._task = asyncio.ensure_future(push())
                return
        t0 = time.perf_counter()
        self.last_push = await self._sender.push(named, version=version, step=step)
        report.update(mode="sync", push_s=time.perf_counter() - t0, join_wait_s=0.0, overlap_s=0.0)
        self._report = report

    async def join(self) -> PushReport | None:
        """Wait for the background push (if any) to commit. Re-raises the push's error."""
        task, self._task = self._task, None
        if task is None:
            return None
        t0 = time.perf_counter()
        try:
            self.last_push = await task
        finally:
            waited = time.perf_counter() - t0
            if self._report is not None:
                self._report["join_wait_s"] = waited
                self._report["overlap_s"] = max(0.0, float(self._report.get("push_s") or 0.0) - waited)
        return self.last_push

    def report(self) -> dict[str, Any] | None:
        """What the last push did, as the daemon's ``trainer.weights`` reads it (None before the first)."""
        return None if self._report is None else dict(self._report)

