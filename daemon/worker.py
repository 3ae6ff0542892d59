"""The engine worker: the one place the daemon calls an engine, and the only writer of each engine's record.

Every plan (daemon/reconcile.py) runs here, whoever set it: phases, sleep / resume, weight sessions, the health
loop, relaunches, restarts; so does a weight session's work beside its plan (chunk loads, digests, groups,
broadcasts). A record changes only after the engine confirmed the step. Order rules (engine-apis.md §6.3): idle
before release, paused until fully resumed, weights before KV, flush after an update. A failed drive re-observes
every engine before the error reaches the caller, who re-asks: no step is retried behind its back. The caller
holds the node's lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from ..engines.base import (
    ChunkLoad,
    EngineAdapter,
    EngineDigests,
    EngineInfo,
    MemoryReport,
    MemoryTag,
    Observation,
    PauseMode,
)
from ..engines.config import AnyEngineConfig, ReferenceEngineConfig
from ..engines.weight_group_protocol import BroadcastDescriptor, SupportsWeightGroups
from ..errors import (
    ColocdError,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    StageTimeout,
    TransitionRejected,
)
from ..policies import Budget, Timeouts, Transport
from .events import emit
from .fanout import OnFailure, each_engine, fan_out
from .memory import GpuReading, NvmlProbe
from .metrics import Metrics
from .reconcile import Action, Desired, Plan, WeightsGoal, plan
from .states import (
    EngineRecord,
    Generation,
    NodeState,
    TagState,
    WeightsState,
    check_attached,
    unready_reason,
)
from .trace import Trace, TraceStore

__all__ = [
    "EngineHandle", "EngineWorker", "expected_release_bytes", "expected_resume_bytes", "group_verbs", "late_loads",
    "load_chunk"
]

_T = TypeVar("_T")


@dataclass
class EngineHandle:
    """One engine as the daemon holds it: adapter, config slice, attachment and the recorded state."""

    adapter: EngineAdapter
    config: AnyEngineConfig
    state: EngineRecord
    info: EngineInfo | None = None  # what the engine said when it attached (None: never; a restarted one re-attaches)
    # What the last release showed: bytes per tag by the engine's report, bytes NVML saw freed per set of tags;
    # and the most NVML saw a set's resume take (memory the trainer frees meanwhile hides some): expectations.
    learned_tag_bytes: dict[MemoryTag, int] = field(default_factory=dict)
    learned_release_bytes: dict[frozenset[MemoryTag], int] = field(default_factory=dict)
    learned_resume_bytes: dict[frozenset[MemoryTag], int] = field(default_factory=dict)
    observed_once: bool = False  # by this daemon
    lost_sight: bool = False  # since: a failed probe, or the record came from the journal
    restart_counted: str | None = None  # the incarnation last counted in colocd_engine_restarts_total
    # Chunk loads not yet answered, by session. A load outlives a session that ended under it (no engine tells
    # one session's chunk from another's): the next session opens only once the engine answered each.
    loads_in_flight: dict[asyncio.Task[None], str] = field(default_factory=dict)
    lost_session: str | None = None  # why a reconcile found the open weight session gone from the engine

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def transports(self) -> frozenset[Transport]:
        return self.adapter.transports

    def unready_reason(self) -> str | None:
        return unready_reason(self.name, self.info is not None, self.state)

    @property
    def device_type(self) -> str:
        """Where the engine's tensors live: the host for a reference engine whose config names no GPU; else CUDA."""
        return "cpu" if isinstance(self.config, ReferenceEngineConfig) and self.config.on_cpu else "cuda"

    @property
    def gpus(self) -> list[int | str]:
        return list(self.config.gpu_uuids or self.config.gpus)

    @property
    def tp_devices(self) -> tuple[str, ...] | None:
        """Each TP rank's device identity, as the engine reported it at attach, else the config's ``gpu_uuids``;
        None when unknown (GPU indices alone do not say which GPU a trainer rank's UUID is)."""
        tp = int(self.config.tp_size)
        if self.info is not None and len(self.info.device_ids) == tp:
            return tuple(self.info.device_ids)
        uuids = list(self.config.gpu_uuids or ())
        return tuple(uuids) if len(uuids) == tp else None


