"""The node daemon's facade: it builds the engines and the concerns, hands each the few objects it uses, restores
the journal and reconciles every engine at startup, runs the loops that take the node's lock (the health tick, a
relaunched engine's reconcile), and answers status and readiness.

The concerns live beside it, one module each, and none holds the facade: ``worker`` (the one path that calls
engines: observe, plan, act, and a weight session's loads), ``lock`` (one mutating operation at a time: a second
is refused with 409 naming the one in progress), ``transitions`` (phases, sleep, resume; it owns the node's phase
and step), ``sessions`` (weight sessions, groups, broadcasts; it owns the open session and the manifest a complete
push must cover), ``launches`` (the engine processes it launches). None imports this module.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import httpx

from ..engines.base import EngineAdapter, MemoryTag
from ..engines.registry import build_adapter
from ..engines.segments import reclaim_dead_segments
from ..errors import NotFound
from ..policies import Budget, PolicySet, Timeouts
from .adapters import Adapters
from .config import NodeConfig
from .distributed import WeightGroups
from .events import emit
from .journal import Journal, NodeJournal
from .lock import NodeLock
from .memory import NvmlProbe, open_probe
from .metrics import LeaseReport, Metrics
from .policy_runtime import PolicyRuntime
from .reconcile import Plan
from .sessions import SessionContext, WeightSessions
from .states import (
    DaemonState,
    EngineRecord,
    Generation,
    NodePhase,
    NodeState,
    WeightsState,
    check_can_start,
    check_reconciled,
)
from .supervision import EngineSupervision
from .trace import Trace, TraceStore
from .transitions import TransitionContext, TransitionResult, Transitions
from .versions import VersionBook
from .worker import EngineHandle, EngineWorker

__all__ = ["Daemon", "DaemonState", "TransitionResult"]

log = logging.getLogger("colocd.daemon")

# SGLang and vLLM serve with uvicorn's timeout_keep_alive=5 (SGLang: entrypoints/http_server.py). A client that kept an
# idle connection for 5 s too could send a call, just under 5 s after the last one, on a connection the engine is
# closing, and fail as if the engine had gone. The daemon lets its connections go well before that.
ENGINE_KEEPALIVE_S = 2.0
RETRY_INITIAL_S = 0.1  # first retry of a failed reconcile; doubles per health tick up to the health interval


class Daemon:
    """Async context manager; ``async with Daemon(config) as d: await d.transitions.transition(...)``.
    Callers use each concern directly (``d.transitions``, ``d.sessions``); the facade holds only what spans them."""

    def __init__(self, config: NodeConfig, *, adapters: dict[str, EngineAdapter] | None = None,
                 probe: NvmlProbe | None = None, policies: PolicyRuntime | None = None) -> None:
        self.config = config
        self.metrics = Metrics()
        self.traces = TraceStore(self.metrics)
        self.versions = VersionBook()
        self.lifecycle = DaemonState.UNOPENED
        self.policies = policies or PolicyRuntime(config)
        self._given_adapters = adapters or {}
        self.probe = probe
        self._client: httpx.AsyncClient | None = None
        self.engines: dict[str, EngineHandle] = {}
        self.journal = Journal(config.journal or None)
        self._tasks: set[asyncio.Task[None]] = set()
        self.worker = EngineWorker(self.engines, self.metrics, self.traces, state=lambda: self.node,
                               timeouts=self.timeouts, probe=lambda: self.probe, reconciled=self._reconciled,
                               open_session=lambda: self.sessions.open_id())
        self.lock = NodeLock(can_start=lambda what, busy_with: check_can_start(
            what, lifecycle=self.lifecycle, node=self.node, busy_with=busy_with),
            before=self._reconcile_before, after=self.refresh_gauges)
        self.node_journal = NodeJournal(self.journal, lambda: {
            "node": self.node.snapshot(), "engines": {n: e.state.snapshot() for n, e in self.engines.items()}})
        self.launches = EngineSupervision(config.engines, self.metrics, journal=self.journal)
        self.startup_report: dict[str, Any] | None = None
        self.sessions = WeightSessions(
            SessionContext(self.worker, self.lock, self.versions, self.policies, self.node_journal),
            WeightGroups(self.worker, self.lock), journal=config.journal)
        self.transitions = Transitions(
            TransitionContext(self.worker, self.lock, self.sessions, self.versions, self.policies, self.node_journal))
        self.metrics.watch_node((e.name for e in config.engines), (e.name for e in config.engines if e.launch),
                                busy=lambda: self.lock.busy, session_idle_s=self._session_idle_s)
        self.adapters = Adapters(self.worker, self.metrics, settings=lambda: self.policy_set().adapters,
                                 exclusive=self.lock.exclusive, journal=self.journal)

    async def __aenter__(self) -> Daemon:
        if self.lifecycle is not DaemonState.UNOPENED:
            raise RuntimeError(f"cannot open a daemon that is {self.lifecycle.value}")
        # Long read timeouts: weight, release and resume calls hold engine locks and barriers;
        # the daemon's own per-step deadlines (asyncio.timeout) bound them.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=ENGINE_KEEPALIVE_S)
        self._client = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), trust_env=False,
                                         transport=httpx.AsyncHTTPTransport(limits=limits))
        await self.launches.start()  # a no-op if `colocd serve` already did it
        for cfg in self.launches.configs():  # launched engines now carry their URL
            adapter = self._given_adapters.get(cfg.name) or build_adapter(cfg, self._client)
            state = EngineRecord(name=cfg.name, owned_tags=tuple(MemoryTag(t) for t in cfg.owned_tags))
            self.engines[cfg.name] = EngineHandle(adapter=adapter, config=cfg, state=state)
        if self.probe is None and any(e.gpus for e in self.engines.values()):
            self.probe = open_probe()
        self.sessions.restore()
        # The phase and step the journal's last record holds, its engines' records restored (each re-verified
        # before any mutating call).
        record = self.journal.last()
        restored = record is not None
        if record is not None:
            node = self.transitions.node = NodeState(NodePhase(record["node"]["phase"]), int(record["node"]["step"]))
            self.worker.restore(record.get("engines", {}))
            emit("journal_restored", logging.INFO, step=node.step, phase=node.phase.value)
        self.adapters.restore_journal()  # before the reconcile: an engine restarted meanwhile loads them again
        worker = self.worker
        await worker.reconcile_all("startup")
        self.startup_report = {"journal_restored": restored, "unreconciled": sorted(worker.unreconciled),
                               "engines": {n: worker.reports.get(n) for n in self.engines}}
        emit("startup_reconcile", logging.INFO, journal_restored=restored,
             unreconciled=sorted(worker.unreconciled), engines=sorted(self.engines))
        self.lifecycle = DaemonState.RUNNING
        self._start(self._health_loop())
        self._start(self.sessions.lease_loop())
        self.launches.supervise(self._reconcile_relaunched)
        self.refresh_gauges()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self.lifecycle is DaemonState.CLOSED:
            return
        self.lifecycle = DaemonState.CLOSED
        self.lock.stopping.set()
        if self.sessions.current is not None:
            await self.sessions.current.abort("daemon shutting down")  # no-op once it ended
        await self.adapters.aclose()  # while the engines still answer: a folder goes only once its name is unloaded
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        errors = await self.worker.close()
        await self.launches.aclose()
        await asyncio.to_thread(self.journal.close)  # the queued writes reach the disk
        if self._client is not None:
            await self._client.aclose()
        if self.probe is not None:
            self.probe.close()
        if errors:
            log.warning("errors while closing engines: %s", errors)

    async def _health_loop(self) -> None:
        """Every health interval, observe each engine and drive it toward the desired state."""
        retries = 0  # ticks in a row that found an engine unsettled or unreachable
        while not self.lock.stopping.is_set():
            interval = self.timeouts().budget(Budget.HEALTH_INTERVAL)  # read each tick: a new policy may change it
            if self.worker.unsettled or any(not e.state.healthy for e in self.engines.values()):
                retries += 1  # a failed reconcile is retried soon, backing off up to the interval
                interval = min(interval, RETRY_INITIAL_S * 2.0 ** (retries - 1))
            else:
                retries = 0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self.lock.stopping.wait()
            if self.lock.stopping.is_set():
                return
            await asyncio.to_thread(self.policies.reload_if_changed)  # YAML parsing is CPU work: off the loop
            await self._reclaim_segments()
            if self.lock.busy:
                continue  # a transition in progress reconciles before it acts
            async with self.lock.background("reconcile:health", reconciling=True):
                await self.worker.reconcile_all("health")
                await self.sessions.fail_if_lost()

    async def _reclaim_segments(self) -> None:
        """Unlink the shared-memory segments of dead trainers (a SIGKILLed trainer unlinks nothing), off the loop."""
        try:
            reclaimed = await asyncio.to_thread(reclaim_dead_segments)
        except OSError as exc:  # an unreadable /dev/shm must not stop the health loop
            log.warning("reclaiming dead trainers' shared-memory segments failed: %s", exc)
            return
        for seg in reclaimed:
            log.info("unlinked shared-memory segment %s of dead process %d (%d bytes)", seg.name, seg.pid, seg.nbytes)
        if reclaimed:
            self.metrics.shm_reclaimed.inc(len(reclaimed))
            self.metrics.shm_reclaimed_bytes.inc(sum(seg.nbytes for seg in reclaimed))

    async def _reconcile_relaunched(self, name: str) -> None:
        """A launched engine is back (daemon/supervision.py): reconcile it now, not at the next tick."""
        self.worker.unsettled[name] = f"engine {name!r}: relaunched; not yet reconciled"
        if self.lifecycle is DaemonState.RUNNING:
            async with self.lock.background("reconcile:relaunch", reconciling=True):
                await self.worker.reconcile(self.engines[name], "relaunch")
                await self.sessions.fail_if_lost()

    def _start(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _reconcile_before(self, what: str) -> None:
        """Observe and reconcile every engine for ``what`` (which holds the node); an open session an engine lost
        fails; refused while a restarted daemon still has engines it could not reconcile with its journal."""
        await self.worker.reconcile_all(f"before {what}")
        await self.sessions.fail_if_lost()
        check_reconciled(what, {n: self.engines[n].state.last_error for n in self.worker.unreconciled}, self.node)

    @property
    def node(self) -> NodeState:
        return self.transitions.node

    def policy_set(self) -> PolicySet:
        return self.transitions.policy_set()

    def timeouts(self) -> Timeouts:
        return self.policy_set().timeouts

    def policy_view(self) -> dict[str, Any]:
        """The active policy document (defaults filled in), its version and any staged swap."""
        active, pending = self.policies.active, self.policies.store.pending
        return {**active.info(), "source": active.source, "document": active.as_document(),
                "pending": pending.info() if pending is not None else None}

    async def stage_policies(self, text: bytes, origin: str) -> dict[str, Any]:
        """Stage a policy YAML (``PolicyError`` if invalid; the old policy stays) for the next transition."""
        staged = await asyncio.to_thread(self.policies.apply_yaml, text, origin)
        active = self.policies.active
        return {"staged": staged.info(), "active": active.info(),
                "applies": "now" if staged.fingerprint == active.fingerprint else "at the next transition"}

    def step_traces(self, step: int) -> dict[str, Trace]:
        """The traces of ``step`` by phase; NotFound names the steps still kept."""
        traces = self.traces.get(step)
        if traces is None:
            raise NotFound(f"no trace for step {step}; known steps: {self.traces.steps()}")
        return traces

    def report_leases(self, report: LeaseReport) -> dict[str, Any]:
        self.metrics.record_leases(report)
        return {"rank": report.rank, "recorded": True}

    def status(self) -> dict[str, Any]:
        """What GET /v1/status answers: the node, every engine's record, the session, reconcile, policy, versions."""
        worker, session = self.worker, self.sessions.current
        active = self.policies.active
        return {
            "lifecycle": self.lifecycle.value, "node": self.node.snapshot(), "busy_with": self.lock.busy_with,
            "engines": {n: {**e.state.status(), "protocol": e.info.protocol if e.info else None,
                            "engine_version": e.info.version if e.info else None,
                            "launched": launched.snapshot() if (launched := self.launches.launched.get(n)) else None}
                        for n, e in self.engines.items()},
            "weight_session": session.stats() if session is not None else None, "adapters": self.adapters.status(),
            "reconcile": {"unreconciled": sorted(worker.unreconciled), "startup": self.startup_report,
                          "last": dict(worker.reports)},
            "policy": self.policy_view(), "nvml": self.probe is not None,
            "versions": self.versions.snapshot(active.sync.staleness_bound, active.sync.mode,
                                               ((n, e.state.weight_version) for n, e in self.engines.items())),
        }

    def ready(self) -> tuple[bool, list[str]]:
        """Whether the node can be driven now, and why not: one line per engine that cannot (``/readyz``)."""
        problems = []
        for name, engine in self.engines.items():
            launched = self.launches.launched.get(name)
            if launched is not None and (why := launched.unready_reason()) is not None:
                problems.append(why)
            elif name in self.worker.unreconciled:
                error = engine.state.last_error
                problems.append(f"engine {name!r}: not yet reconciled with the journal after the daemon restarted"
                                + (f": {error}" if error else ""))
            elif name in self.worker.unsettled:
                problems.append(self.worker.unsettled[name])
            elif (why := engine.unready_reason()) is not None:
                problems.append(why)
        return (self.lifecycle is DaemonState.RUNNING and not problems, problems)

    async def _reconciled(self, engine: EngineHandle, p: Plan) -> None:
        """After a reconcile: journal the incarnation and any change; a restarted engine loads the adapters again."""
        self.launches.note_incarnation(engine.name, engine.state.incarnation)
        if p.changes_anything:
            self.node_journal.append(f"reconcile:{engine.name}")
        if p.restarted:
            await self.adapters.restore(engine)

    def _session_idle_s(self) -> float | None:
        current = self.sessions.current
        return current.idle_for() if current is not None and self.sessions.open_id() is not None else None

    def refresh_gauges(self) -> None:
        m = self.metrics
        m.set_node(self.node)
        m.policy_info.clear()
        m.policy_info.labels(**self.policies.active.info()).set(1)
        m.weight_version.clear()
        for name, engine in self.engines.items():
            state = engine.state
            m.engine_healthy.labels(name).set(1 if state.healthy else 0)
            for gen in Generation:
                m.engine_generation_state.labels(name, gen.value).set(1 if state.generation is gen else 0)
            for ws in WeightsState:
                m.engine_weights_state.labels(name, ws.value).set(1 if state.weights is ws else 0)
            for tag in state.owned_tags:
                m.engine_tag_resident.labels(name, tag.value).set(1 if state.resident(tag) else 0)
            m.weight_version.labels(name, str(state.weight_version)).set(1)
            m.declare_engine(name, transports=sorted(t.value for t in engine.transports),
                             gpus=[str(g) for g in engine.gpus] if self.probe is not None and engine.gpus else None)
        m.set_gpus(self.probe, {n: e.gpus for n, e in self.engines.items()})
