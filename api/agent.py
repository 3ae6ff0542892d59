"""The trainer agent: drives the phases and enacts the daemon's directives inside the trainer process.

    agent = TrainerAgent(client, groups=lifecycle)      # lifecycle: engines.trainer.groups.GroupLifecycle
    await agent.train(step)      # engines release; groups are rebuilt/resumed for training
    ... train ...
    await agent.sync(step)       # groups paused per policy, cleanup runs, both reported; weights memory back
    await WeightPusher(client).push(...)
    await agent.rollout(step)

The train reply carries the decisions for the end of training (process groups, cleanup); the agent
enacts them just before it posts ``sync``, because that is when the trainer gives the GPU back.
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ..engines.trainer.cleanup import run_cleanup
from ..engines.trainer.groups import GroupLifecycle
from ..policies import CleanupPlan, GroupDirective
from .client import AsyncColocdClient

__all__ = ["TrainerAgent"]


class TrainerAgent:
    """Phase calls plus the trainer-side half of each policy; every cost is reported to the daemon."""

    def __init__(self, client: AsyncColocdClient, *, groups: GroupLifecycle | None = None,
                 device: torch.device | None = None) -> None:
        self._client = client
        self._groups = groups
        self._device = device
        self._directives: dict[str, Any] = {}
        self.last_reports: dict[str, Any] = {}

    @property
    def directives(self) -> dict[str, Any]:
        """The decisions of the last train reply (process groups, cleanup), for trainer-side work
        the agent does not enact itself (e.g. a second cleanup after offloading the weights)."""
        return self._directives

    async def train(self, step: int) -> dict[str, Any]:
        trainer = {"groups": self._groups.snapshot().model_dump(mode="json")} if self._groups else None
        reply = await self._client.phase("train", step, trainer=trainer)
        self._directives = reply.get("directives") or {}
        if self._groups is not None:
            # Rebuild (or verify kept groups) now that the engines gave the memory back.
            self.last_reports["groups_resume"] = (await asyncio.to_thread(self._groups.resume)).to_dict()
        return reply

    async def sync(self, step: int) -> dict[str, Any]:
        report: dict[str, Any] = {}
        if self._groups is not None and (d := self._directives.get("process_groups")):
            groups = await asyncio.to_thread(self._groups.pause, GroupDirective.model_validate(d))
            report["groups_report"] = groups.to_dict()
        if plan := self._directives.get("cleanup"):
            cleanup = await asyncio.to_thread(run_cleanup, CleanupPlan.model_validate(plan), device=self._device)
            report["spans"] = cleanup.spans
            report["cleanup"] = {k: v for k, v in cleanup.to_dict().items() if k != "spans"}
        self.last_reports.update(report)
        return await self._client.phase("sync", step, trainer=report or None)

    async def rollout(self, step: int) -> dict[str, Any]:
        return await self._client.phase("rollout", step)