def expected_release_bytes(engine: EngineHandle, tags: tuple[MemoryTag, ...],
                           report: MemoryReport | None) -> tuple[int | None, str | None]:
    """What NVML should show freed once ``tags`` are released, and where that figure comes from: the smaller of
    what the engine reports the tags holding now and what NVML showed freed when they were last released (the
    one NVML can reach: an allocator may keep a few pages). None: the confirmation waits for a drop that stays."""
    known: dict[str, int] = {}
    if report is not None and (reported := report.nbytes(tags)) > 0:
        known["engine_report"] = reported
    if (learned := engine.learned_release_bytes.get(frozenset(tags))) is not None and learned > 0:
        known["last_release"] = learned
    if not known:
        return None, None
    source = min(known, key=known.__getitem__)
    return known[source], source


def expected_resume_bytes(engine: EngineHandle, tags: tuple[MemoryTag, ...]) -> tuple[int | None, str | None]:
    """What resuming ``tags`` will take on the engine's GPUs together, and from where: what the engine reported
    them holding when last released, else the most NVML showed taken when they last resumed; None: unknown."""
    if tags and all(engine.learned_tag_bytes.get(x, 0) > 0 for x in tags):
        return sum(engine.learned_tag_bytes[x] for x in tags), "engine_report"
    if (learned := engine.learned_resume_bytes.get(frozenset(tags))) is not None and learned > 0:
        return learned, "last_resume"
    return None, None


async def load_chunk(engine: EngineHandle, load: ChunkLoad, session_id: str) -> None:
    """One chunk into the engine. The call runs to the engine's answer even when the caller is cancelled (its
    session ended): until then it is in ``engine.loads_in_flight``, and no session opens on it (``late_loads``)."""
    call = asyncio.ensure_future(engine.adapter.load_weights(load))
    engine.loads_in_flight[call] = session_id
    call.add_done_callback(lambda done: (engine.loads_in_flight.pop(done, None),
                                         None if done.cancelled() else done.exception()))
    await asyncio.shield(call)


def late_loads(engine: EngineHandle) -> str | None:
    """Why a session may not open on ``engine`` now: a chunk load of an ended session still on its way."""
    if not engine.loads_in_flight:
        return None
    sessions = sorted(set(engine.loads_in_flight.values()))
    return (f"engine {engine.name!r} has not yet answered {len(engine.loads_in_flight)} chunk load(s) of ended "
            f"session(s) {', '.join(sessions)}; a late chunk would land in the next session, so it opens once the "
            "engine answered (or the engine is restarted)")


async def _memory_report(engine: EngineHandle) -> MemoryReport | None:
    """What the engine reports its tags taking, where it reports it; a failed read is no evidence either way."""
    try:
        return await engine.adapter.memory_report()
    except EngineError:
        return None


