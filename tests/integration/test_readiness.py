"""Readiness tells the truth: ``/readyz`` (``Daemon.ready``) is false, naming the engine and why, while an engine
cannot be driven; a failed reconcile is retried soon, not at the next health tick; a relaunched reference engine
serves nothing before the daemon lets it."""

from __future__ import annotations

import asyncio
import time

from support import InMemoryEngine, in_process_daemon

from colocd.engines.base import Observation
from colocd.errors import EngineRejected
from colocd.policies import Transport

HEALTH_S = 30.0  # a tick far beyond every wait here: what happens sooner is not the health loop's tick


class SessionStuckEngine(InMemoryEngine):
    """An in-memory engine left with an update session open (a daemon died mid-push) that refuses to end it
    until ``fixed`` is set: the daemon's reconcile of it fails until then."""

    transports = frozenset({Transport.SHM, Transport.DISK})

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.fixed = False
        self.open = True
        self.ends = 0

    async def observe(self) -> Observation:
        return Observation(incarnation="one", weight_version="v0", paused=True, update_session_open=self.open)

    async def end_weight_update(self, version: str | None = None) -> None:
        self.ends += 1
        if not self.fixed:
            raise EngineRejected(self.name, "end_weight_update: busy", status=503)
        self.open = False


async def test_an_engine_whose_reconcile_failed_is_not_ready_and_is_retried_before_the_next_health_tick() -> None:
    engine = SessionStuckEngine("e0")
    async with in_process_daemon({"e0": engine}, timeouts={"health_interval_s": HEALTH_S}) as daemon:
        ready, problems = daemon.ready()
        assert not ready and len(problems) == 1
        assert "engine 'e0'" in problems[0] and "busy" in problems[0]  # which engine, and why
        engine.fixed = True  # whatever held it is gone
        started = time.monotonic()
        async with asyncio.timeout(HEALTH_S / 3):
            while not daemon.ready()[0]:  # noqa: ASYNC110 - polls the daemon's own retry, bounded
                await asyncio.sleep(0.02)
        assert time.monotonic() - started < HEALTH_S / 3 and not engine.open
