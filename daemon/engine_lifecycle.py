"""Engine lifecycle: the engines as processes the daemon watches. The journal restore a restarted daemon starts
from, the first reconcile of every engine, the health loop that reconciles them on every tick, a relaunched
engine's reconcile, and why an engine cannot be driven now (``/readyz``). Reconciling is the engine sync's
(daemon/sync.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from ..engines.base import MemoryTag
from ..engines.segments import reclaim_dead_segments
from ..policies import Budget, Timeouts
from .engine_ops import EngineHandle
from .events import emit
from .fanout import OnFailure, fan_out
from .journal import Journal
from .metrics import Metrics
from .policy_runtime import PolicyRuntime
from .states import DaemonState, Generation, NodePhase, NodeState, TagState, WeightsState
from .supervision import EngineSupervision
from .sync import EngineSync

__all__ = ["EngineLifecycle", "LifecycleContext"]

log = logging.getLogger("colocd.daemon")

RETRY_INITIAL_S = 0.1  # first retry of a failed reconcile; doubles per health tick up to the health interval


class LifecycleContext(Protocol):
    """What the lifecycle reads of the node and does to it (the daemon provides it)."""

    node: NodeState  # the journal restore sets it
    engines: dict[str, EngineHandle]
    metrics: Metrics
    journal: Journal | None
    launches: EngineSupervision
    policies: PolicyRuntime
    lifecycle: DaemonState
    stopping: asyncio.Event
    @property
    def busy(self) -> bool: ...
    def timeouts(self) -> Timeouts: ...
    def background(self, what: str, *, reconciling: bool = False) -> AbstractAsyncContextManager[None]: ...
    def changed(self) -> None: ...
    def refresh_gauges(self) -> None: ...


class EngineLifecycle:
    """The node's engines as processes the daemon watches: what it found at startup, what is unchecked."""

    def __init__(self, node: LifecycleContext, sync: EngineSync) -> None:
        self._d = node
        self._sync = sync
        self._retries = 0  # health ticks in a row that found an engine unsettled or unreachable
        self.startup_report: dict[str, Any] | None = None

    async def start(self) -> None:
        """Restore the journal, then reconcile every engine once before the daemon takes work."""
        engines = self._d.engines
        restored = self._restore_journal()
        sync = self._sync
        await fan_out(engines.values(), lambda e: sync.reconcile(e, "startup"), on_failure=OnFailure.SETTLE)
        self.startup_report = {"journal_restored": restored, "unreconciled": sorted(sync.unreconciled),
                               "engines": {n: sync.reports.get(n) for n in engines}}
        emit("startup_reconcile", logging.INFO, journal_restored=restored, unreconciled=sorted(sync.unreconciled),
             engines=sorted(engines))

    async def health_loop(self) -> None:
        """Every health interval, observe each engine and drive it toward the desired state."""
        d = self._d
        while not d.stopping.is_set():
            interval = d.timeouts().budget(Budget.HEALTH_INTERVAL)  # a new policy may change it
            if self._needs_retry():  # a failed reconcile is retried soon, backing off up to the interval
                self._retries += 1
                interval = min(interval, RETRY_INITIAL_S * 2 ** (self._retries - 1))
            else:
                self._retries = 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await d.stopping.wait()
            if d.stopping.is_set():
                return
            await asyncio.to_thread(d.policies.reload_if_changed)  # YAML parsing is CPU work: off the loop
            await self.reclaim_segments()
            if d.busy:
                d.changed()  # the next scrape renders what is live (busy, the open session's idle age)
                continue  # a transition in progress reconciles before it acts
            async with d.background("reconcile:health", reconciling=True):
                await self._sync.reconcile_all("health")
            d.refresh_gauges()

    async def reclaim_segments(self) -> int:
        """Unlink the shared-memory segments of dead trainers (a SIGKILLed trainer unlinks nothing); returns how
        many. Directory scans and flock probes are syscalls: off the event loop."""
        try:
            reclaimed = await asyncio.to_thread(reclaim_dead_segments)
        except OSError as exc:  # an unreadable /dev/shm must not stop the health loop
            log.warning("reclaiming dead trainers' shared-memory segments failed: %s", exc)
            return 0
        for seg in reclaimed:
            log.info("unlinked shared-memory segment %s of dead process %d (%d bytes)", seg.name, seg.pid, seg.nbytes)
        if reclaimed:
            self._d.metrics.shm_reclaimed.inc(len(reclaimed))
            self._d.metrics.shm_reclaimed_bytes.inc(sum(seg.nbytes for seg in reclaimed))
            self._d.changed()
        return len(reclaimed)

    def _needs_retry(self) -> bool:
        return bool(self._sync.unsettled) or any(not e.state.healthy for e in self._d.engines.values())

    def unready_reasons(self) -> list[str]:
        """Why the node cannot be driven now, one line per engine that cannot (``/readyz``)."""
        d, sync = self._d, self._sync
        reasons = []
        for name, engine in d.engines.items():
            launched = d.launches.launched.get(name)
            if launched is not None and (why := launched.unready_reason()) is not None:
                reasons.append(why)
            elif name in sync.unreconciled:
                error = engine.state.last_error
                reasons.append(f"engine {name!r}: not yet reconciled with the journal after the daemon restarted"
                               + (f": {error}" if error else ""))
            elif name in sync.unsettled:
                reasons.append(sync.unsettled[name])
            elif (why := engine.unready_reason()) is not None:
                reasons.append(why)
        return reasons

    async def reconcile_relaunched(self, name: str) -> None:
        """A launched engine is back (daemon/supervision.py): reconcile it now, not at the next tick."""
        d = self._d
        self._sync.unsettled[name] = f"engine {name!r}: relaunched; not yet reconciled"
        d.changed()
        if d.lifecycle is DaemonState.RUNNING:
            async with d.background("reconcile:relaunch", reconciling=True):
                await self._sync.reconcile(d.engines[name], "relaunch")
            d.refresh_gauges()

    # -- the journal -----------------------------------------------------------------------------
    def _restore_journal(self) -> bool:
        d = self._d
        if d.journal is None or (record := d.journal.last()) is None:
            return False
        d.node = NodeState(NodePhase(record["node"]["phase"]), int(record["node"]["step"]))
        for name, snap in record.get("engines", {}).items():
            if (engine := d.engines.get(name)) is None:
                continue
            tags = {MemoryTag(t): TagState(s) for t, s in snap["tags"].items()}
            engine.state = engine.state.with_(
                tags={**engine.state.tags, **tags}, generation=Generation(snap["generation"]),
                weights=WeightsState(snap["weights"]), weight_version=snap["weight_version"],
                incarnation=snap.get("incarnation"))
            # Not observed since the journal was written: re-verified before any mutating call.
            engine.lost_sight = True
            self._sync.unreconciled.add(name)
        emit("journal_restored", logging.INFO, step=d.node.step, phase=d.node.phase.value)
        return True
