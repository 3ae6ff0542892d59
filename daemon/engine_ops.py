"""The per-engine steps of a handoff, each one engine call under its own deadline, recorded as a span.

Each step updates the engine's recorded state only after the engine confirmed it, so a failure
anywhere leaves the record equal to what the engine really did. Order rules (engine-apis.md §6.3):
idle before release, stay paused until fully resumed, weights before KV, flush after an update.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from ..engines.base import (
    ChunkLoad,
    EngineAdapter,
    EngineDigests,
    EngineInfo,
    MemoryReport,
    MemoryTag,
    PauseMode,
)
from ..engines.config import AnyEngineConfig, ReferenceEngineConfig
from ..errors import EngineError, StageTimeout
from ..policies import Budget, Timeouts
from .memory import GpuReading, NvmlProbe
from .metrics import Metrics
from .states import Attachment, EngineRecord, Generation, TagState, unready_reason
from .trace import Trace

__all__ = [
    "EngineHandle",
    "cancel_loads",
    "continue_generation",
    "digests",
    "expected_release_bytes",
    "expected_resume_bytes",
    "flush",
    "late_loads",
    "load_chunk",
    "pause",
    "release",
    "resume",
    "timed_call",
]

_T = TypeVar("_T")


@dataclass
class EngineHandle:
    """One engine as the daemon holds it: adapter, config slice, attachment (with what ``attach`` said)
    and the recorded state."""

    adapter: EngineAdapter
    config: AnyEngineConfig
    state: EngineRecord
    attachment: Attachment = Attachment.DETACHED
    info: EngineInfo | None = None  # what the engine said when it attached (None while detached)
    # Bytes each tag held by the engine's own report the last time it was released, and bytes NVML
    # showed freed the last time a set of tags was released together: the next release's expectation.
    learned_tag_bytes: dict[MemoryTag, int] = field(default_factory=dict)
    learned_release_bytes: dict[frozenset[MemoryTag], int] = field(default_factory=dict)
    # The most NVML showed the engine's GPUs lose while a set of tags resumed: what the next resume of
    # the same set needs free (the largest seen, since memory the trainer frees meanwhile hides some).
    learned_resume_bytes: dict[frozenset[MemoryTag], int] = field(default_factory=dict)
    # Reconciliation (daemon/reconcile.py): observed at least once by this daemon; and whether it
    # lost sight of the engine since (a failed probe, or its record came from the journal).
    observed_once: bool = False
    lost_sight: bool = False
    restart_counted: str | None = None  # the incarnation last counted in colocd_engine_restarts_total
    # Chunk loads sent to the engine and not yet answered, with the session each belongs to. A load outlives a
    # session that ended under it (no engine tells one session's chunk from another's, so a load cancelled on
    # the daemon's side could still land): the next session opens only once the engine answered each.
    loads_in_flight: dict[asyncio.Task[None], str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.state.name

    def attached(self, info: EngineInfo) -> None:
        """The engine answered ``attach`` (first contact, or a restarted process that may speak a new version)."""
        self.info, self.attachment = info, Attachment.ATTACHED

    def unready_reason(self) -> str | None:
        return unready_reason(self.name, self.attachment, self.state)

    @property
    def device_type(self) -> str:
        """Where the engine's tensors live: the reference engine says (``device``); SGLang and vLLM run on CUDA."""
        return self.config.device.split(":")[0] if isinstance(self.config, ReferenceEngineConfig) else "cuda"

    @property
    def gpus(self) -> list[int | str]:
        return list(self.config.gpu_uuids or self.config.gpus)

    @property
    def tp_devices(self) -> tuple[str, ...] | None:
        """Each TP rank's device identity in TP-rank order, as the engine reported it at attach (else the
        config's ``gpu_uuids``, one per TP rank); None when unknown (GPU indices alone do not say which GPU
        a trainer rank's UUID is)."""
        tp = int(self.config.tp_size)
        if self.info is not None and len(self.info.device_ids) == tp:
            return tuple(self.info.device_ids)
        uuids = list(self.config.gpu_uuids or ())
        return tuple(uuids) if len(uuids) == tp else None


async def timed_call(engine: EngineHandle, trace: Trace, metrics: Metrics, name: str, budget_s: float,
                     coro: Awaitable[_T], **attrs: Any) -> _T:
    """Run one engine call under its deadline, as a span; a timeout names the step and budget."""
    with trace.span(name, engine.name, **attrs):
        t0 = time.perf_counter()
        try:
            async with asyncio.timeout(budget_s):
                result = await coro
        except TimeoutError as exc:
            raise StageTimeout(f"engine {engine.name!r}: {name} exceeded its {budget_s:.1f}s budget",
                              engine=engine.name, stage=name, budget_s=budget_s) from exc
        except EngineError as exc:
            engine.state = engine.state.with_(last_error=str(exc))
            raise
        finally:
            metrics.observe_call(name, engine.name, time.perf_counter() - t0)
    return result


