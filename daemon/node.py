"""The node daemon: owns every engine's recorded state and runs phase transitions and weight sessions.

One transition at a time: a second request while one runs is rejected with 409 naming the one
in progress (the trainer drives phases sequentially; queueing would hide a trainer bug).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import httpx
from pydantic import ValidationError

from ..engines.base import EngineAdapter, MemoryTag, Observation, PauseMode, RankPayload
from ..engines.errors import EngineRejected
from ..engines.registry import build_adapter
from ..policies import Timeouts, TimeoutStep, Transport
from . import engine_ops as ops
from .config import NodeConfig
from .distributed import BroadcastDescriptor, WeightGroups
from .engine_ops import EngineHandle
from .errors import (
    ColocdError,
    EngineError,
    EngineUnreachable,
    NotFound,
    RequestInvalid,
    SessionGone,
    TransitionFailed,
    TransitionRejected,
    WeightSyncError,
)
from .gpu_metrics import refresh_gpu_metrics
from .journal import Journal
from .memory import NvmlProbe, open_probe
from .metrics import Metrics
from .policy_runtime import PolicyRuntime
from .reconcile import Action, Plan, plan_reconcile
from .staging import StagingMemory, staging_memory
from .states import EngineState, Generation, NodePhase, NodeState, WeightsState, check_phase_request
from .steps import StepBook
from .supervision import EngineSupervision
from .trace import Span, Trace, TraceStore
from .weights import (
    ChunkAck,
    Manifest,
    SessionState,
    TensorMeta,
    WeightSession,
    manifest_from_json,
    manifest_to_json,
    name_some,
)

__all__ = ["Daemon", "DaemonState", "TransitionResult"]

log = logging.getLogger("colocd.daemon")


class DaemonState(StrEnum):
    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSED = "closed"


@dataclass
class TransitionResult:
    """What one transition did: per-engine state after it, bytes freed, timings, the trace."""

    step: int
    phase: str
    duration_s: float
    engines: dict[str, dict[str, Any]]
    freed_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    directives: dict[str, Any] = field(default_factory=dict)
    trace: Trace | None = None
    replayed: bool = False


class Daemon:
    """Async context manager; ``async with Daemon(config) as d: await d.transition(...)``."""

    def __init__(self, config: NodeConfig, *, adapters: dict[str, EngineAdapter] | None = None,
                 probe: NvmlProbe | None = None, policies: PolicyRuntime | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.steps = StepBook(self.metrics)  # logs each finished trace, records step metrics
        self.traces = TraceStore(on_put=self.steps.observe)
        self.steps.attach(self.traces)
        self.node = NodeState()
        self.lifecycle = DaemonState.UNOPENED
        self.policies = policies or PolicyRuntime(config)
        self._pinned: Any = None  # the PolicySet of the transition in progress
        self._given_adapters = adapters or {}
        self._probe = probe
        self._client: httpx.AsyncClient | None = None
        self.engines: dict[str, EngineHandle] = {}
        self._lock = asyncio.Lock()
        self._busy_with: str | None = None
        self._completed: OrderedDict[tuple[int, str], TransitionResult] = OrderedDict()
        self.session: WeightSession | None = None
        self._gone: OrderedDict[str, WeightSession] = OrderedDict()  # ended sessions: their ids get 410
        # The tensors of the last complete push: what a complete update must cover where the engine
        # cannot list its parameters (kept beside the journal, so it survives a daemon restart).
        self._manifest_file = Path(config.journal + ".manifest.json") if config.journal else None
        self.complete_manifest: Manifest | None = None
        self.weight_groups = WeightGroups(self.metrics)  # separated GPUs: daemon/distributed.py
        self._journal = Journal(config.journal) if config.journal else None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        # Reads are served from snapshots: _changed() marks what status() and /metrics show as stale.
        self._state_version = 0
        self._status_cache: tuple[tuple[Any, ...], bytes] | None = None
        # Reconciliation (daemon/reconcile.py): engines whose journal record is not yet checked
        # against the engine (mutating calls are refused meanwhile), and what was found and done.
        self._unreconciled: set[str] = set()
        self._reconciling = False
        self._reconcile_reports: dict[str, dict[str, Any]] = {}
        self._startup_report: dict[str, Any] | None = None
        # Engines with a 'launch' section: started before attach, relaunched, stopped (daemon/supervision.py).
        self.launches = EngineSupervision(config.engines, self.metrics, on_change=self._changed)

    # -- lifecycle ---------------------------------------------------------------------------
    async def __aenter__(self) -> Daemon:
        if self.lifecycle is not DaemonState.UNOPENED:
            raise RuntimeError(f"cannot open a daemon that is {self.lifecycle.value}")
        # Long read timeouts: weight, release and resume calls hold engine locks and barriers;
        # the daemon's own per-step deadlines (asyncio.timeout) bound them.
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), trust_env=False)
        await self.launches.start()  # a no-op if `colocd serve` already did it
        for cfg in self.launches.configs():  # launched engines now carry their URL
            adapter = self._given_adapters.get(cfg.name) or build_adapter(cfg, self._client)
            state = EngineState(name=cfg.name, owned_tags=tuple(MemoryTag(t) for t in cfg.owned_tags))
            self.engines[cfg.name] = EngineHandle(adapter=adapter, config=cfg, state=state)
        if self._probe is None and any(e.gpus for e in self.engines.values()):
            self._probe = open_probe()
        restored = self._restore_journal()
        await asyncio.gather(*(self._reconcile_engine(e, "startup") for e in self.engines.values()))
        self._startup_report = {"journal_restored": restored, "unreconciled": sorted(self._unreconciled),
                                "engines": {n: self._reconcile_reports.get(n) for n in self.engines}}
        log.info("startup reconciliation (journal restored: %s): %s", restored, self._startup_report["engines"])
        self.lifecycle = DaemonState.RUNNING
        self._start(self._health_loop())
        self._start(self._lease_loop())
        self.launches.supervise(self._reconcile_relaunched)
        self._refresh_gauges()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.lifecycle is DaemonState.CLOSED:
            return
        self.lifecycle = DaemonState.CLOSED
        self._stopping.set()
        if self.session is not None and self.session.state is SessionState.OPEN:
            await self.session.abort("daemon shutting down")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        errors = []
        for engine in reversed(list(self.engines.values())):
            try:
                await engine.adapter.aclose()
            except Exception as exc:  # collect, keep closing the rest
                errors.append(exc)
        await self.launches.aclose()
        if self._client is not None:
            await self._client.aclose()
        if self._probe is not None:
            self._probe.close()
        if errors:
            log.warning("errors while closing engines: %s", errors)

    def _start(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _health_loop(self) -> None:
        """Every health interval, observe each engine and drive it toward the desired state."""
        while not self._stopping.is_set():
            interval = self._timeouts().for_step(TimeoutStep.HEALTH_INTERVAL)  # a new policy may change it
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._stopping.wait()
            if self._stopping.is_set():
                return
            await asyncio.to_thread(self.policies.reload_if_changed)  # YAML parsing is CPU work: off the loop
            if self._lock.locked():
                continue  # a transition in progress reconciles before it acts
            async with self._reconcile_lock("health"):
                await self._reconcile_all("health")
            self._refresh_gauges()

    async def _reconcile_relaunched(self, name: str) -> None:
        """A launched engine is back (daemon/supervision.py): reconcile it now, not at the next tick."""
        if self.lifecycle is DaemonState.RUNNING:
            async with self._reconcile_lock("relaunch"):
                await self._reconcile_engine(self.engines[name], "relaunch")
            self._refresh_gauges()

    # -- reconciliation (daemon/reconcile.py decides; this section observes and acts) --------------
    @contextlib.asynccontextmanager
    async def _reconcile_lock(self, trigger: str) -> Any:
        """The transition lock, held by a background reconcile; transitions wait for it (no 409)."""
        async with self._lock:
            self._busy_with, self._reconciling = f"reconcile:{trigger}", True
            try:
                yield
            finally:
                self._busy_with, self._reconciling = None, False

    async def _reconcile_all(self, trigger: str, *, keep_error: bool = False) -> None:
        await asyncio.gather(*(self._reconcile_engine(e, trigger, keep_error=keep_error)
                               for e in self.engines.values()))

    def _owns_session(self) -> bool:
        return self.session is not None and self.session.state is SessionState.OPEN

    async def _observe(self, engine: EngineHandle) -> Observation:
        budget = self._timeouts().for_step(TimeoutStep.OBSERVE)
        try:
            async with asyncio.timeout(budget):
                if engine.info is None:
                    engine.info = await engine.adapter.attach()
                return await engine.adapter.observe()
        except TimeoutError:
            raise EngineUnreachable(engine.name, f"no answer to observe within {budget:g}s") from None

    async def _reconcile_engine(self, engine: EngineHandle, trigger: str, *, keep_error: bool = False) -> bool:
        """Observe one engine and drive it toward the desired state; False if it cannot be done now.

        The caller holds the transition lock (or the daemon is starting). ``keep_error``: the
        record's last_error stays (a refresh right after a failed step keeps that step's error).
        """
        try:
            observed = await self._observe(engine)
        except EngineError as exc:
            engine.state = engine.state.with_(healthy=False, last_error=str(exc))
            engine.lost_sight = engine.lost_sight or engine.observed_once
            return False
        recorded = engine.state
        plan = plan_reconcile(recorded, observed, phase=self.node.phase, owns_session=self._owns_session(),
                              first_sight=not engine.observed_once and not engine.lost_sight,
                              lost_sight=engine.lost_sight)
        engine.state = plan.state
        trace = Trace(self.node.step, f"reconcile:{engine.name}")
        try:
            if plan.restarted:
                if observed.incarnation is None or observed.incarnation != engine.restart_counted:
                    self.metrics.engine_restarts.labels(engine.name).inc()  # once per new process
                    engine.restart_counted = observed.incarnation
                async with asyncio.timeout(self._timeouts().for_step(TimeoutStep.OBSERVE)):
                    engine.info = await engine.adapter.attach()  # a new process may speak a new version
            for action in plan.actions:
                await self._apply(engine, plan, action, trace)
                self.metrics.reconcile_actions.labels(engine.name, action.value).inc()
        except (ColocdError, TimeoutError) as exc:
            error = f"reconcile ({trigger}) of engine {engine.name!r} failed: {exc or type(exc).__name__}"
            # Keep what the engine was recorded as (and its old incarnation), so the next tick plans again.
            base = recorded if plan.restarted else engine.state
            engine.state = base.with_(weights=engine.state.weights if not plan.restarted else WeightsState.STALE,
                                      healthy=True, last_error=error)
            self._report(engine, trigger, plan, error)
            trace.finish("reconcile_failed", error=error)  # not "failed": the trainer's step did not fail
            return False
        finally:
            if plan.actions:
                trace.finish("reconciled", restarted=plan.restarted)
                self.traces.put(trace)
        if plan.findings:
            self.metrics.reconcile_actions.labels(engine.name, "adopt").inc()
        engine.observed_once, engine.lost_sight = True, False
        engine.state = engine.state.with_(healthy=True,
                                          last_error=engine.state.last_error if keep_error else None)
        self._unreconciled.discard(engine.name)
        if plan.changes_anything:
            self._report(engine, trigger, plan, None)
            self._journal_append(f"reconcile:{engine.name}", self.node.step)
        return True

    async def _apply(self, engine: EngineHandle, plan: Plan, action: Action, trace: Trace) -> None:
        t = self._timeouts()
        if action is Action.FAIL_SESSION and self.session is not None:
            session = self.session
            why = plan.reason or "it reports no open weight-update session"
            await session.fail(WeightSyncError(f"engine {engine.name!r} lost the weight session: {why}"))
            await self._close_session(session)
        elif action is Action.END_ENGINE_SESSION:
            try:
                await ops.timed_call(engine, trace, self.metrics, "end_weight_update",
                                     t.for_step(TimeoutStep.WEIGHT_UPDATE),
                                     engine.adapter.end_weight_update())
            except EngineRejected:
                if not plan.end_session_tolerant:
                    raise  # the engine said a session was open, yet refuses to end it
        elif action is Action.PAUSE:
            # Abort, whatever the policy: anything running now runs on weights that are not committed.
            await ops.pause(engine, PauseMode.ABORT, trace, self.metrics, t)
        elif action is Action.RELEASE:
            await ops.flush(engine, trace, self.metrics, t)
            await ops.release(engine, plan.release, trace, self.metrics, t, self._probe)

    def _report(self, engine: EngineHandle, trigger: str, plan: Plan, error: str | None) -> None:
        report = {"trigger": trigger, "at": time.time(), "ok": error is None, "error": error, **plan.snapshot()}
        self._reconcile_reports[engine.name] = report
        (log.warning if plan.restarted or error else log.info)(
            "reconcile %s engine %r: restarted=%s (%s) findings=%s actions=%s%s", trigger, engine.name,
            plan.restarted, plan.reason, list(plan.findings), [a.value for a in plan.actions],
            f" FAILED: {error}" if error else "")

    def _restore_journal(self) -> bool:
        self.complete_manifest = self._read_manifest_file()
        if self._journal is None or (record := self._journal.last()) is None:
            return False
        self.node = NodeState(NodePhase(record["node"]["phase"]), int(record["node"]["step"]))
        for name, snap in record.get("engines", {}).items():
            if (engine := self.engines.get(name)) is None:
                continue
            tags = {MemoryTag(t): ops.TagState(s) for t, s in snap["tags"].items()}
            engine.state = engine.state.with_(
                tags={**engine.state.tags, **tags}, generation=Generation(snap["generation"]),
                weights=WeightsState(snap["weights"]), weight_version=snap["weight_version"],
                incarnation=snap.get("incarnation"))
            # Not observed since the journal was written: re-verified before any mutating call.
            engine.lost_sight = True
            self._unreconciled.add(name)
        log.info("restored node state from journal: %s", self.node.snapshot())
        return True

    # -- queries -----------------------------------------------------------------------------
    def _changed(self) -> None:
        """State or metrics changed in a way the status key below cannot see (counters, chunk stats)."""
        self._state_version += 1
        self.metrics.changed()

    def _status_key(self) -> tuple[Any, ...]:
        """Everything status() reads: recorded states are immutable and replaced on change, so identity
        (or equality) of these says whether the last snapshot still holds. Add new status fields here."""
        session = self.session
        return (self._state_version, self.lifecycle, self.node, self._busy_with,
                *(part for e in self.engines.values() for part in (e.state, e.info)),
                session, session.stats() if session is not None else None,
                # reconciliation: the set changes in place (copied); reports are replaced, never edited
                tuple(sorted(self._unreconciled)), self._startup_report, tuple(self._reconcile_reports.items()),
                self.launches.version, self.policies.active, self.policies.store.pending, self._probe is not None)

    def status_json(self) -> bytes:
        """``status()`` as JSON bytes, rebuilt only when something in it changed (GET /v1/status)."""
        key = self._status_key()
        cached = self._status_cache
        if cached is None or cached[0] != key:  # tuple equality tries identity first, element by element
            cached = self._status_cache = (key, json.dumps(self.status()).encode())
        return cached[1]

    def status(self) -> dict[str, Any]:
        active, pending = self.policies.active, self.policies.store.pending
        policy = {**active.info(), "source": active.source, "document": active.as_document(),
                  "pending": pending.info() if pending is not None else None}
        return {
            "lifecycle": self.lifecycle.value,
            "node": self.node.snapshot(),
            "busy_with": self._busy_with,
            "engines": {n: {**e.state.snapshot(), "protocol": e.info.protocol if e.info else None,
                            "engine_version": e.info.version if e.info else None,
                            "launched": self.launches.snapshot(n)}
                        for n, e in self.engines.items()},
            "weight_session": self.session.stats() if self.session else None,
            "reconcile": {"unreconciled": sorted(self._unreconciled), "startup": self._startup_report,
                          "last": dict(self._reconcile_reports)},
            "policy": policy,
            "nvml": self._probe is not None,
        }

    def ready(self) -> tuple[bool, list[str]]:
        problems = [e.state.last_error or f"engine {n!r} unhealthy"
                    for n, e in self.engines.items() if not e.state.healthy or e.info is None]
        return (self.lifecycle is DaemonState.RUNNING and not problems, problems)

    # -- transitions -------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _exclusive(self, what: str) -> Any:
        if self.lifecycle is not DaemonState.RUNNING:
            raise TransitionRejected(f"daemon is {self.lifecycle.value}")
        if self._lock.locked() and not self._reconciling:
            raise TransitionRejected(f"cannot start {what}: {self._busy_with} is in progress",
                                     state=self.node.snapshot())
        async with self._lock:  # a background reconcile holding it finishes first
            self._busy_with = what
            try:
                await self._reconcile_all(f"before {what}")
                if self._unreconciled:
                    raise TransitionRejected(
                        f"cannot start {what}: the daemon restarted and has not yet reconciled engines "
                        f"{sorted(self._unreconciled)} with its journal: "
                        + "; ".join(self.engines[n].state.last_error or "not observed" for n in
                                    sorted(self._unreconciled)), state=self.node.snapshot())
                yield
            finally:
                self._busy_with = None
                self._refresh_gauges()

    async def transition(self, phase: NodePhase, step: int,
                         trainer: dict[str, Any] | None = None) -> TransitionResult:
        """Move the node to ``phase`` at ``step``. A repeat of a finished (step, phase) replays its result."""
        key = (step, phase.value)
        if (done := self._completed.get(key)) is not None:
            self.metrics.transitions.labels(phase.value, "replayed").inc()
            self._changed()
            return TransitionResult(**{**done.__dict__, "replayed": True})
        try:
            async with self._exclusive(f"{phase.value}@{step}"):
                check_phase_request(self.node, phase, step)
                await self._require_attached()
                trace = Trace(step, phase.value)
                _record_trainer_report(trace, trainer)
                t0 = time.perf_counter()
                runner = {NodePhase.TRAIN: self._enter_train, NodePhase.SYNC: self._enter_sync,
                          NodePhase.ROLLOUT: self._enter_rollout}[phase]
                # A staged policy swap lands here, between transitions; this one runs on a pinned set.
                with self.policies.store.transition() as pinned:
                    self._pinned = pinned
                    try:
                        # Decided before any engine call: a trainer report the policy cannot read is the
                        # caller's mistake (RequestInvalid), and must leave every engine as it was.
                        directives = self._directives(pinned, phase.value, trainer)
                        with trace.timed():
                            freed = await self._refreshed_on_failure(runner(trace), f"{phase.value}@{step}")
                            if freed_total := sum(b for per in freed.values() for b in per.values()):
                                trace.attrs["freed_bytes"] = freed_total
                        if phase is NodePhase.SYNC:  # planned on the memory left once the weights are back
                            directives = self._directives(pinned, phase.value, trainer, self._staging())
                    finally:
                        self._pinned = None
                        self.traces.put(trace)
                self.node = NodeState(phase, step)
                result = TransitionResult(step, phase.value, time.perf_counter() - t0,
                                          {n: e.state.snapshot() for n, e in self.engines.items()},
                                          freed, directives, trace)
                self.metrics.phase_duration.labels(phase.value, "all").observe(result.duration_s)
                self._completed[key] = result
                while len(self._completed) > 256:
                    self._completed.popitem(last=False)
                self._journal_append(phase.value, step)
        except TransitionRejected as exc:
            self.metrics.transitions.labels(phase.value, "rejected").inc()
            self.steps.rejected(phase.value, step, str(exc))
            self._changed()
            raise
        except BaseException:
            self.metrics.transitions.labels(phase.value, "failed").inc()
            self._changed()
            raise
        self.metrics.transitions.labels(phase.value, "ok").inc()
        self._changed()
        return result

    async def _refreshed_on_failure(self, work: Any, what: str) -> Any:
        """Await ``work``; if it fails, re-observe every engine before the error reaches the caller,
        so /v1/status says what the engines really are (a timed-out step may have half happened)."""
        try:
            return await work
        except Exception:
            await self._reconcile_all(f"after failed {what}", keep_error=True)
            raise

    def _directives(self, pinned: Any, phase: str, trainer: dict[str, Any] | None,
                    staging: StagingMemory | None = None) -> dict[str, Any]:
        try:
            return self.policies.directives(pinned, phase, trainer, self._transports(), staging)
        except ValidationError as exc:
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ()))
            raise RequestInvalid(f"trainer.groups.{where}: {first.get('msg', exc)}",
                                 field=f"trainer.groups.{where}".rstrip(".")) from None

    async def _require_attached(self) -> None:
        """Every engine answered the observation that just ran (``_exclusive``); else 502 naming it."""
        for engine in self.engines.values():
            if engine.info is None or not engine.state.healthy:
                message = (engine.state.last_error or "not attached").removeprefix(f"engine {engine.name!r}: ")
                raise EngineUnreachable(engine.name, message)

    async def _each(self, trace: Trace, phase: str, fn: Any,
                    engines: list[EngineHandle] | None = None) -> dict[str, Any]:
        """Run ``fn(engine)`` on ``engines`` (default: all) concurrently; the first failure is raised
        only after every engine's call settled, so none is left running outside the lock."""
        async def one(engine: EngineHandle) -> Any:
            t0 = time.perf_counter()
            try:
                return await fn(engine)
            finally:
                self.metrics.phase_duration.labels(phase, engine.name).observe(time.perf_counter() - t0)

        targets = list(self.engines.values()) if engines is None else engines
        names = [e.name for e in targets]
        results = await asyncio.gather(*(one(e) for e in targets), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        for r in failures:
            if not isinstance(r, Exception):
                raise r
        if failures:
            first = failures[0]
            if isinstance(first, ColocdError):
                raise first
            raise TransitionFailed(f"{phase}: {type(first).__name__}: {first}") from first
        return dict(zip(names, results, strict=True))

    def _policy_set(self) -> Any:
        return self._pinned if self._pinned is not None else self.policies.active

    def _timeouts(self) -> Timeouts:
        return self.policies.timeouts(self._policy_set())

    def _pause_mode(self) -> PauseMode:
        return PauseMode(self.policies.pause_mode(self._policy_set()))

    def _transports(self) -> frozenset[Transport] | None:
        """What every engine of the node accepts (each adapter says; None: no engines to ask)."""
        accepted = [e.adapter.transports for e in self.engines.values()]
        return frozenset.intersection(*accepted) if accepted else None

    async def _quiesce_and_release(self, engine: EngineHandle, tags: tuple[MemoryTag, ...] | None,
                                   trace: Trace, *, strict: bool) -> dict[str, int]:
        to_release = engine.state.tags_to_release(tags, strict=strict)
        t = self._timeouts()
        await ops.pause(engine, self._pause_mode(), trace, self.metrics, t)
        if to_release:
            await ops.flush(engine, trace, self.metrics, t)  # idle + empty radix cache before release
        return await ops.release(engine, to_release, trace, self.metrics, t, self._probe)

    async def _enter_train(self, trace: Trace) -> dict[str, dict[str, int]]:
        await self._lapse_if_idle()
        if self.session is not None and self.session.state is SessionState.OPEN:
            raise TransitionRejected(f"weight session {self.session.id} is still open")
        names = self.policies.release_tags(self._policy_set())

        async def one(engine: EngineHandle) -> dict[str, int]:
            owned = engine.state.owned_tags
            tags = None if names is None else tuple(MemoryTag(n) for n in names if MemoryTag(n) in owned)
            return await self._quiesce_and_release(engine, tags, trace, strict=False)

        return await self._each(trace, "train", one)

    async def _enter_sync(self, trace: Trace) -> dict[str, dict[str, int]]:
        async def one(engine: EngineHandle) -> dict[str, int]:
            tags = engine.state.tags_to_resume((MemoryTag.WEIGHTS,), strict=False)
            await ops.resume(engine, tags, trace, self.metrics, self._timeouts(), self._probe)
            return {}
        return await self._each(trace, "sync", one)

    async def _enter_rollout(self, trace: Trace) -> dict[str, dict[str, int]]:
        await self._lapse_if_idle()
        if self.session is not None and self.session.state is SessionState.OPEN:
            raise TransitionRejected(f"weight session {self.session.id} is still open: commit or abort it first")
        # Check every engine before touching any: a stale engine must not leave others half-resumed.
        stale = [e.state.describe() for e in self.engines.values() if e.state.weights is not WeightsState.CLEAN]
        if stale:
            raise TransitionRejected("cannot enter 'rollout': weights not updated since release: " + "; ".join(stale),
                                     state=self.node.snapshot())

        async def one(engine: EngineHandle) -> dict[str, int]:
            t = self._timeouts()
            await ops.resume(engine, engine.state.tags_to_resume(None, strict=False), trace, self.metrics, t,
                             self._probe)
            await ops.flush(engine, trace, self.metrics, t)  # no stale prefix KV across a weight change
            await ops.continue_generation(engine, trace, self.metrics, t)
            return {}
        return await self._each(trace, "rollout", one)

    # -- manual sleep / resume -----------------------------------------------------------------
    def _select(self, names: list[str] | None) -> list[EngineHandle]:
        if names is None:
            return list(self.engines.values())
        unknown = [n for n in names if n not in self.engines]
        if unknown:
            raise NotFound(f"unknown engines {unknown}; configured: {sorted(self.engines)}")
        return [self.engines[n] for n in names]

    async def sleep(self, tags: tuple[MemoryTag, ...] | None, names: list[str] | None) -> TransitionResult:
        """Pause and release ``tags`` (default: all owned) on the named engines; the phase is unchanged."""
        engines = self._select(names)
        async with self._exclusive("sleep"):
            for engine in engines:  # validate all first: an illegal request changes nothing
                engine.state.tags_to_release(tags, strict=True)
            await self._require_attached()
            trace = Trace(self.node.step, "sleep")
            t0 = time.perf_counter()
            try:
                with trace.timed():
                    freed = await self._refreshed_on_failure(self._each(
                        trace, "sleep", lambda e: self._quiesce_and_release(e, tags, trace, strict=True), engines),
                        "sleep")
            finally:
                self.traces.put(trace)
            self._journal_append("sleep", self.node.step)
            return TransitionResult(self.node.step, "sleep", time.perf_counter() - t0,
                                    {e.name: e.state.snapshot() for e in engines}, freed, trace=trace)

    async def resume(self, tags: tuple[MemoryTag, ...] | None, names: list[str] | None) -> TransitionResult:
        """Resume ``tags`` on the named engines; generation continues only if the engine may serve."""
        engines = self._select(names)
        async with self._exclusive("resume"):
            plans = {e.name: e.state.tags_to_resume(tags, strict=True) for e in engines}
            await self._require_attached()
            trace = Trace(self.node.step, "resume")
            t0 = time.perf_counter()

            async def one(engine: EngineHandle) -> None:
                t = self._timeouts()
                await ops.resume(engine, plans[engine.name], trace, self.metrics, t, self._probe)
                if self.node.phase is NodePhase.ROLLOUT:
                    try:
                        engine.state.check_can_serve()
                    except TransitionRejected:
                        return  # stays paused: memory still released or weights stale (said in its state)
                    await ops.flush(engine, trace, self.metrics, t)
                    await ops.continue_generation(engine, trace, self.metrics, t)

            try:
                with trace.timed():
                    await self._refreshed_on_failure(self._each(trace, "resume", one, engines), "resume")
            finally:
                self.traces.put(trace)
            self._journal_append("resume", self.node.step)
            return TransitionResult(self.node.step, "resume", time.perf_counter() - t0,
                                    {e.name: e.state.snapshot() for e in engines}, trace=trace)

    # -- weights -------------------------------------------------------------------------------
    async def open_weights(self, *, step: int | None, version: str, ranks: int | None,
                           depth: int | None = None, manifest: list[dict[str, Any]] | None = None,
                           partial: bool = False) -> WeightSession:
        """Begin a weight update on every engine. Each must be paused with its weights memory resident.

        ``manifest`` ([{name, dtype, shape}]) is what the trainer will send; every chunk's layout is checked
        against it. Unless ``partial``, it must cover each engine's full parameter set where that is known;
        a partial update needs intact (clean) weights on every engine. Refusals change nothing.
        """
        async with self._exclusive("open_weights"):
            await self._lapse_if_idle()
            if self.session is not None and self.session.state is SessionState.OPEN:
                idle = self.session.idle_for()
                raise TransitionRejected(
                    f"weight session {self.session.id} is already open (idle {idle:.1f}s; it expires after "
                    f"{self.session.idle_s}s without a chunk, or abort it)", state=self.node.snapshot())
            step = self.node.step if step is None else step
            bad = [e.state.describe() for e in self.engines.values()
                   if e.state.generation is not Generation.PAUSED or not e.state.resident(MemoryTag.WEIGHTS)]
            if bad:
                raise TransitionRejected(
                    "cannot open a weight session: every engine must be paused with weights resident "
                    "(enter 'sync' first): " + "; ".join(bad), state=self.node.snapshot())
            try:
                declared = manifest_from_json(manifest) if manifest is not None else None
            except (KeyError, TypeError, ValueError) as exc:
                raise RequestInvalid(f"manifest: {exc}", field="manifest") from None
            if partial:
                discarded = [e.state.describe() for e in self.engines.values()
                             if e.state.weights is not WeightsState.CLEAN]
                if discarded:
                    raise TransitionRejected(
                        "a partial update needs intact weights, but weights were discarded (released, or an "
                        "update was abandoned): push every tensor (partial: false): " + "; ".join(discarded),
                        state=self.node.snapshot())
            await self._require_attached()
            need = max((e.config.tp_size for e in self.engines.values()), default=1)
            ranks = need if ranks is None else ranks
            if ranks < need:
                raise RequestInvalid(f"ranks={ranks} but engines need {need} (their largest tp_size)", field="ranks")
            trace = Trace(step, "weights")
            t = self._timeouts()
            required = await self._parameter_sets(trace, t.for_step(TimeoutStep.WEIGHT_UPDATE))
            if declared is not None:
                self._check_declared(declared, required, partial)
            session = WeightSession(
                step=step, version=version, ranks=ranks, engines=list(self.engines.values()),
                depth=depth or self._pipeline_depth(), chunk_timeout_s=t.for_step(TimeoutStep.CHUNK),
                trace=trace, metrics=self.metrics, manifest=declared, partial=partial,
                idle_s=t.for_step(TimeoutStep.SESSION_IDLE))
            session.required = required
            session.prior = {n: e.state.weights for n, e in self.engines.items()}

            async def begin(engine: EngineHandle) -> None:
                await ops.timed_call(engine, trace, self.metrics, "begin_weight_update",
                                     t.for_step(TimeoutStep.WEIGHT_UPDATE),
                                     engine.adapter.begin_weight_update(session_id=session.id))
                engine.state = engine.state.with_(weights=WeightsState.UPDATING)

            try:
                await self._each(trace, "weights", begin)
            except BaseException:
                await self._close_engines_update(trace, committed=False, session=session)
                raise
            if self.session is not None:
                self._gone[self.session.id] = self.session
                while len(self._gone) > 64:
                    self._gone.popitem(last=False)
            self.session = session
            session.touch()
            return session

    async def _parameter_sets(self, trace: Trace, budget_s: float) -> dict[str, Manifest | None]:
        """Each engine's full parameter set: from the engine where it can list them, else the last complete
        push (None when neither is known: the daemon cannot tell what complete means)."""
        sets: dict[str, Manifest | None] = {}
        for name, engine in self.engines.items():
            query = getattr(engine.adapter, "parameter_manifest", None)
            items = None
            if query is not None:
                items = await ops.timed_call(engine, trace, self.metrics, "parameter_manifest", budget_s, query())
            sets[name] = manifest_from_json(items) if items is not None else self.complete_manifest
        return sets

    def _check_declared(self, declared: Manifest, required: dict[str, Manifest | None], partial: bool) -> None:
        """Refuse a manifest that cannot make a complete (or, partial, a consistent) update: 422 before acting."""
        for name, params in required.items():
            if params is None:
                continue
            unknown = [n for n in declared if n not in params]
            wrong = [f"{n!r} is {m.describe()}, the engine has {params[n].describe()}"
                     for n, m in declared.items() if n in params and m != params[n]]
            missing = [] if partial else [n for n in params if n not in declared]
            if unknown or wrong or missing:
                why = []
                if missing:
                    clean = all(e.state.weights is WeightsState.CLEAN for e in self.engines.values())
                    why.append(f"missing {name_some(missing)}: " + (
                        "a session that updates only some tensors must say partial: true" if clean else
                        "weights were discarded (released, or an update was abandoned), so every tensor must be "
                        "pushed"))
                if unknown:
                    why.append(f"not parameters of engine {name!r}: {name_some(unknown)}")
                if wrong:
                    why.append("; ".join(wrong[:3]) + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""))
                raise RequestInvalid(
                    f"manifest does not fit engine {name!r} ({len(params)} parameters, {len(declared)} declared): "
                    + "; ".join(why), field="manifest")

    def _session(self, session_id: str) -> WeightSession:
        if self.session is not None and self.session.id == session_id:
            return self.session
        if (gone := self._gone.get(session_id)) is not None:
            return gone
        raise NotFound(f"no weight session {session_id!r}"
                       + (f" (current: {self.session.id}, {self.session.state.value})" if self.session else ""))

    def session_stats(self, session_id: str) -> dict[str, Any]:
        return self._session(session_id).stats()

    async def submit_chunk(self, session_id: str, seq: int, part: RankPayload) -> ChunkAck:
        session = self._session(session_id)
        try:
            return await session.submit(seq, part)
        finally:
            if session.state is not SessionState.OPEN and session.state is not SessionState.COMMITTED:
                await self._finish_failed(session)
            self._changed()  # chunk counters and the session's stats moved

    async def commit_weights(self, session_id: str, num_chunks: int | None) -> dict[str, Any]:
        session = self._session(session_id)
        if session.state is not SessionState.OPEN:
            raise SessionGone(f"weight session {session.id} is {session.state.value}"
                              + (f": {session.error}" if session.error else ""),
                              session_id=session.id, state=session.state.value)
        async with self._exclusive("commit_weights"):
            session.touch()
            self.weight_groups.check_settled(session)
            try:
                await session.drain(num_chunks)
            except RequestInvalid:
                raise  # the trainer's gap: the session stays open (send the chunk, or abort)
            except BaseException:
                await session.fail(WeightSyncError("commit failed"))
                await self._close_session(session)
                raise
            self._check_complete(session)
            await self._close_engines_update(session.trace, committed=True, version=session.version)
            session.state = SessionState.COMMITTED
            session.closed = True
            if not session.partial:
                self._record_complete(session)
            self.metrics.weight_sessions.labels("committed").inc()
            session.trace.finish("committed", bytes=session.bytes_loaded, chunks=session.chunks_loaded,
                                 version=session.version)
            self.traces.put(session.trace)
            self._journal_append("weights", session.step)
            return {**session.stats(), "broadcasts": self.weight_groups.session_stats(session.id),
                    "engines": {n: e.state.snapshot() for n, e in self.engines.items()},
                    "trace": session.trace.to_json()}

    def _check_complete(self, session: WeightSession) -> None:
        """Refuse a commit that would leave an engine serving mixed weights (422; the session stays open)."""
        required, prior = session.required, session.prior
        for name in self.engines:
            sent = session.sent_names(name)
            if session.manifest is not None and sent is not None:
                unsent = [n for n in session.manifest if n not in sent]
                if unsent:
                    raise RequestInvalid(
                        f"cannot commit session {session.id}: engine {name!r} never received "
                        f"{name_some(unsent)}, declared in the manifest; send them or abort", field="manifest")
            params = required.get(name)
            discarded = prior.get(name) is not WeightsState.CLEAN
            if sent is None:
                if discarded and params is not None:
                    raise RequestInvalid(
                        f"cannot commit session {session.id}: engine {name!r} lost its weights and the chunks "
                        "carried no layout the daemon can read; open the session with a manifest", field="manifest")
                continue
            if params is None or session.partial:
                continue
            missing = [n for n in params if n not in sent]
            if missing:
                raise RequestInvalid(
                    f"cannot commit session {session.id}: engine {name!r} has {len(params)} parameters and "
                    f"{'its weights were discarded, so ' if discarded else ''}a complete update must cover "
                    f"them all; missing {name_some(missing)}. Send them, or abort "
                    + ("(a partial update needs intact weights)" if discarded
                       else "(open with partial: true to update only some tensors)"), field="manifest")

    def _record_complete(self, session: WeightSession) -> None:
        """Remember what a complete push carried: the reference for the next one after a discard."""
        manifest = session.manifest if session.manifest is not None else (session.delivered or None)
        if manifest is None:
            return
        self.complete_manifest = dict(manifest)
        if self._manifest_file is not None:
            tmp = self._manifest_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": session.version, "step": session.step,
                                       "tensors": manifest_to_json(manifest)}))
            os.replace(tmp, self._manifest_file)

    def _read_manifest_file(self) -> Manifest | None:
        if self._manifest_file is None or not self._manifest_file.exists():
            return None
        try:
            return manifest_from_json(json.loads(self._manifest_file.read_text())["tensors"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", self._manifest_file, exc)
            return None

    async def abort_weights(self, session_id: str, reason: str = "aborted by trainer") -> dict[str, Any]:
        session = self._session(session_id)
        if session.state is SessionState.COMMITTED:
            raise TransitionRejected(f"weight session {session.id} is committed (version {session.version!r}); "
                                     "it cannot be aborted", state=self.node.snapshot())
        await session.abort(reason)  # no-op if it already ended (aborted, failed, expired)
        await self._finish_failed(session)
        return session.stats()

    async def _finish_failed(self, session: WeightSession) -> None:
        if session.closed:
            return
        async with self._lock:
            self._busy_with = f"close_weights:{session.id}"
            try:
                await self._close_session(session)
            finally:
                self._busy_with = None
        self._refresh_gauges()

    async def _close_session(self, session: WeightSession) -> None:
        """End an uncommitted session (caller holds the lock): wait for its engine calls, end the engines'
        updates (engines stay paused, weights stale where any chunk may have landed), unlink the shared-memory
        segments its chunks named."""
        if session.closed:
            return
        session.closed = True
        t = self._timeouts()
        session.tainted = await session.quiesce(t.for_step(TimeoutStep.QUIESCE))
        if session.tainted:
            log.warning("weight session %s: engine calls on %s did not return within %.1fs; marked stale",
                        session.id, session.tainted, t.for_step(TimeoutStep.QUIESCE))
        await self._close_engines_update(session.trace, committed=False, session=session)
        # A trainer that died (expiry, a timed-out chunk) cannot release its segments; one that is alive
        # keeps its mappings valid and finds them already gone when it releases them.
        _unlink_segments(session.shm_names)
        self.metrics.weight_sessions.labels(session.state.value).inc()
        session.trace.finish(session.state.value, bytes=session.bytes_loaded, chunks=session.chunks_loaded,
                             version=session.version)
        self.traces.put(session.trace)

    async def _lapse_if_idle(self) -> None:
        """Expire the open session if its lease ran out (caller holds the lock)."""
        session = self.session
        if session is not None and session.expired():
            log.warning("weight session %s expired after %.1fs without a chunk", session.id, session.idle_for())
            await session.expire()
            await self._close_session(session)

    async def _lease_loop(self) -> None:
        """Expire idle sessions and close failed ones nobody is waiting on, without any caller's help."""
        while not self._stopping.is_set():
            session = self.session
            idle_s = session.idle_s if session is not None and session.idle_s else 1.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(max(idle_s / 4, 0.05), 1.0)):
                    await self._stopping.wait()
            session = self.session
            if self._stopping.is_set() or session is None or session.closed or self._lock.locked():
                continue
            if session.state is SessionState.OPEN and not session.expired():
                continue
            try:
                async with self._lock:
                    self._busy_with = f"close_weights:{session.id}"
                    try:
                        await self._lapse_if_idle()
                        if session.state is not SessionState.OPEN:
                            await self._close_session(session)
                    finally:
                        self._busy_with = None
            except Exception:  # keep the loop alive: the next round (or the next open) retries
                log.exception("closing weight session %s failed", session.id)
            self._refresh_gauges()

    async def _close_engines_update(self, trace: Trace, *, committed: bool, version: str | None = None,
                                    session: WeightSession | None = None) -> None:
        """End the engines' update sessions. Uncommitted: engines stay paused; weights are stale unless the
        session never touched them (no chunk started there, none abandoned)."""
        t = self._timeouts()
        prior = session.prior if session is not None else {}

        async def one(engine: EngineHandle) -> None:
            if engine.state.weights is not WeightsState.UPDATING:
                return
            if not committed:
                untouched = (session is not None and not session.touched(engine.name)
                             and engine.name not in session.tainted)
                engine.state = engine.state.with_(
                    weights=prior.get(engine.name, WeightsState.STALE) if untouched else WeightsState.STALE)
            await ops.timed_call(engine, trace, self.metrics, "end_weight_update",
                                 t.for_step(TimeoutStep.WEIGHT_UPDATE),
                                 engine.adapter.end_weight_update())
            if committed and version is not None:
                await ops.timed_call(engine, trace, self.metrics, "set_weight_version",
                                     t.for_step(TimeoutStep.WEIGHT_UPDATE),
                                     engine.adapter.set_weight_version(version))
                engine.state = engine.state.with_(weights=WeightsState.CLEAN, weight_version=version)

        if committed:
            await self._each(trace, "weights", one)
        else:
            # Best effort: an engine that cannot even end its session is already marked stale.
            await asyncio.gather(*(one(e) for e in self.engines.values()), return_exceptions=True)

    # -- separated GPUs: weight-update groups and broadcasts (daemon/distributed.py) -----------------
    def weight_group_info(self) -> dict[str, Any]:
        return self.weight_groups.snapshot(list(self.engines.values()))

    async def open_weight_group(self, *, group_name: str, master_address: str, master_port: int, backend: str,
                                world_size: int | None = None, first_rank: int = 1) -> dict[str, Any]:
        """Every engine joins the trainer's group; returns once all joined (the trainer joins meanwhile)."""
        async with self._exclusive("open_weight_group"):
            await self._require_attached()
            trace = Trace(self.node.step, "weight_group")
            try:
                with trace.timed():
                    record = await self.weight_groups.open(
                        list(self.engines.values()), group_name=group_name, master_address=master_address,
                        master_port=master_port, backend=backend, world_size=world_size, first_rank=first_rank,
                        t=self._timeouts(), trace=trace)
            finally:
                self.traces.put(trace)
            return {**record.snapshot(), "trace": trace.to_json()}

    async def close_weight_group(self, group_name: str) -> dict[str, Any]:
        """Destroy the group on every engine and forget it."""
        async with self._exclusive("close_weight_group"):
            trace = Trace(self.node.step, "weight_group")
            return await self.weight_groups.close(list(self.engines.values()), group_name, self._timeouts(), trace)

    async def broadcast_weights(self, session_id: str, descriptor: BroadcastDescriptor) -> dict[str, Any]:
        """Forward one broadcast to every engine; returns once all loaded it (the trainer broadcasts meanwhile)."""
        session = self._session(session_id)
        if session.state is not SessionState.OPEN:
            raise SessionGone(f"weight session {session.id} is {session.state.value}",
                              session_id=session.id, state=session.state.value)
        session.touch()
        try:
            reply = await self.weight_groups.broadcast(session, list(self.engines.values()), descriptor,
                                                       self._timeouts())
            session.note_delivered(descriptor.names, (TensorMeta(d, tuple(s)) for d, s in
                                                      zip(descriptor.dtypes, descriptor.shapes, strict=True)))
            return reply
        finally:
            session.touch()
            if session.state is not SessionState.OPEN:
                await self._finish_failed(session)  # engines end their update, stay paused, weights stale
            self._changed()

    # -- policy hooks --------------------------------------------------------------------------
    def _pipeline_depth(self) -> int:
        return int(self.policies.pipeline_plan(self.policies.active, self._transports(), self._staging()).depth)

    def _staging(self) -> StagingMemory:
        return staging_memory(self.engines.values(), self._probe, self.complete_manifest)

    # -- bookkeeping ---------------------------------------------------------------------------
    def _journal_append(self, what: str, step: int) -> None:
        if self._journal is not None:
            self._journal.append({"event": what, "node": self.node.snapshot(),
                                  "engines": {n: e.state.snapshot() for n, e in self.engines.items()}})

    def _refresh_gauges(self) -> None:
        m = self.metrics
        m.node_step.set(self.node.step)
        m.weight_version.clear()
        m.policy_info.clear()
        m.policy_info.labels(**self.policies.active.info()).set(1)
        for name, engine in self.engines.items():
            m.engine_healthy.labels(name).set(1 if engine.state.healthy else 0)
            for gen in Generation:
                m.engine_generation_state.labels(name, gen.value).set(1 if engine.state.generation is gen else 0)
            for ws in WeightsState:
                m.engine_weights_state.labels(name, ws.value).set(1 if engine.state.weights is ws else 0)
            for tag in engine.state.owned_tags:
                m.engine_tag_resident.labels(name, tag.value).set(1 if engine.state.resident(tag) else 0)
            m.weight_version.labels(name, str(engine.state.weight_version)).set(1)
        refresh_gpu_metrics(m, self._probe, self.engines.values())
        self._changed()


def _unlink_segments(names: set[str]) -> None:
    """Remove the /dev/shm segments an uncommitted session's chunks named (names were checked when the chunks
    arrived; a segment the trainer already removed is simply gone)."""
    for name in sorted(names):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join("/dev/shm", name))
            log.info("unlinked shared-memory segment %s of an expired weight session", name)


def _record_trainer_report(trace: Trace, trainer: dict[str, Any] | None) -> None:
    """Put what the trainer agent reported (group lifecycle, cleanup sub-steps) into the step's trace."""
    if not trainer:
        return
    for span in trainer.get("spans") or []:
        trace.add(Span(name=f"trainer.{span.get('name', 'step')}", engine="trainer",
                       start_s=-float(span.get("duration_s", 0.0)), duration_s=float(span.get("duration_s", 0.0)),
                       attrs={k: v for k, v in span.items() if k not in ("name", "duration_s", "start_s")}))
    if (groups := trainer.get("groups_report")) is not None:
        trace.add(Span(name="trainer.process_groups", engine="trainer", start_s=0.0,
                       duration_s=float(groups.get("seconds", 0.0)), attrs=dict(groups)))
