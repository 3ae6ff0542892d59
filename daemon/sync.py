"""The engine sync: the one path that drives engines. Each sync plans (daemon/reconcile.py) and runs the plan
on every engine concurrently, one worker per engine, through the engine ops (daemon/engine_ops.py).

Two ways in, one planner and one worker:

- ``reconcile`` observes each engine first and drives it toward its record (the health loop, a relaunch,
  a daemon restart, and every mutating operation before it acts, ``Daemon.exclusive``);
- ``drive`` drives each engine toward a desired state a transition (or a manual sleep / resume) set,
  planning on the record that was just observed. A failed drive re-observes every engine before the error
  reaches the caller, so /v1/status says what the engines really are (a timed-out call may have half
  happened); the record then is the desired state again: the trainer re-asks for a step that failed, the
  daemon never retries it behind its back.

The caller holds the node's lock (or the daemon is starting).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from ..engines.base import Observation
from ..errors import ColocdError, EngineError, EngineRejected, EngineUnreachable, WeightSyncError
from ..policies import Budget, Timeouts
from . import engine_ops as ops
from .engine_ops import EngineHandle
from .events import emit
from .fanout import OnFailure, each_engine, fan_out
from .memory import NvmlProbe
from .metrics import Metrics
from .reconcile import Action, Desired, Plan, WeightsGoal, plan
from .states import Attachment, NodeState, WeightsState, check_attached
from .trace import Trace, TraceStore

__all__ = ["EngineSync", "OpenSession"]


class OpenSession(Protocol):
    """What the sync asks of the node's weight sessions (daemon/sessions.py)."""

    def owns_open(self) -> bool: ...
    def open_id(self) -> str | None: ...
    async def fail_current(self, error: WeightSyncError) -> None: ...


class _NoSessions:
    """Until the daemon hands the sync its weight sessions: none is open."""

    def owns_open(self) -> bool:
        return False

    def open_id(self) -> str | None:
        return None

    async def fail_current(self, error: WeightSyncError) -> None:
        return None


