"""The trainer agent: drives the phases and enacts the daemon's directives inside the trainer process. What each
phase call does, ``overlap_groups``, ``freeing`` and ``weight_sync`` (joined before ``rollout``): docs/client.md."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from typing import Any

import torch

from ..api.client import AsyncColocdClient, ColocdHTTPError
from ..policies import CleanupPlan, GroupDirective
from .async_push import AsyncWeightSync
from .cleanup import run_cleanup
from .groups import GroupLifecycle, GroupReport

__all__ = ["Freeing", "TrainerAgent"]

# Trainer work that gives GPU memory back: running already, or started by the agent after its cleanup.
Freeing = Awaitable[object] | Callable[[], Awaitable[object]]


class TrainerAgent:
    """Phase calls plus the trainer-side half of each policy; every cost is reported to the daemon."""

    def __init__(self, client: AsyncColocdClient, *, groups: GroupLifecycle | None = None,
                 device: torch.device | None = None, overlap_groups: bool = False,
                 weight_sync: AsyncWeightSync | None = None) -> None:
        self._client = client
        self._weight_sync = weight_sync
        self._groups = groups
        self._device = device
        self._overlap = overlap_groups
        # The decisions of the last train reply, also for trainer-side work the agent does not enact itself.
        self.directives: dict[str, Any] = {}
        # Group work running in the background (overlap_groups): the report key and its task.
        self._pending: tuple[str, asyncio.Future[GroupReport]] | None = None
        self.last_reports: dict[str, Any] = {}

    async def groups_ready(self) -> float:
        """Wait for group work started in the background (if any); returns the seconds waited."""
        if self._pending is None:
            return 0.0
        key, task = self._pending
        t0 = time.perf_counter()
        try:
            report = await task
        finally:
            self._pending = None
        self.last_reports[key] = asdict(report)  # JSON-ready: what the daemon is sent
        return time.perf_counter() - t0

    async def train(self, step: int) -> dict[str, Any]:
        # A pause still running (a rollout posted before it ended): the snapshot must see where it ended,
        # and its report, which the rollout call could not carry, travels with this call.
        unreported = self._pending is not None and self._pending[0] == "groups_report"
        await self.groups_ready()
        trainer: dict[str, Any] | None = None
        if self._groups is not None:
            trainer = {"groups": self._groups.snapshot().model_dump(mode="json")}
            if unreported:
                trainer["groups_report"] = self.last_reports["groups_report"]
        reply = await self._client.phase("train", step, trainer=trainer)
        self.directives = reply.get("directives") or {}
        if self._weight_sync is not None:
            self._weight_sync.follow(self.directives.get("weight_sync"))
        if self._groups is not None:
            # Rebuild (or verify kept groups) now that the engines gave the memory back.
            resume = asyncio.ensure_future(asyncio.to_thread(self._groups.resume))
            self._pending = ("groups_resume", resume)
            if not self._overlap:
                await self.groups_ready()
        return reply

    async def sync(self, step: int, *, freeing: Freeing | None = None) -> dict[str, Any]:
        await self.groups_ready()  # the resume, if the caller did not wait for it
        report: dict[str, Any] = {}
        if self._groups is not None and (d := self.directives.get("process_groups")):
            pause = asyncio.ensure_future(asyncio.to_thread(self._groups.pause, GroupDirective.model_validate(d)))
            self._pending = ("groups_report", pause)
            if not self._overlap:
                await self.groups_ready()
                report["groups_report"] = self.last_reports["groups_report"]
        if plan := self.directives.get("cleanup"):
            cleanup = await asyncio.to_thread(run_cleanup, CleanupPlan.model_validate(plan), device=self._device)
            report["spans"] = cleanup.spans
            report["cleanup"] = {k: v for k, v in asdict(cleanup).items() if k != "spans"}
        self.last_reports.update(report)
        reply = await self._post_when_room("sync", step, report or None, freeing)
        if self._weight_sync is not None:
            self._weight_sync.follow((reply.get("directives") or {}).get("weight_sync"))
        return reply

    async def rollout(self, step: int, *, freeing: Freeing | None = None) -> dict[str, Any]:
        trainer = None
        freeing = freeing() if callable(freeing) else freeing
        if self._pending is not None and self._pending[0] == "groups_report":
            if freeing is None:
                # The background pause must have freed the groups' memory before the engines resume.
                self.last_reports["groups_pause_wait_s"] = await self.groups_ready()
                trainer = {"groups_report": self.last_reports["groups_report"]}
            else:  # the daemon's headroom check decides whether the engines may resume before it ends
                freeing = self._together(freeing, self._pending[1])
        if self._weight_sync is not None:
            await self._weight_sync.join()  # the engines serve only a committed version
            if (weights := self._weight_sync.report()) is not None:
                trainer = {**(trainer or {}), "weights": weights}
                self.last_reports["weights"] = weights
        try:
            return await self._post_when_room("rollout", step, trainer, freeing)
        except ColocdHTTPError as exc:
            if self._weight_sync is None or exc.status != 409 or "stale" not in (exc.body.get("state") or {}):
                raise
            await self._weight_sync.join()  # a push started elsewhere meanwhile: let it land, then retry once
            return await self._client.phase("rollout", step, trainer=trainer)

    async def _post_when_room(self, phase: str, step: int, trainer: dict[str, Any] | None,
                              freeing: Freeing | None) -> dict[str, Any]:
        """Post ``phase``; with ``freeing``, at once, and again once it is done if the daemon refused the
        engines' resume for lack of free GPU memory (409 naming ``headroom``)."""
        freeing = freeing() if callable(freeing) else freeing
        try:
            reply = await self._client.phase(phase, step, trainer=trainer)
        except ColocdHTTPError as exc:
            if freeing is None or exc.status != 409 or "headroom" not in (exc.body.get("state") or {}):
                raise
            t0 = time.perf_counter()
            await freeing
            waited = time.perf_counter() - t0
            reply = await self._client.phase(phase, step, trainer=trainer)
            self.last_reports[f"{phase}_room"] = {"early": False, "waited_s": waited,
                                                  "refused": str(exc.body.get("message", ""))}
            return reply
        if freeing is not None:
            self.last_reports[f"{phase}_room"] = {"early": True, "waited_s": 0.0}
        return reply

    @staticmethod
    def _together(*work: Awaitable[object]) -> asyncio.Future[None]:
        """One task that ends when all of ``work`` has; its failure is kept by the task, not logged."""
        async def both() -> None:
            for w in work:
                await w
        task = asyncio.ensure_future(both())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task