async def pause(engine: EngineHandle, mode: PauseMode, trace: Trace, metrics: Metrics, t: Timeouts) -> None:
    if engine.state.generation is Generation.PAUSED:
        return
    await timed_call(engine, trace, metrics, "pause_generation", t.budget(Budget.PAUSE),
                 engine.adapter.pause_generation(mode), mode=mode.value)
    engine.state = engine.state.with_(generation=Generation.PAUSED)


async def flush(engine: EngineHandle, trace: Trace, metrics: Metrics, t: Timeouts) -> None:
    """Flush the prefix cache, retrying SGLang's normal 400 ("not idle yet") with backoff."""
    budget = t.budget(Budget.FLUSH)

    async def _retrying() -> int:
        delay, attempts = 0.01, 0
        while True:
            attempts += 1
            if await engine.adapter.flush_cache():
                return attempts
            await asyncio.sleep(delay)  # backoff between retries of a refused flush
            delay = min(delay * 2, 1.0)

    try:
        await timed_call(engine, trace, metrics, "flush_cache", budget, _retrying())
    except StageTimeout as exc:
        # The policy for a flush the engine keeps refusing is "wait, within a budget that says so".
        raise StageTimeout(f"{exc}: the engine kept requests running (e.g. ones queued while it slept, which "
                          "start when it wakes); raise timeouts.flush_s or abort them, then retry the step",
                          engine=exc.engine or engine.name, stage=exc.stage or "flush_cache",
                          budget_s=exc.budget_s) from exc.__cause__


async def release(engine: EngineHandle, tags: tuple[MemoryTag, ...], trace: Trace, metrics: Metrics,
                  t: Timeouts, probe: NvmlProbe | None) -> dict[str, int]:
    """Release ``tags`` and wait until the memory is measurably free. Returns freed bytes per source."""
    if not tags:
        return {}
    before_gpu = probe.read_all(engine.gpus) if probe and engine.gpus else None
    before_own = await _memory_report(engine)
    _sample_memory(engine, trace, metrics, before_own, before_gpu)
    await timed_call(engine, trace, metrics, "release_memory", t.budget(Budget.RELEASE),
                 engine.adapter.release_memory(tags), tags=[x.value for x in tags])
    engine.state = engine.state.with_tags(tags, TagState.RELEASED)
    freed: dict[str, int] = {}
    if before_own is not None:
        for x in tags:
            engine.learned_tag_bytes[x] = before_own.nbytes((x,))
    if probe and before_gpu is not None:
        expected, expected_from = expected_release_bytes(engine, tags, before_own)
        with trace.span("confirm_memory_freed", engine.name, source="nvml") as span:
            confirmation = await probe.confirm_release(
                engine.gpus, before_gpu, expected_bytes=expected,
                timeout_s=t.budget(Budget.MEMORY_CONFIRM))
            span.attrs.update(freed_bytes=confirmation.freed_bytes, waited_s=round(confirmation.waited_s, 6),
                              criterion=confirmation.criterion.value, polls=confirmation.polls,
                              expected_bytes=expected, expected_from=expected_from)
        metrics.memory_confirm.labels(engine.name, confirmation.criterion.value).observe(confirmation.waited_s)
        engine.learned_release_bytes[frozenset(tags)] = sum(confirmation.freed_bytes.values())
        freed = {f"gpu:{g}": b for g, b in confirmation.freed_bytes.items()}
        for g, reading in before_gpu.items():
            trace.sample_memory(f"gpu:{g}", reading.used_bytes - confirmation.freed_bytes.get(g, 0))
    elif before_own is not None:
        # No NVML (CPU engines): what the engine reports the tags taking is its claim of what they freed.
        _sample_memory(engine, trace, metrics, before_own, None)
        freed = {"engine": before_own.nbytes(tags)}
    for source, nbytes in freed.items():
        metrics.freed_bytes.labels(engine.name, source).inc(max(nbytes, 0))
    return freed


def expected_release_bytes(engine: EngineHandle, tags: tuple[MemoryTag, ...],
                           report: MemoryReport | None) -> tuple[int | None, str | None]:
    """What NVML should show freed once ``tags`` are released, and where that figure comes from.

    The smaller of what the engine reports holding under those tags now and what NVML showed the last
    time the same tags were released: either is evidence the bytes are back, and the smaller one is
    the one NVML can reach (an allocator may keep a few pages; an engine may hold less than last time).
    None when neither is known: the confirmation then waits for a drop that stays put.
    """
    known: dict[str, int] = {}
    if report is not None:
        if (reported := report.nbytes(tags)) > 0:
            known["engine_report"] = reported
    if (learned := engine.learned_release_bytes.get(frozenset(tags))) is not None and learned > 0:
        known["last_release"] = learned
    if not known:
        return None, None
    source = min(known, key=known.__getitem__)
    return known[source], source