class EngineSync:
    """Drives the node's engines, and keeps what its reconciles found and did."""

    def __init__(self, engines: dict[str, EngineHandle], metrics: Metrics, traces: TraceStore, *,
                 state: Callable[[], NodeState], timeouts: Callable[[], Timeouts],
                 probe: Callable[[], NvmlProbe | None], reconciled: Callable[[EngineHandle, bool], None]) -> None:
        """``state``, ``timeouts`` and ``probe``: the node's as of now; ``reconciled(engine, changed)``: told after
        each reconcile that finished (the daemon notes the incarnation and, where it changed anything, journals).
        """
        self._engines, self._metrics, self._traces = engines, metrics, traces
        self._state, self._timeouts, self._probe, self._reconciled = state, timeouts, probe, reconciled
        self.sessions: OpenSession = _NoSessions()  # the daemon's weight sessions, once they exist
        # Engines whose journal record is not yet checked against the engine (mutating calls are refused
        # meanwhile).
        self.unreconciled: set[str] = set()
        # Engines whose last reconcile did not finish (it failed, or a relaunched one is not reconciled yet):
        # name -> why. Not ready meanwhile; the health loop retries them with a short backoff.
        self.unsettled: dict[str, str] = {}
        self.reports: dict[str, dict[str, Any]] = {}

    def require_attached(self) -> None:
        """Every engine answered the observation that just ran (``Daemon.exclusive``); else 502 naming it."""
        for engine in self._engines.values():
            check_attached(engine.name, engine.attachment, engine.state)

    # -- toward a desired state ----------------------------------------------------------------------
    async def drive(self, engines: list[EngineHandle], desired: Mapping[str, Desired], trace: Trace, *,
                    operation: str, what: str) -> dict[str, dict[str, int]]:
        """Drive each engine to ``desired[name]``, concurrently, timed under ``operation``; returns the bytes each
        freed, per source."""
        owns = self.sessions.owns_open()

        async def one(engine: EngineHandle) -> dict[str, int]:
            p = plan(desired[engine.name], engine.state, None, phase=self._state().phase, owns_session=owns)
            return await self._run(engine, p, trace)

        try:
            return await each_engine(engines, one, operation=operation, metrics=self._metrics)
        except Exception:
            await self.reconcile_all(f"after failed {what}", keep_error=True)
            raise

    # -- toward the record, on a fresh observation -----------------------------------------------------
    async def reconcile_all(self, trigger: str, *, keep_error: bool = False) -> None:
        await fan_out(self._engines.values(), lambda e: self.reconcile(e, trigger, keep_error=keep_error),
                      on_failure=OnFailure.SETTLE)

    async def reconcile(self, engine: EngineHandle, trigger: str, *, keep_error: bool = False) -> bool:
        """Observe one engine and drive it toward its record; False if it cannot be done now.

        ``keep_error``: the record's last_error stays (a refresh right after a failed step keeps that step's
        error). A change of the engine's health is logged once (event ``engine_health``).
        """
        was_healthy = engine.state.healthy
        try:
            return await self._reconcile(engine, trigger, keep_error=keep_error)
        finally:
            if engine.state.healthy is not was_healthy:
                emit("engine_health", logging.INFO if engine.state.healthy else logging.WARNING, engine=engine.name,
                     session=self.sessions.open_id(), step=self._state().step, phase=self._state().phase.value,
                     healthy=engine.state.healthy, trigger=trigger, error=engine.state.last_error)

    async def _observe(self, engine: EngineHandle) -> Observation:
        budget = self._timeouts().budget(Budget.OBSERVE)
        try:
            async with asyncio.timeout(budget):
                if engine.attachment is Attachment.DETACHED:
                    engine.attached(await engine.adapter.attach())
                return await engine.adapter.observe()
        except TimeoutError:
            raise EngineUnreachable(engine.name, f"no answer to observe within {budget:g}s") from None

    async def _reconcile(self, engine: EngineHandle, trigger: str, *, keep_error: bool) -> bool:
        try:
            observed = await self._observe(engine)
        except EngineError as exc:
            engine.state = engine.state.with_(healthy=False, last_error=str(exc))
            engine.lost_sight = engine.lost_sight or engine.observed_once
            return False
        recorded = engine.state
        p = plan(Desired.holding(recorded), recorded, observed, phase=self._state().phase,
                 owns_session=self.sessions.owns_open(),
                 first_sight=not engine.observed_once and not engine.lost_sight, lost_sight=engine.lost_sight)
        if p.restarted and not await engine.adapter.started():
            # Driven only once its own start-up has run (a pause during SGLang's warm-up blocks it for good); the
            # record stays as it was, so status shows no new incarnation yet, and the retry comes promptly.
            error = (f"reconcile ({trigger}) of engine {engine.name!r} waits: it restarted and is still starting up "
                     "(its own warm-up has not finished); it is driven once it has")
            engine.state = recorded.with_(weights=WeightsState.STALE, healthy=True, last_error=error)
            self._report(engine, trigger, p, error)
            self.unsettled[engine.name] = error
            return False
        # A restarted engine's new incarnation is published only once the plan's actions (pause, release) ran:
        # status never shows the new process before it is in the state the record wants.
        engine.state = p.state.with_(incarnation=recorded.incarnation) if p.restarted else p.state
        trace = Trace(self._state().step, f"reconcile:{engine.name}")
        try:
            if p.restarted:
                if observed.incarnation is None or observed.incarnation != engine.restart_counted:
                    self._metrics.engine_restarts.labels(engine.name).inc()  # once per new process
                    engine.restart_counted = observed.incarnation
                async with asyncio.timeout(self._timeouts().budget(Budget.OBSERVE)):
                    engine.attached(await engine.adapter.attach())  # a new process may speak a new version
            await self._run(engine, p, trace, counted=True)
        except (ColocdError, TimeoutError) as exc:
            error = f"reconcile ({trigger}) of engine {engine.name!r} failed: {exc or type(exc).__name__}"
            # Keep what the engine was recorded as (and its old incarnation), so the next tick plans again.
            base = recorded if p.restarted else engine.state
            engine.state = base.with_(weights=engine.state.weights if not p.restarted else WeightsState.STALE,
                                      healthy=True, last_error=error)
            self._report(engine, trigger, p, error)
            self.unsettled[engine.name] = error
            trace.finish("reconcile_failed", error=error)  # not "failed": the trainer's step did not fail
            return False
        finally:
            if p.actions:
                trace.finish("reconciled", restarted=p.restarted)
                self._traces.put(trace)
        if p.findings:
            self._metrics.reconcile_actions.labels(engine.name, "adopt").inc()
        engine.observed_once, engine.lost_sight = True, False
        engine.state = engine.state.with_(healthy=True, incarnation=p.state.incarnation,
                                          last_error=engine.state.last_error if keep_error else None)
        self.unreconciled.discard(engine.name)
        self.unsettled.pop(engine.name, None)
        if p.changes_anything:
            self._report(engine, trigger, p, None)
        self._reconciled(engine, p.changes_anything)
        return True

    # -- the worker: one engine, one plan ----------------------------------------------------------------
    async def _run(self, engine: EngineHandle, p: Plan, trace: Trace, *, counted: bool = False) -> dict[str, int]:
        """Run ``p``'s actions on ``engine`` in order; returns the bytes its release freed, per source.
        ``counted``: each action is counted in ``colocd_reconcile_actions`` (a reconcile's plan)."""
        t = self._timeouts()
        freed: dict[str, int] = {}
        for action in p.actions:
            if action is Action.FAIL_SESSION:
                why = p.reason or "it reports no open weight-update session"
                await self.sessions.fail_current(WeightSyncError(f"engine {engine.name!r} lost the weight session: "
                                                                 f"{why}"))
            elif action is Action.END_ENGINE_SESSION:
                try:
                    await self._end_session(engine, p.weights or WeightsGoal(), trace)
                except EngineRejected:
                    if not p.end_session_tolerant:
                        raise  # the engine said a session was open, yet refuses to end it
            elif action is Action.BEGIN_ENGINE_SESSION and p.weights is not None:
                begin = engine.adapter.begin_weight_update()
                await ops.timed_call(engine, trace, self._metrics, "begin_weight_update",
                                     t.budget(Budget.WEIGHT_UPDATE), begin)
                engine.state = engine.state.with_(weights=WeightsState.UPDATING)
            elif action is Action.PAUSE:
                await ops.pause(engine, p.pause_mode, trace, self._metrics, t)
            elif action is Action.RELEASE:
                await ops.flush(engine, trace, self._metrics, t)  # idle + empty radix cache before release
                freed = await ops.release(engine, p.release, trace, self._metrics, t, self._probe())
            elif action is Action.RESUME:
                await ops.resume(engine, p.resume, trace, self._metrics, t, self._probe())
            elif action is Action.CONTINUE:
                await ops.flush(engine, trace, self._metrics, t)  # no stale prefix KV across a weight change
                await ops.continue_generation(engine, trace, self._metrics, t)
            if counted:
                self._metrics.reconcile_actions.labels(engine.name, action.value).inc()
        return freed

    async def _end_session(self, engine: EngineHandle, goal: WeightsGoal, trace: Trace) -> None:
        """End the engine's update session: committed, it serves ``goal.version`` (the adapter's end sets it);
        else its record holds what the session left (``goal.after``) from before the call, which may fail."""
        if goal.after is not None:
            engine.state = engine.state.with_(weights=goal.after)
        await ops.timed_call(engine, trace, self._metrics, "end_weight_update",
                             self._timeouts().budget(Budget.WEIGHT_UPDATE),
                             engine.adapter.end_weight_update(goal.version))
        if goal.version is not None:
            engine.state = engine.state.with_(weights=WeightsState.CLEAN, weight_version=goal.version)

    # -- a weight session's goal ------------------------------------------------------------------------
    async def weights(self, goals: Mapping[str, WeightsGoal], trace: Trace, *, strict: bool) -> None:
        """Drive each named engine to its weight session goal, concurrently, on its record (the caller observed
        every engine when it took the node's lock). ``strict``: the first failure is raised (the caller cleans
        up); else every engine is tried and failures are only logged (a best-effort close)."""

        async def one(engine: EngineHandle) -> None:
            p = plan(Desired.for_weights(engine.state, goals[engine.name]), engine.state, None,
                     phase=self._state().phase, owns_session=self.sessions.owns_open())
            await self._run(engine, p, trace)

        engines = [e for n, e in self._engines.items() if n in goals]
        if strict:
            await each_engine(engines, one, operation="weights", metrics=self._metrics)
        else:
            await fan_out(engines, one, on_failure=OnFailure.COLLECT)

    def _report(self, engine: EngineHandle, trigger: str, p: Plan, error: str | None) -> None:
        report = {"trigger": trigger, "at": time.time(), "ok": error is None, "error": error, **p.snapshot()}
        self.reports[engine.name] = report
        emit("reconcile", logging.WARNING if p.restarted or error else logging.INFO, engine=engine.name,
             session=self.sessions.open_id(), step=self._state().step, phase=self._state().phase.value, trigger=trigger,
             result="failed" if error else "ok", restarted=p.restarted, reason=p.reason,
             findings=list(p.findings), actions=[a.value for a in p.actions], error=error)