class EngineWorker:
    """Drives the node's engines, and keeps what its reconciles found and did."""

    def __init__(self, engines: dict[str, EngineHandle], metrics: Metrics, traces: TraceStore, *,
                 state: Callable[[], NodeState], timeouts: Callable[[], Timeouts],
                 probe: Callable[[], NvmlProbe | None], reconciled: Callable[[EngineHandle, Plan], Awaitable[None]],
                 open_session: Callable[[], str | None]) -> None:
        """``state``, ``timeouts``, ``probe``, ``open_session``: the node's as of now; ``reconciled(engine, plan)``:
        awaited after each reconcile that finished (the daemon journals a change, reloads kept LoRA adapters)."""
        self.engines, self.metrics, self.traces = engines, metrics, traces
        self._state, self._reconciled, self._open_session = state, reconciled, open_session
        self.timeouts, self.probe = timeouts, probe
        self.unreconciled: set[str] = set()  # journal records not yet checked against the engine: no mutations
        # Engines whose last reconcile did not finish, and why: not ready; the health loop retries them soon.
        self.unsettled: dict[str, str] = {}
        self.reports: dict[str, dict[str, Any]] = {}

    @property
    def node(self) -> NodeState:
        return self._state()

    def transports(self) -> frozenset[Transport] | None:
        """What every engine of the node loads (each adapter says; None: no engines to ask)."""
        accepted = [e.transports for e in self.engines.values()]
        return frozenset.intersection(*accepted) if accepted else None

    def restore(self, records: Mapping[str, Mapping[str, Any]]) -> None:
        """A restarted daemon's records of its engines, from its journal: each is re-verified before any mutating
        call (``unreconciled``)."""
        for name, snap in records.items():
            if (engine := self.engines.get(name)) is None:
                continue
            tags = {MemoryTag(t): TagState(s) for t, s in snap["tags"].items()}
            engine.state = engine.state.with_(
                tags={**engine.state.tags, **tags}, generation=Generation(snap["generation"]),
                weights=WeightsState(snap["weights"]), weight_version=snap["weight_version"],
                incarnation=snap.get("incarnation"), memory_unknown=snap.get("memory_unknown"))
            engine.lost_sight = True
            self.unreconciled.add(name)

    def require_attached(self) -> None:
        """Every engine answered the observation that just ran (``NodeLock.exclusive``); else 502 naming it."""
        for engine in self.engines.values():
            check_attached(engine.name, engine.info is not None, engine.state)

    # -- toward a desired state ----------------------------------------------------------------------
    async def drive(self, engines: list[EngineHandle], desired: Mapping[str, Desired], trace: Trace, *,
                    operation: str, what: str) -> dict[str, dict[str, int]]:
        """Drive each engine to ``desired[name]``, concurrently, timed under ``operation``; the bytes each freed."""
        owns = self._open_session() is not None

        async def one(engine: EngineHandle) -> dict[str, int]:
            p = plan(desired[engine.name], engine.state, None, phase=self.node.phase, owns_session=owns)
            return await self._run(engine, p, trace)

        try:
            return await each_engine(engines, one, operation=operation, metrics=self.metrics)
        except Exception:
            await self.reconcile_all(f"after failed {what}", keep_error=True)
            raise

    # -- toward the record, on a fresh observation -----------------------------------------------------
    async def reconcile_all(self, trigger: str, *, keep_error: bool = False) -> None:
        await fan_out(self.engines.values(), lambda e: self.reconcile(e, trigger, keep_error=keep_error),
                      on_failure=OnFailure.SETTLE)

    async def reconcile(self, engine: EngineHandle, trigger: str, *, keep_error: bool = False) -> bool:
        """Observe one engine and drive it toward its record; False if it cannot be done now. ``keep_error``: the
        last_error stays (a refresh right after a failed step keeps its error). A health change is logged once."""
        was_healthy = engine.state.healthy
        try:
            return await self._reconcile(engine, trigger, keep_error=keep_error)
        finally:
            if engine.state.healthy is not was_healthy:
                emit("engine_health", logging.INFO if engine.state.healthy else logging.WARNING, engine=engine.name,
                     session=self._open_session(), step=self.node.step, phase=self.node.phase.value,
                     healthy=engine.state.healthy, trigger=trigger, error=engine.state.last_error)

    async def _observe(self, engine: EngineHandle) -> Observation:
        budget = self.timeouts().budget(Budget.OBSERVE)
        try:
            async with asyncio.timeout(budget):
                if engine.info is None:
                    engine.info = await engine.adapter.attach()
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
        p = plan(Desired.holding(recorded), recorded, observed, phase=self.node.phase,
                 owns_session=self._open_session() is not None,
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
        if p.lost_session is not None:  # the open session fails on it once this reconcile is done
            engine.lost_session = p.lost_session
            self.metrics.reconcile_actions.labels(engine.name, "fail_session").inc()
        trace = Trace(self.node.step, f"reconcile:{engine.name}")
        try:
            if p.restarted:
                if observed.incarnation is None or observed.incarnation != engine.restart_counted:
                    self.metrics.engine_restarts.labels(engine.name).inc()  # once per new process
                    engine.restart_counted = observed.incarnation
                async with asyncio.timeout(self.timeouts().budget(Budget.OBSERVE)):
                    engine.info = await engine.adapter.attach()  # a new process may speak a new version
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
                self.traces.put(trace)
        if p.findings:
            self.metrics.reconcile_actions.labels(engine.name, "adopt").inc()
        engine.observed_once, engine.lost_sight = True, False
        reported = observed.resident is not None and all(t in observed.resident for t in engine.state.owned_tags)
        engine.state = engine.state.with_(healthy=True, incarnation=p.state.incarnation,
                                          last_error=engine.state.last_error if keep_error else None,
                                          memory_unknown=None if reported else engine.state.memory_unknown)
        self.unreconciled.discard(engine.name)
        self.unsettled.pop(engine.name, None)
        if p.changes_anything:
            self._report(engine, trigger, p, None)
        await self._reconciled(engine, p)
        return True

    # -- the worker: one engine, one plan ----------------------------------------------------------------
    async def _run(self, engine: EngineHandle, p: Plan, trace: Trace, *, counted: bool = False) -> dict[str, int]:
        """Run ``p``'s actions on ``engine`` in order; returns the bytes its release freed, per source.
        ``counted``: each action is counted in ``colocd_reconcile_actions`` (a reconcile's plan)."""
        freed: dict[str, int] = {}
        for action in p.actions:
            if action is Action.END_ENGINE_SESSION:
                try:
                    await self._end_session(engine, p.weights or WeightsGoal(), trace)
                except EngineRejected:
                    if not p.end_session_tolerant:
                        raise  # the engine said a session was open, yet refuses to end it
            elif action is Action.BEGIN_ENGINE_SESSION and p.weights is not None:
                await self._call(engine, trace, "begin_weight_update", Budget.WEIGHT_UPDATE,
                                 engine.adapter.begin_weight_update())
                engine.state = engine.state.with_(weights=WeightsState.UPDATING)
                engine.lost_session = None
            elif action is Action.PAUSE:
                await self._pause(engine, p.pause_mode, trace)
            elif action is Action.RELEASE:
                await self._flush(engine, trace)  # idle + empty radix cache before release
                freed = await self._release(engine, p.release, trace)
            elif action is Action.RESUME:
                await self._resume(engine, p.resume, trace)
            elif action is Action.CONTINUE:
                await self._flush(engine, trace)  # no stale prefix KV across a weight change
                await self._continue(engine, trace)
            if counted:
                self.metrics.reconcile_actions.labels(engine.name, action.value).inc()
        return freed

    # -- one engine call, and the plan's steps ---------------------------------------------------------
    async def _call(self, engine: EngineHandle, trace: Trace, name: str, budget: Budget, coro: Awaitable[_T],
                    advice: str = "", **attrs: Any) -> _T:
        """Run one engine call under its budget, as a span; a timeout names the stage and budget (and ``advice``)."""
        budget_s = self.timeouts().budget(budget)
        with trace.span(name, engine.name, **attrs):
            t0 = time.perf_counter()
            try:
                async with asyncio.timeout(budget_s):
                    return await coro
            except TimeoutError as exc:
                raise StageTimeout(f"engine {engine.name!r}: {name} exceeded its {budget_s:.1f}s budget "
                                   f"(timeouts.{budget.value}_s){advice}",
                                   engine=engine.name, stage=name, budget_s=budget_s) from exc
            except EngineError as exc:
                engine.state = engine.state.with_(last_error=str(exc))
                raise
            finally:
                self.metrics.observe_call(name, engine.name, time.perf_counter() - t0)

    async def _pause(self, engine: EngineHandle, mode: PauseMode, trace: Trace) -> None:
        if engine.state.generation is Generation.PAUSED:
            return
        await self._call(engine, trace, "pause_generation", Budget.PAUSE, engine.adapter.pause_generation(mode),
                         mode=mode.value)
        engine.state = engine.state.with_(generation=Generation.PAUSED)

    async def _flush(self, engine: EngineHandle, trace: Trace) -> None:
        """Flush the prefix cache, retrying SGLang's normal 400 ("not idle yet") with backoff."""

        async def retrying() -> None:
            delay = 0.01
            while not await engine.adapter.flush_cache():
                await asyncio.sleep(delay)  # backoff between retries of a refused flush
                delay = min(delay * 2, 1.0)

        await self._call(engine, trace, "flush_cache", Budget.FLUSH, retrying(),
                         advice=": the engine kept requests running (e.g. ones queued while it slept, which start "
                         "when it wakes); raise that budget or abort them, then retry the step")

    async def _release(self, engine: EngineHandle, tags: tuple[MemoryTag, ...], trace: Trace) -> dict[str, int]:
        """Release ``tags`` and wait until the memory is measurably free; the freed bytes per source."""
        if not tags:
            return {}
        probe = self.probe()
        before_gpu = probe.read_all(engine.gpus) if probe and engine.gpus else None
        before_own = await _memory_report(engine)
        self._sample_memory(engine, trace, before_own, before_gpu)
        with self._moving_memory(engine, "release_memory", tags):
            await self._call(engine, trace, "release_memory", Budget.RELEASE, engine.adapter.release_memory(tags),
                             tags=[x.value for x in tags])
        engine.state = engine.state.with_tags(tags, TagState.RELEASED)
        freed: dict[str, int] = {}
        if before_own is not None:
            for x in tags:
                engine.learned_tag_bytes[x] = before_own.nbytes((x,))
        if probe and before_gpu is not None:
            expected, expected_from = expected_release_bytes(engine, tags, before_own)
            with trace.span("confirm_memory_freed", engine.name, source="nvml") as span:
                confirmation = await probe.confirm_release(engine.gpus, before_gpu, expected_bytes=expected,
                                                           timeout_s=self.timeouts().budget(Budget.MEMORY_CONFIRM))
                span.attrs.update(freed_bytes=confirmation.freed_bytes, waited_s=round(confirmation.waited_s, 6),
                                  criterion=confirmation.criterion.value, polls=confirmation.polls,
                                  expected_bytes=expected, expected_from=expected_from)
            self.metrics.memory_confirm.labels(engine.name, confirmation.criterion.value).observe(
                confirmation.waited_s)
            engine.learned_release_bytes[frozenset(tags)] = sum(confirmation.freed_bytes.values())
            freed = {f"gpu:{g}": b for g, b in confirmation.freed_bytes.items()}
            for g, reading in before_gpu.items():
                trace.sample_memory(f"gpu:{g}", reading.used_bytes - confirmation.freed_bytes.get(g, 0))
        elif before_own is not None:
            # No NVML (CPU engines): what the engine reports the tags taking is its claim of what they freed.
            self._sample_memory(engine, trace, before_own, None)
            freed = {"engine": before_own.nbytes(tags)}
        for source, nbytes in freed.items():
            self.metrics.freed_bytes.labels(engine.name, source).inc(max(nbytes, 0))
        return freed

    async def _resume(self, engine: EngineHandle, tags: tuple[MemoryTag, ...], trace: Trace) -> None:
        if not tags:
            return
        probe = self.probe()
        before = probe.read_all(engine.gpus) if probe is not None and engine.gpus else None
        with self._moving_memory(engine, "resume_memory", tags):
            await self._call(engine, trace, "resume_memory", Budget.RESUME, engine.adapter.resume_memory(tags),
                             tags=[x.value for x in tags])
        engine.state = engine.state.with_tags(tags, TagState.RESIDENT)
        if probe is not None and before is not None:
            after = probe.read_all(engine.gpus)
            taken = sum(max(0, before[g].free_bytes - after[g].free_bytes) for g in before if g in after)
            key = frozenset(tags)
            engine.learned_resume_bytes[key] = max(taken, engine.learned_resume_bytes.get(key, 0))
            self._sample_memory(engine, trace, None, after)
        else:
            self._sample_memory(engine, trace, await _memory_report(engine), None)

    @contextlib.contextmanager
    def _moving_memory(self, engine: EngineHandle, name: str, tags: tuple[MemoryTag, ...]) -> Iterator[None]:
        """Around a release or resume of ``tags``: refused while the engine's memory state is unknown (blind, a
        second release kills SGLang, a resume of resident memory is refused); an answer lost after the call was
        sent leaves it unknown, since the engine may have acted."""
        if (unknown := engine.state.memory_unknown) is not None:
            raise TransitionRejected(f"{unknown}; no memory call until it is known: restart the engine",
                                     state=engine.state.snapshot())
        try:
            yield
        except (StageTimeout, EngineTimeout, EngineUnreachable) as exc:
            engine.state = engine.state.with_(memory_unknown=(
                f"engine {engine.name!r}: {name} {[x.value for x in tags]} was sent but its answer was lost ({exc}), "
                "so whether the engine moved that memory is unknown"))
            raise

    async def _continue(self, engine: EngineHandle, trace: Trace) -> None:
        engine.state.check_can_serve()  # never serve released memory or a partial update
        if engine.state.generation is Generation.SERVING:
            return
        await self._call(engine, trace, "continue_generation", Budget.PAUSE, engine.adapter.continue_generation())
        engine.state = engine.state.with_(generation=Generation.SERVING)

    def _sample_memory(self, engine: EngineHandle, trace: Trace, own: MemoryReport | None,
                       gpu: Mapping[str, GpuReading] | None) -> None:
        """A memory reading into the trace (the timeline's memory line) and the engine's gauges: NVML per GPU
        where there is one, else the engine's own per-tag accounting."""
        for g, reading in (gpu or {}).items():
            trace.sample_memory(f"gpu:{g}", reading.used_bytes)
        if own is not None:
            held = {tag: nbytes if engine.state.resident(tag) else 0 for tag, nbytes in own.tags.items()}
            trace.sample_memory(f"engine:{engine.name}", sum(held.values()))
            for tag, nbytes in held.items():
                self.metrics.engine_memory.labels(engine.name, tag.value).set(nbytes)

    async def _end_session(self, engine: EngineHandle, goal: WeightsGoal, trace: Trace) -> None:
        """End the engine's update: committed, it serves ``goal.version``; else its record holds what the session
        left (``goal.after``) from before the call, which may fail."""
        if goal.after is not None:
            engine.state = engine.state.with_(weights=goal.after)
        await self._call(engine, trace, "end_weight_update", Budget.WEIGHT_UPDATE,
                         engine.adapter.end_weight_update(goal.version))
        if goal.version is not None:
            engine.state = engine.state.with_(weights=WeightsState.CLEAN, weight_version=goal.version)

    # -- a weight session's goal ------------------------------------------------------------------------
    async def weights(self, goals: Mapping[str, WeightsGoal], trace: Trace, *, strict: bool) -> None:
        """Drive each named engine to its weight session goal, concurrently, on its record. ``strict``: the first
        failure is raised (the caller cleans up); else every engine is tried (a best-effort close)."""

        async def one(engine: EngineHandle) -> None:
            p = plan(replace(Desired.holding(engine.state), weights=goals[engine.name]), engine.state, None,
                     phase=self.node.phase, owns_session=self._open_session() is not None)
            await self._run(engine, p, trace)

        engines = [e for n, e in self.engines.items() if n in goals]
        if strict:
            await each_engine(engines, one, operation="weights", metrics=self.metrics)
        else:
            await fan_out(engines, one, on_failure=OnFailure.COLLECT)

    # -- a weight session's work beside its plan: digests, weight-update groups, broadcasts ---------------------
    async def digests(self, engine: EngineHandle, names: Sequence[str], trace: Trace) -> EngineDigests:
        return await self._call(engine, trace, "weight_digests", Budget.WEIGHT_UPDATE,
                                engine.adapter.weight_digests(names), tensors=len(names))

    async def join_group(self, engine: EngineHandle, trace: Trace, *, group_name: str, master_address: str,
                         master_port: int, rank_offset: int, world_size: int, backend: str) -> None:
        await self._call(engine, trace, "init_weights_update_group", Budget.GROUP,
                         group_verbs(engine).init_weights_update_group(
                             master_address=master_address, master_port=master_port, rank_offset=rank_offset,
                             world_size=world_size, group_name=group_name, backend=backend),
                         group=group_name, rank_offset=rank_offset)

    async def leave_group(self, engine: EngineHandle, group_name: str, trace: Trace) -> None:
        await self._call(engine, trace, "destroy_weights_update_group", Budget.GROUP,
                         group_verbs(engine).destroy_weights_update_group(group_name), group=group_name)

    async def receive_broadcast(self, engine: EngineHandle, desc: BroadcastDescriptor, trace: Trace) -> None:
        await self._call(engine, trace, f"update_weights_from_distributed#{desc.seq}", Budget.CHUNK,
                         group_verbs(engine).update_weights_from_distributed(
                             seq=desc.seq, names=list(desc.names), dtypes=list(desc.dtypes),
                             shapes=[list(s) for s in desc.shapes], group_name=desc.group_name,
                             load_format=desc.load_format),
                         group=desc.group_name, nbytes=desc.nbytes, tensors=len(desc.names))

    # -- LoRA adapters: daemon/adapters.py decides which name loads where and when --------------------------------
    async def load_adapter(self, engine: EngineHandle, name: str, folder: str) -> None:
        await self._call(engine, Trace(self.node.step, "adapter"), "load_lora_adapter", Budget.WEIGHT_UPDATE,
                         engine.adapter.load_lora_adapter(name, folder), adapter=name)

    async def unload_adapter(self, engine: EngineHandle, name: str) -> None:
        await self._call(engine, Trace(self.node.step, "adapter"), "unload_lora_adapter", Budget.WEIGHT_UPDATE,
                         engine.adapter.unload_lora_adapter(name), adapter=name)

    async def close(self) -> list[Exception]:
        """Stop waiting for the engines' answers and close every adapter (the daemon closes); the errors."""
        errors = []
        for engine in reversed(list(self.engines.values())):
            for call in list(engine.loads_in_flight):
                call.cancel()
            try:
                await engine.adapter.aclose()
            except Exception as exc:  # collect, keep closing the rest
                errors.append(exc)
        return errors

    def _report(self, engine: EngineHandle, trigger: str, p: Plan, error: str | None) -> None:
        report = {"trigger": trigger, "at": time.time(), "ok": error is None, "error": error, **p.snapshot()}
        self.reports[engine.name] = report
        emit("reconcile", logging.WARNING if p.restarted or error else logging.INFO, engine=engine.name,
             session=self._open_session(), step=self.node.step, phase=self.node.phase.value, trigger=trigger,
             result="failed" if error else "ok", restarted=p.restarted, reason=p.reason,
             findings=list(p.findings), actions=[a.value for a in p.actions], error=error)


def group_verbs(engine: EngineHandle) -> SupportsWeightGroups:
    """The engine's weight-update group verbs; 409 for an engine without them (SGLang's §1.6 path)."""
    if not isinstance(engine.adapter, SupportsWeightGroups):
        raise TransitionRejected(f"engine {engine.name!r} has no weight-update group routes (SGLang's §1.6 path)")
    return engine.adapter
