"""Phase transitions (train, sync, rollout) and the manual sleep / resume: the memory handoff on every engine,
checked against daemon/states.py before any engine call, replayed for a repeat of a finished (step, phase)."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import ValidationError

from ..engines.base import MemoryTag
from . import engine_ops as ops
from .engine_ops import EngineHandle
from .errors import NotFound, RequestInvalid, TransitionRejected
from .fanout import each_engine
from .staging import StagingMemory
from .states import (
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
from .trace import Span, Trace
from .versions import RolloutVersions, VersionBook

if TYPE_CHECKING:
    from collections.abc import Awaitable

    from .node import Daemon

__all__ = ["TransitionResult", "Transitions"]


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


class Transitions:
    """Runs the node's phase transitions and manual sleep / resume, one at a time (``Daemon.exclusive``)."""

    def __init__(self, daemon: Daemon) -> None:
        self._d = daemon
        self._completed: OrderedDict[tuple[int, str], TransitionResult] = OrderedDict()
        # A daemon restarted on its journal still replays what the previous one finished (without its trace).
        for done in daemon.journal.completed() if daemon.journal is not None else ():
            self._completed[(int(done["step"]), str(done["phase"]))] = TransitionResult(
                int(done["step"]), str(done["phase"]), **done["result"])

    async def transition(self, phase: NodePhase, step: int,
                         trainer: dict[str, Any] | None = None) -> TransitionResult:
        """Move the node to ``phase`` at ``step``. A repeat of a finished (step, phase) replays its result."""
        d = self._d
        key = (step, phase.value)
        if (done := self._completed.get(key)) is not None:
            d.metrics.transitions.labels(phase.value, "replayed").inc()
            d.changed()
            return TransitionResult(**{**done.__dict__, "replayed": True})
        try:
            async with d.exclusive(f"{phase.value}@{step}"):
                check_phase_request(d.node, phase, step)
                d.engine_lifecycle.require_attached()
                trace = Trace(step, phase.value)
                _record_trainer_report(trace, trainer, d.versions)
                t0 = time.perf_counter()
                runner = {NodePhase.TRAIN: self._enter_train, NodePhase.SYNC: self._enter_sync,
                          NodePhase.ROLLOUT: self._enter_rollout}[phase]
                # A staged policy swap lands here, between transitions; this one runs on a pinned set.
                with d.policies.store.transition() as pinned:
                    d.pinned = pinned
                    try:
                        # Decided before any engine call: a trainer report the policy cannot read is the
                        # caller's mistake (RequestInvalid), and must leave every engine as it was.
                        directives = self._directives(pinned, phase.value, trainer)
                        with trace.timed():
                            freed = await self._refreshed_on_failure(runner(trace), f"{phase.value}@{step}")
                            if freed_total := sum(b for per in freed.values() for b in per.values()):
                                trace.attrs["freed_bytes"] = freed_total
                        if phase is NodePhase.SYNC:  # planned on the memory left once the weights are back
                            directives = self._directives(pinned, phase.value, trainer, d.staging())
                    finally:
                        d.pinned = None
                        d.traces.put(trace)
                d.node = NodeState(phase, step)
                result = TransitionResult(step, phase.value, time.perf_counter() - t0,
                                          {n: e.state.snapshot() for n, e in d.engines.items()},
                                          freed, directives, trace)
                d.metrics.observe_phase(phase.value, "all", result.duration_s)
                self._completed[key] = result
                while len(self._completed) > 256:
                    self._completed.popitem(last=False)
                d.journal_append(phase.value)
                if d.journal is not None:
                    d.journal.record_completed(step, phase.value, {
                        "duration_s": result.duration_s, "engines": result.engines,
                        "freed_bytes": result.freed_bytes, "directives": result.directives})
        except TransitionRejected as exc:
            d.metrics.transitions.labels(phase.value, "rejected").inc()
            d.steps.rejected(phase.value, step, str(exc), session=d.sessions.open_id())
            d.changed()
            raise
        except BaseException as exc:
            d.metrics.transitions.labels(phase.value, "failed").inc()
            d.steps.failed(phase.value, step, exc, session=d.sessions.open_id())
            d.changed()
            raise
        d.metrics.transitions.labels(phase.value, "ok").inc()
        d.changed()
        return result

    async def _refreshed_on_failure(self, work: Awaitable[Any], what: str) -> Any:
        """Await ``work``; if it fails, re-observe every engine before the error reaches the caller,
        so /v1/status says what the engines really are (a timed-out step may have half happened)."""
        try:
            return await work
        except Exception:
            await self._d.engine_lifecycle.reconcile_all(f"after failed {what}", keep_error=True)
            raise

    def _directives(self, pinned: Any, phase: str, trainer: dict[str, Any] | None,
                    staging: StagingMemory | None = None) -> dict[str, Any]:
        d = self._d
        try:
            return d.policies.directives(pinned, phase, trainer, d.transports(), staging)
        except ValidationError as exc:
            errors = exc.errors()
            where = ".".join(str(p) for p in errors[0]["loc"]) if errors else ""
            msg = errors[0]["msg"] if errors else str(exc)
            raise RequestInvalid(f"trainer.groups.{where}: {msg}",
                                 field=f"trainer.groups.{where}".rstrip(".")) from None

    async def _quiesce_and_release(self, engine: EngineHandle, tags: tuple[MemoryTag, ...] | None,
                                   trace: Trace, *, strict: bool) -> dict[str, int]:
        d = self._d
        to_release = engine.state.tags_to_release(tags, strict=strict)
        t = d.timeouts()
        await ops.pause(engine, d.pause_mode(), trace, d.metrics, t)
        if to_release:
            await ops.flush(engine, trace, d.metrics, t)  # idle + empty radix cache before release
        return await ops.release(engine, to_release, trace, d.metrics, t, d.probe)

    async def _enter_train(self, trace: Trace) -> dict[str, dict[str, int]]:
        d = self._d
        await d.sessions.lapse_if_idle()
        check_no_open_session(d.sessions.open_id())
        names = d.policies.release_tags(d.policy_set())

        async def one(engine: EngineHandle) -> dict[str, int]:
            owned = engine.state.owned_tags
            tags = None if names is None else tuple(MemoryTag(n) for n in names if MemoryTag(n) in owned)
            return await self._quiesce_and_release(engine, tags, trace, strict=False)

        return await each_engine(d.engines.values(), one, phase="train", metrics=d.metrics)

    def _check_headroom(self, what: str, plans: dict[str, tuple[MemoryTag, ...]], trace: Trace) -> None:
        """Refuse a resume NVML says will not fit (``check_resume_headroom``), before any engine call."""
        d = self._d
        headroom_mb = d.policy_set().engines.resume_headroom_mb
        if headroom_mb is None or d.probe is None:
            return
        needs: list[ResumeNeed] = []
        gpus: set[int | str] = set()
        for name, tags in plans.items():
            engine = d.engines[name]
            nbytes, source = ops.expected_resume_bytes(engine, tags)
            if not tags or not engine.gpus or nbytes is None or source is None:
                continue
            share = nbytes // len(engine.gpus)  # a TP engine's shards are even
            needs += [ResumeNeed(name, str(g), share, tuple(x.value for x in tags), source) for g in engine.gpus]
            gpus.update(engine.gpus)
        if not needs:
            return
        free = {g: r.free_bytes for g, r in d.probe.read_all(sorted(gpus, key=str)).items()}
        trace.attrs["resume_headroom"] = {"free_bytes": free, "needed_bytes": needed_per_gpu(needs),
                                          "headroom_bytes": headroom_mb << 20}
        check_resume_headroom(what, needs, free, headroom_mb << 20, d.node)

    async def _enter_sync(self, trace: Trace) -> dict[str, dict[str, int]]:
        d = self._d
        plans = {n: e.state.tags_to_resume((MemoryTag.WEIGHTS,), strict=False) for n, e in d.engines.items()}
        self._check_headroom("enter 'sync'", plans, trace)

        async def one(engine: EngineHandle) -> dict[str, int]:
            await ops.resume(engine, plans[engine.name], trace, d.metrics, d.timeouts(), d.probe)
            return {}
        return await each_engine(d.engines.values(), one, phase="sync", metrics=d.metrics)

    async def _enter_rollout(self, trace: Trace) -> dict[str, dict[str, int]]:
        d = self._d
        await d.sessions.lapse_if_idle()
        # Versions first: a push still in flight is refused by the bound, naming each engine's version.
        sync = d.policy_set().sync
        served = {n: e.state.weight_version for n, e in d.engines.items()}  # as just observed (reconcile)
        staleness = d.versions.lags(served)
        check_rollout_staleness(served, staleness, d.versions.latest, sync.staleness_bound, d.node,
                                newer={n: d.versions.newer(v) for n, v in served.items()})
        check_no_open_session(d.sessions.open_id(), advice=": commit or abort it first")
        check_rollout_weights((e.state for e in d.engines.values()), d.node)
        record = RolloutVersions(d.node.step, d.versions.latest, served, staleness, sync.staleness_bound, sync.mode)
        trace.attrs.update(rollout_versions=served, staleness_versions=staleness, latest_version=record.latest)
        plans = {n: e.state.tags_to_resume(None, strict=False) for n, e in d.engines.items()}
        self._check_headroom("enter 'rollout'", plans, trace)

        async def one(engine: EngineHandle) -> dict[str, int]:
            t = d.timeouts()
            await ops.resume(engine, plans[engine.name], trace, d.metrics, t, d.probe)
            await ops.flush(engine, trace, d.metrics, t)  # no stale prefix KV across a weight change
            await ops.continue_generation(engine, trace, d.metrics, t)
            return {}
        freed = await each_engine(d.engines.values(), one, phase="rollout", metrics=d.metrics)
        d.versions.record(record)
        for name, lag in staleness.items():
            d.metrics.rollout_staleness.labels(name).set(lag)
        return freed

    # -- manual sleep / resume -----------------------------------------------------------------
    def _select(self, names: list[str] | None) -> list[EngineHandle]:
        engines = self._d.engines
        if names is None:
            return list(engines.values())
        unknown = [n for n in names if n not in engines]
        if unknown:
            raise NotFound(f"unknown engines {unknown}; configured: {sorted(engines)}")
        return [engines[n] for n in names]

    async def sleep(self, tags: tuple[MemoryTag, ...] | None, names: list[str] | None) -> TransitionResult:
        """Pause and release ``tags`` (default: all owned) on the named engines; the phase is unchanged."""
        d = self._d
        engines = self._select(names)
        async with d.exclusive("sleep"):
            for engine in engines:  # validate all first: an illegal request changes nothing
                engine.state.tags_to_release(tags, strict=True)
            d.engine_lifecycle.require_attached()
            trace = Trace(d.node.step, "sleep")
            t0 = time.perf_counter()
            try:
                with trace.timed():
                    freed = await self._refreshed_on_failure(each_engine(
                        engines, lambda e: self._quiesce_and_release(e, tags, trace, strict=True),
                        phase="sleep", metrics=d.metrics), "sleep")
            finally:
                d.traces.put(trace)
            d.journal_append("sleep")
            return TransitionResult(d.node.step, "sleep", time.perf_counter() - t0,
                                    {e.name: e.state.snapshot() for e in engines}, freed, trace=trace)

    async def resume(self, tags: tuple[MemoryTag, ...] | None, names: list[str] | None) -> TransitionResult:
        """Resume ``tags`` on the named engines; generation continues only if the engine may serve."""
        d = self._d
        engines = self._select(names)
        async with d.exclusive("resume"):
            plans = {e.name: e.state.tags_to_resume(tags, strict=True) for e in engines}
            d.engine_lifecycle.require_attached()
            trace = Trace(d.node.step, "resume")
            self._check_headroom("resume", plans, trace)
            t0 = time.perf_counter()

            async def one(engine: EngineHandle) -> None:
                t = d.timeouts()
                await ops.resume(engine, plans[engine.name], trace, d.metrics, t, d.probe)
                if d.node.phase is NodePhase.ROLLOUT:
                    try:
                        engine.state.check_can_serve()
                    except TransitionRejected:
                        return  # stays paused: memory still released or weights stale (said in its state)
                    await ops.flush(engine, trace, d.metrics, t)
                    await ops.continue_generation(engine, trace, d.metrics, t)

            try:
                with trace.timed():
                    await self._refreshed_on_failure(each_engine(engines, one, phase="resume", metrics=d.metrics),
                                                     "resume")
            finally:
                d.traces.put(trace)
            d.journal_append("resume")
            return TransitionResult(d.node.step, "resume", time.perf_counter() - t0,
                                    {e.name: e.state.snapshot() for e in engines}, trace=trace)


def _record_trainer_report(trace: Trace, trainer: dict[str, Any] | None, versions: VersionBook) -> None:
    """Put what the trainer agent reported (group lifecycle, cleanup sub-steps, how its weights were pushed)
    into the step's trace; a version it reports started counts from now."""
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
