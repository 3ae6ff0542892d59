"""Engine lifecycle: attach, observe and reconcile each engine toward the desired state (daemon/reconcile.py
decides, this module observes and acts), on the health loop and before every mutating operation; and the
journal restore that a restarted daemon starts from."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Any

from ..engines.base import MemoryTag, Observation, PauseMode
from ..engines.errors import EngineRejected
from ..engines.segments import reclaim_dead_segments
from ..policies import TimeoutStep
from . import engine_ops as ops
from .engine_ops import EngineHandle
from .errors import ColocdError, EngineError, EngineUnreachable, WeightSyncError
from .events import emit
from .fanout import OnFailure, fan_out
from .reconcile import Action, Plan, plan_reconcile
from .states import Attachment, DaemonState, Generation, NodePhase, NodeState, TagState, WeightsState, check_attached
from .trace import Trace

if TYPE_CHECKING:
    from .node import Daemon

__all__ = ["EngineLifecycle"]

log = logging.getLogger("colocd.daemon")

RETRY_INITIAL_S = 0.1  # first retry of a failed reconcile; doubles per health tick up to the health interval


class EngineLifecycle:
    """The node's engines as processes the daemon watches: what it found, what it did, what is unchecked."""

    def __init__(self, daemon: Daemon) -> None:
        self._d = daemon
        # Engines whose journal record is not yet checked against the engine (mutating calls are refused
        # meanwhile), and what was found and done at startup and since.
        self.unreconciled: set[str] = set()
        # Engines whose last reconcile did not finish (it failed, or a relaunched one is not reconciled yet):
        # name -> why. Not ready meanwhile; the health loop retries them with a short backoff.
        self.unsettled: dict[str, str] = {}
        self._retries = 0  # health ticks in a row that found an engine unsettled or unreachable
        self.reports: dict[str, dict[str, Any]] = {}
        self.startup_report: dict[str, Any] | None = None

    async def start(self) -> None:
        """Restore the journal, then reconcile every engine once before the daemon takes work."""
        engines = self._d.engines
        restored = self._restore_journal()
        await fan_out(engines.values(), lambda e: self.reconcile_engine(e, "startup"), on_failure=OnFailure.SETTLE)
        self.startup_report = {"journal_restored": restored, "unreconciled": sorted(self.unreconciled),
                               "engines": {n: self.reports.get(n) for n in engines}}
        emit("startup_reconcile", logging.INFO, journal_restored=restored, unreconciled=sorted(self.unreconciled),
             engines=sorted(engines))

    async def health_loop(self) -> None:
        """Every health interval, observe each engine and drive it toward the desired state."""
        d = self._d
        while not d.stopping.is_set():
            interval = d.timeouts().for_step(TimeoutStep.HEALTH_INTERVAL)  # a new policy may change it
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
                await self.reconcile_all("health")
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
        return bool(self.unsettled) or any(not e.state.healthy for e in self._d.engines.values())

    def unready_reasons(self) -> list[str]:
        """Why the node cannot be driven now, one line per engine that cannot (``/readyz``)."""
        d = self._d
        reasons = []
        for name, engine in d.engines.items():
            launched = d.launches.launched.get(name)
            if launched is not None and (why := launched.unready_reason()) is not None:
                reasons.append(why)
            elif name in self.unreconciled:
                error = engine.state.last_error
                reasons.append(f"engine {name!r}: not yet reconciled with the journal after the daemon restarted"
                               + (f": {error}" if error else ""))
            elif name in self.unsettled:
                reasons.append(self.unsettled[name])
            elif (why := engine.unready_reason()) is not None:
                reasons.append(why)
        return reasons

    async def reconcile_relaunched(self, name: str) -> None:
        """A launched engine is back (daemon/supervision.py): reconcile it now, not at the next tick."""
        d = self._d
        self.unsettled[name] = f"engine {name!r}: relaunched; not yet reconciled"
        d.changed()
        if d.lifecycle is DaemonState.RUNNING:
            async with d.background("reconcile:relaunch", reconciling=True):
                await self.reconcile_engine(d.engines[name], "relaunch")
            d.refresh_gauges()

    def require_attached(self) -> None:
        """Every engine answered the observation that just ran (``Daemon.exclusive``); else 502 naming it."""
        for engine in self._d.engines.values():
            check_attached(engine.name, engine.attachment, engine.state)

    # -- reconciliation ------------------------------------------------------------------------
    async def reconcile_all(self, trigger: str, *, keep_error: bool = False) -> None:
        await fan_out(self._d.engines.values(), lambda e: self.reconcile_engine(e, trigger, keep_error=keep_error),
                      on_failure=OnFailure.SETTLE)

    async def _observe(self, engine: EngineHandle) -> Observation:
        budget = self._d.timeouts().for_step(TimeoutStep.OBSERVE)
        try:
            async with asyncio.timeout(budget):
                if engine.attachment is Attachment.DETACHED:
                    engine.attached(await engine.adapter.attach())
                return await engine.adapter.observe()
        except TimeoutError:
            raise EngineUnreachable(engine.name, f"no answer to observe within {budget:g}s") from None

    async def reconcile_engine(self, engine: EngineHandle, trigger: str, *, keep_error: bool = False) -> bool:
        """Observe one engine and drive it toward the desired state; False if it cannot be done now.

        The caller holds the node's lock (or the daemon is starting). ``keep_error``: the record's
        last_error stays (a refresh right after a failed step keeps that step's error). A change of the
        engine's health is logged once (event ``engine_health``).
        """
        was_healthy = engine.state.healthy
        try:
            return await self._reconcile_engine(engine, trigger, keep_error=keep_error)
        finally:
            if engine.state.healthy is not was_healthy:
                d = self._d
                emit("engine_health", logging.INFO if engine.state.healthy else logging.WARNING, engine=engine.name,
                     session=d.sessions.open_id(), step=d.node.step, phase=d.node.phase.value,
                     healthy=engine.state.healthy, trigger=trigger, error=engine.state.last_error)

    async def _reconcile_engine(self, engine: EngineHandle, trigger: str, *, keep_error: bool) -> bool:
        d = self._d
        try:
            observed = await self._observe(engine)
        except EngineError as exc:
            engine.state = engine.state.with_(healthy=False, last_error=str(exc))
            engine.lost_sight = engine.lost_sight or engine.observed_once
            return False
        recorded = engine.state
        plan = plan_reconcile(recorded, observed, phase=d.node.phase, owns_session=d.sessions.owns_open(),
                              first_sight=not engine.observed_once and not engine.lost_sight,
                              lost_sight=engine.lost_sight)
        if plan.restarted and not await engine.adapter.started():
            # Driven only once its own start-up has run (a pause during SGLang's warm-up blocks it for good); the
            # record stays as it was, so status shows no new incarnation yet, and the retry comes promptly.
            error = (f"reconcile ({trigger}) of engine {engine.name!r} waits: it restarted and is still starting up "
                     "(its own warm-up has not finished); it is driven once it has")
            engine.state = recorded.with_(weights=WeightsState.STALE, healthy=True, last_error=error)
            self._report(engine, trigger, plan, error)
            self.unsettled[engine.name] = error
            return False
        # A restarted engine's new incarnation is published only once the plan's actions (pause, release) ran:
        # status never shows the new process before it is in the state the record wants.
        engine.state = plan.state.with_(incarnation=recorded.incarnation) if plan.restarted else plan.state
        trace = Trace(d.node.step, f"reconcile:{engine.name}")
        try:
            if plan.restarted:
                if observed.incarnation is None or observed.incarnation != engine.restart_counted:
                    d.metrics.engine_restarts.labels(engine.name).inc()  # once per new process
                    engine.restart_counted = observed.incarnation
                async with asyncio.timeout(d.timeouts().for_step(TimeoutStep.OBSERVE)):
                    engine.attached(await engine.adapter.attach())  # a new process may speak a new version
            for action in plan.actions:
                await self._apply(engine, plan, action, trace)
                d.metrics.reconcile_actions.labels(engine.name, action.value).inc()
        except (ColocdError, TimeoutError) as exc:
            error = f"reconcile ({trigger}) of engine {engine.name!r} failed: {exc or type(exc).__name__}"
            # Keep what the engine was recorded as (and its old incarnation), so the next tick plans again.
            base = recorded if plan.restarted else engine.state
            engine.state = base.with_(weights=engine.state.weights if not plan.restarted else WeightsState.STALE,
                                      healthy=True, last_error=error)
            self._report(engine, trigger, plan, error)
            self.unsettled[engine.name] = error
            trace.finish("reconcile_failed", error=error)  # not "failed": the trainer's step did not fail
            return False
        finally:
            if plan.actions:
                trace.finish("reconciled", restarted=plan.restarted)
                d.traces.put(trace)
        if plan.findings:
            d.metrics.reconcile_actions.labels(engine.name, "adopt").inc()
        engine.observed_once, engine.lost_sight = True, False
        engine.state = engine.state.with_(healthy=True, incarnation=plan.state.incarnation,
                                          last_error=engine.state.last_error if keep_error else None)
        self.unreconciled.discard(engine.name)
        self.unsettled.pop(engine.name, None)
        d.launches.note_incarnation(engine.name, engine.state.incarnation)
        if plan.changes_anything:
            self._report(engine, trigger, plan, None)
            d.journal_append(f"reconcile:{engine.name}")
        return True

    async def _apply(self, engine: EngineHandle, plan: Plan, action: Action, trace: Trace) -> None:
        d = self._d
        t = d.timeouts()
        if action is Action.FAIL_SESSION:
            why = plan.reason or "it reports no open weight-update session"
            await d.sessions.fail_current(WeightSyncError(f"engine {engine.name!r} lost the weight session: {why}"))
        elif action is Action.END_ENGINE_SESSION:
            try:
                await ops.timed_call(engine, trace, d.metrics, "end_weight_update",
                                     t.for_step(TimeoutStep.WEIGHT_UPDATE), engine.adapter.end_weight_update())
            except EngineRejected:
                if not plan.end_session_tolerant:
                    raise  # the engine said a session was open, yet refuses to end it
        elif action is Action.PAUSE:
            # Abort, whatever the policy: anything running now runs on weights that are not committed.
            await ops.pause(engine, PauseMode.ABORT, trace, d.metrics, t)
        elif action is Action.RELEASE:
            await ops.flush(engine, trace, d.metrics, t)
            await ops.release(engine, plan.release, trace, d.metrics, t, d.probe)

    def _report(self, engine: EngineHandle, trigger: str, plan: Plan, error: str | None) -> None:
        report = {"trigger": trigger, "at": time.time(), "ok": error is None, "error": error, **plan.snapshot()}
        self.reports[engine.name] = report
        d = self._d
        emit("reconcile", logging.WARNING if plan.restarted or error else logging.INFO, engine=engine.name,
             session=d.sessions.open_id(), step=d.node.step, phase=d.node.phase.value, trigger=trigger,
             result="failed" if error else "ok", restarted=plan.restarted, reason=plan.reason,
             findings=list(plan.findings), actions=[a.value for a in plan.actions], error=error)

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
            self.unreconciled.add(name)
        emit("journal_restored", logging.INFO, step=d.node.step, phase=d.node.phase.value)
        return True