def expected_resume_bytes(engine: EngineHandle, tags: tuple[MemoryTag, ...]) -> tuple[int | None, str | None]:
    """What resuming ``tags`` will take on the engine's GPUs (all of them together), and where that figure
    comes from: what the engine reported the tags holding when they were last released, else the most
    NVML showed taken when the same tags last resumed. None when neither is known (a first resume)."""
    if tags and all(engine.learned_tag_bytes.get(x, 0) > 0 for x in tags):
        return sum(engine.learned_tag_bytes[x] for x in tags), "engine_report"
    if (learned := engine.learned_resume_bytes.get(frozenset(tags))) is not None and learned > 0:
        return learned, "last_resume"
    return None, None


async def resume(engine: EngineHandle, tags: tuple[MemoryTag, ...], trace: Trace, metrics: Metrics,
                 t: Timeouts, probe: NvmlProbe | None = None) -> None:
    if not tags:
        return
    before = probe.read_all(engine.gpus) if probe is not None and engine.gpus else None
    await timed_call(engine, trace, metrics, "resume_memory", t.budget(Budget.RESUME),
                 engine.adapter.resume_memory(tags), tags=[x.value for x in tags])
    engine.state = engine.state.with_tags(tags, TagState.RESIDENT)
    if probe is not None and before is not None:
        after = probe.read_all(engine.gpus)
        taken = sum(max(0, before[g].free_bytes - after[g].free_bytes) for g in before if g in after)
        key = frozenset(tags)
        engine.learned_resume_bytes[key] = max(taken, engine.learned_resume_bytes.get(key, 0))
        _sample_memory(engine, trace, metrics, None, after)
    else:
        _sample_memory(engine, trace, metrics, await _memory_report(engine), None)


async def continue_generation(engine: EngineHandle, trace: Trace, metrics: Metrics, t: Timeouts) -> None:
    engine.state.check_can_serve()  # never serve released memory or a partial update
    if engine.state.generation is Generation.SERVING:
        return
    await timed_call(engine, trace, metrics, "continue_generation", t.budget(Budget.PAUSE),
                 engine.adapter.continue_generation())
    engine.state = engine.state.with_(generation=Generation.SERVING)


# -- a weight session's calls beside its plan (daemon/sync.py begins and ends it): chunks, and its questions --
async def load_chunk(engine: EngineHandle, load: ChunkLoad, session_id: str) -> None:
    """One chunk into the engine; the session's lane times and traces it, under the chunk budget.

    The call runs to the engine's answer even when the caller is cancelled (its session ended): until then it is
    in ``engine.loads_in_flight``, and no other session may open on the engine (``late_loads``)."""
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


def cancel_loads(engine: EngineHandle) -> None:
    """Stop waiting for the engine's answers (the daemon closes)."""
    for call in list(engine.loads_in_flight):
        call.cancel()


async def digests(engine: EngineHandle, names: Sequence[str], trace: Trace, metrics: Metrics,
                  budget_s: float) -> EngineDigests:
    """What the engine holds of ``names``, as digests, for a verified commit (daemon/verify.py)."""
    return await timed_call(engine, trace, metrics, "weight_digests", budget_s, engine.adapter.weight_digests(names),
                            tensors=len(names))


async def _memory_report(engine: EngineHandle) -> MemoryReport | None:
    """What the engine reports its tags taking, where it reports it; a failed read is no evidence either way."""
    try:
        return await engine.adapter.memory_report()
    except EngineError:
        return None


def _sample_memory(engine: EngineHandle, trace: Trace, metrics: Metrics, own: MemoryReport | None,
                   gpu: Mapping[str, GpuReading] | None) -> None:
    """Put a memory reading into the trace (the timeline's memory line) and the engine's gauges:
    NVML per GPU where there is one, else what the engine reports of the tags the record says are resident."""
    for g, reading in (gpu or {}).items():
        trace.sample_memory(f"gpu:{g}", reading.used_bytes)
    if own is not None:
        held = {tag: nbytes if engine.state.resident(tag) else 0 for tag, nbytes in own.tags.items()}
        trace.sample_memory(f"engine:{engine.name}", sum(held.values()))
        for tag, nbytes in held.items():
            metrics.engine_memory.labels(engine.name, tag.value).set(nbytes)
