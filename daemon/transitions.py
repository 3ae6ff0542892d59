"""Phase transitions (train, sync, rollout) and the manual sleep / resume. Each reads: check legality against
daemon/states.py, set every engine's desired state (daemon/reconcile.py), sync all engines concurrently
(daemon/worker.py), journal. A repeat of a finished (step, phase) replays its result."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import MemoryTag, PauseMode
from ..errors import NotFound, TransitionRejected
from ..policies import PolicySet
from ..recent import remember
from .journal import NodeJournal
from .lock import NodeLock
from .policy_runtime import PolicyRuntime
from .reconcile import Desired
from .sessions import WeightSessions
from .staging import StagingMemory
from .states import (
    EngineRecord,
    NodePhase,
    NodeState,
    ResumeNeed,
    check_no_open_session,
    check_phase_request,
    check_resume_headroom,
    check_rollout_staleness,
    check_rollout_weights,
    needed_per_gpu,
)
from .trace import Span, Trace, log_failed, log_rejected
from .versions import RolloutVersions, VersionBook
from .worker import EngineHandle, EngineWorker, expected_resume_bytes

__all__ = ["TransitionContext", "TransitionResult", "Transitions"]


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


@dataclass(frozen=True, slots=True)
class TransitionContext:
    """What the transitions use of the node."""

    worker: EngineWorker
    lock: NodeLock
    sessions: WeightSessions
    versions: VersionBook
    policies: PolicyRuntime
    journal: NodeJournal


class Transitions:
    """Runs the node's phase transitions and manual sleep / resume, one at a time (``NodeLock.exclusive``)."""

    def __init__(self, ctx: TransitionContext) -> None:
        self._ctx = ctx
        # The node's phase and step: moved only by a finished transition (or, at startup, to the journal's).
        self.node = NodeState()
        self.pinned: PolicySet | None = None  # the policy set of the transition in progress
        self._completed: OrderedDict[tuple[int, str], TransitionResult] = OrderedDict()
        self._unjournaled: set[tuple[int, str]] = set()  # finished, but the journal failed to keep them
        # A daemon restarted on its journal still replays what the previous one finished (without its trace).
        for done in ctx.journal.file.completed():
            self._completed[(int(done["step"]), str(done["phase"]))] = TransitionResult(
                int(done["step"]), str(done["phase"]), **done["result"])

    def policy_set(self) -> PolicySet:
        """The policy set in force: the transition's own, pinned while it runs, else the active one."""
        return self.pinned if self.pinned is not None else self._ctx.policies.active

    def pause_mode(self) -> PauseMode:
        return PauseMode(self.policy_set().engines.pause_mode)

    async def transition(self, phase: NodePhase, step: int,
                         trainer: dict[str, Any] | None = None) -> TransitionResult:
        """Move the node to ``phase`` at ``step``. A repeat of a finished (step, phase) replays its result."""
        ctx, metrics = self._ctx, self._ctx.worker.metrics
        if (done := self._completed.get((step, phase.value))) is not None:
            if (step, phase.value) in self._unjournaled:  # its record failed to be written: a repeat writes it
                await self._write(done)
            metrics.transitions.labels(phase.value, "replayed").inc()
            return TransitionResult(**{**done.__dict__, "replayed": True})
        outcome = "failed"
        try:
            # Legality, then each engine's desired state, then one sync of every engine, then the journal.
            async with ctx.lock.exclusive(f"{phase.value}@{step}"):  # every engine observed and reconciled first
                check_phase_request(self.node, phase, step)
                ctx.worker.require_attached()
                trace = Trace(step, phase.value)
                _record_trainer_report(trace, trainer, ctx.versions)
                t0 = time.perf_counter()
                # A staged policy swap lands here, between transitions; this one runs on a pinned set.
                with ctx.policies.store.transition() as pinned:
                    self.pinned = pinned
                    try:
                        # Decided before any engine call: a trainer report the policy cannot read is the
                        # caller's mistake (RequestInvalid), and must leave every engine as it was.
                        directives = self._directives(pinned, phase.value, trainer)
                        with trace.timed():
                            desired, rollout = await self._desired(phase, trace)
                            freed = await ctx.worker.drive(list(ctx.worker.engines.values()), desired, trace,
                                                       operation=phase.value, what=f"{phase.value}@{step}")
                            if freed_total := sum(b for per in freed.values() for b in per.values()):
                                trace.attrs["freed_bytes"] = freed_total
                        if rollout is not None:
                            ctx.versions.rollouts.append(rollout)
                            for name, lag in rollout.staleness.items():
                                metrics.rollout_staleness.labels(name).set(lag)
                        if phase is NodePhase.SYNC:  # planned on the memory left once the weights are back
                            directives = self._directives(pinned, phase.value, trainer, ctx.sessions.staging())
                    finally:
                        self.pinned = None
                        ctx.worker.traces.put(trace)
                self.node = NodeState(phase, step)
                result = TransitionResult(step, phase.value, time.perf_counter() - t0,
                                          {n: e.state.snapshot() for n, e in ctx.worker.engines.items()},
                                          freed, directives, trace)
                metrics.observe_phase(phase.value, "all", result.duration_s)
                await self._journal(result)
            outcome = "ok"
        except TransitionRejected as exc:
            outcome = "rejected"
            log_rejected(phase.value, step, str(exc), session=ctx.sessions.open_id())
            raise
        except BaseException as exc:
            log_failed(phase.value, step, exc, session=ctx.sessions.open_id())
            raise
        finally:
            metrics.transitions.labels(phase.value, outcome).inc()
        return result

    async def _journal(self, result: TransitionResult) -> None:
        """Remember a finished transition (a repeat replays it) and journal it with the node's state, on disk
        before the reply. If the journal fails (``JournalFailed``), a repeat writes it again before replaying."""
        key = (result.step, result.phase)
        forgotten = remember(self._completed, key, result, 256)
        self._unjournaled.difference_update(forgotten)
        self._unjournaled.add(key)
        await self._write(result)

    async def _write(self, result: TransitionResult) -> None:
        ctx = self._ctx
        await ctx.journal.written(result.phase)
        await ctx.journal.completed(result.step, result.phase, {
            "duration_s": result.duration_s, "engines": result.engines, "freed_bytes": result.freed_bytes,
            "directives": result.directives})
        self._unjournaled.discard((result.step, result.phase))

    def _directives(self, pinned: PolicySet, phase: str, trainer: dict[str, Any] | None,
                    staging: StagingMemory | None = None) -> dict[str, Any]:
        return self._ctx.policies.directives(pinned, phase, trainer, self._ctx.worker.transports(), staging)

    async def _desired(self, phase: NodePhase,
                       trace: Trace) -> tuple[dict[str, Desired], RolloutVersions | None]:
        """What each engine should be in ``phase``, once its checks passed; for rollout also what it will serve."""
        ctx = self._ctx
        engines = ctx.worker.engines
        if phase is NodePhase.TRAIN:
            await ctx.sessions.lapse_if_idle()
            check_no_open_session(ctx.sessions.open_id())
            # Without a policy document, train releases every owned tag.
            from_document = ctx.policies.active.source not in (None, "defaults")
            tags = tuple(MemoryTag(n) for n in self.policy_set().engines.release_tags) if from_document else None
            mode = self.pause_mode()
            return {n: Desired.for_train(e.state, tags, mode) for n, e in engines.items()}, None
        if phase is NodePhase.SYNC:
            desired = {n: Desired.for_sync(e.state) for n, e in engines.items()}
            self._check_headroom("enter 'sync'", desired, trace)
            return desired, None
        await ctx.sessions.lapse_if_idle()
        # Versions first: a push still in flight is refused by the bound, naming each engine's version.
        sync = self.policy_set().sync
        served = {n: e.state.weight_version for n, e in engines.items()}  # as just observed (reconcile)
        staleness = ctx.versions.lags(served)
        check_rollout_staleness(served, staleness, ctx.versions.latest, sync.staleness_bound, self.node,
                                newer={n: ctx.versions.newer(v) for n, v in served.items()})
        check_no_open_session(ctx.sessions.open_id(), advice=": commit or abort it first")
        check_rollout_weights((e.state for e in engines.values()), self.node)
        record = RolloutVersions(self.node.step, ctx.versions.latest, served, staleness, sync.staleness_bound,
                                 sync.mode)
        trace.attrs.update(rollout_versions=served, staleness_versions=staleness, latest_version=record.latest)
        desired = {n: Desired() for n in engines}  # serving, every tag resident
        self._check_headroom("enter 'rollout'", desired, trace)
        return desired, record

    def _check_headroom(self, what: str, desired: Mapping[str, Desired], trace: Trace) -> None:
        """Refuse a resume NVML says will not fit (``check_resume_headroom``), before any engine call."""
        ctx = self._ctx
        headroom_mb = self.policy_set().engines.resume_headroom_mb
        probe = ctx.worker.probe()
        if headroom_mb is None or probe is None:
            return
        needs: list[ResumeNeed] = []
        gpus: set[int | str] = set()
        for name, want in desired.items():
            engine = ctx.worker.engines[name]
            tags = want.to_resume(engine.state)
            nbytes, source = expected_resume_bytes(engine, tags)
            if not tags or not engine.gpus or nbytes is None or source is None:
                continue
            share = nbytes // len(engine.gpus)  # a TP engine's shards are even
            needs += [ResumeNeed(name, str(g), share, tuple(x.value for x in tags), source) for g in engine.gpus]
            gpus.update(engine.gpus)
        if not needs:
            return
        free = {g: r.free_bytes for g, r in probe.read_all(sorted(gpus, key=str)).items()}
        trace.attrs["resume_headroom"] = {"free_bytes": free, "needed_bytes": needed_per_gpu(needs),
                                          "headroom_bytes": headroom_mb << 20}
        check_resume_headroom(what, needs, free, headroom_mb << 20, self.node)

    def _select(self, names: list[str] | None) -> list[EngineHandle]:
        engines = self._ctx.worker.engines
        if names is None:
            return list(engines.values())
        unknown = [n for n in names if n not in engines]
        if unknown:
            raise NotFound(f"unknown engines {unknown}; configured: {sorted(engines)}")
        return [engines[n] for n in names]

    async def sleep(self, tags: tuple[MemoryTag, ...] | None, names: list[str] | None) -> TransitionResult:
        """Pause and release ``tags`` (default: all owned) on the named engines; the phase is unchanged."""
        return await self._manual("sleep", self._select(names), tags,
                                  lambda state, chosen: Desired.for_train(state, chosen, self.pause_mode()))

    async def resume(self, tags: tuple[MemoryTag, ...] | None, names: list[str] | None) -> TransitionResult:
        """Resume ``tags`` on the named engines; generation continues only if the engine may serve."""
        return await self._manual("resume", self._select(names), tags,
                                  lambda state, chosen: Desired.for_resume(state, chosen, self.node.phase))

    async def _manual(self, what: str, engines: list[EngineHandle], tags: tuple[MemoryTag, ...] | None,
                      want: Callable[[EngineRecord, tuple[MemoryTag, ...]], Desired]) -> TransitionResult:
        ctx = self._ctx
        async with ctx.lock.exclusive(what):
            for engine in engines:  # validate all first: an illegal request changes nothing
                engine.state.check_tags("release" if what == "sleep" else "resume", tags)
            ctx.worker.require_attached()
            trace = Trace(self.node.step, what)
            desired = {e.name: want(e.state, e.state.owned_tags if tags is None else tags) for e in engines}
            if what == "resume":
                self._check_headroom("resume", desired, trace)
            t0 = time.perf_counter()
            try:
                with trace.timed():
                    freed = await ctx.worker.drive(engines, desired, trace, operation=what, what=what)
            finally:
                ctx.worker.traces.put(trace)
            await ctx.journal.written(what)
            return TransitionResult(self.node.step, what, time.perf_counter() - t0,
                                    {e.name: e.state.snapshot() for e in engines},
                                    freed if what == "sleep" else {}, trace=trace)


def _record_trainer_report(trace: Trace, trainer: dict[str, Any] | None, versions: VersionBook) -> None:
    """The trainer agent's report (groups, cleanup, its weight push) into the trace; a started version counts."""
    if not trainer:
        return
    if (weights := trainer.get("weights")) is not None:
        versions.started(weights.get("started_version"))
        trace.add(Span(name="trainer.weight_sync", engine="trainer", start_s=0.0,
                       duration_s=float(weights.get("join_wait_s") or 0.0), attrs=dict(weights)))
    for span in trainer.get("spans") or []:
        trace.add(Span(name=f"trainer.{span.get('name', 'step')}", engine="trainer",
                       start_s=-float(span.get("duration_s", 0.0)), duration_s=float(span.get("duration_s", 0.0)),
                       attrs={k: v for k, v in span.items() if k not in ("name", "duration_s", "start_s")}))
    if (groups := trainer.get("groups_report")) is not None:
        trace.add(Span(name="trainer.process_groups", engine="trainer", start_s=0.0,
                       duration_s=float(groups.get("seconds", 0.0)), attrs=dict(groups)))
