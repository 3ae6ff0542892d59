"""Per-operation traces (timed spans of every sub-step, exported as JSON or Chrome trace events), and the store
that keeps the last steps' traces, logs each one once and turns them into step metrics and summaries.

A step's switch is what the daemon and the trainer spend handing the GPU over, split into parts:
``sleep`` (train: engines pause and release), ``load_weights_memory`` (sync: weights memory back),
``update`` (the weight session, open to commit), ``wake`` (rollout: KV back, generation continues),
and the trainer-side ``cleanup`` and ``groups`` it reports with ``sync``. Training itself is not part of it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..recent import remember
from .events import emit
from .metrics import PARTS, Metrics

__all__ = ["Span", "Trace", "TraceStore", "log_failed", "log_rejected", "step_summary"]

log = logging.getLogger("colocd.events")
# The phases Transitions.transition runs: it logs each failure itself, with the error that reached the caller.
_NODE_PHASES = ("train", "sync", "rollout")
_PHASE_PART = {"train": "sleep", "sync": "load_weights_memory", "weights": "update", "rollout": "wake"}
# Phases of the train → sync → weights → rollout cycle, in order; manual ones follow.
_PHASE_ORDER = ("train", "sync", "weights", "rollout", "sleep", "resume", "weight_group")


@dataclass(slots=True)
class Span:
    """One timed sub-step; ``engine`` is None for node-level steps."""

    name: str
    engine: str | None
    start_s: float
    duration_s: float = 0.0
    ok: bool = True
    attrs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "engine": self.engine, "start_s": round(self.start_s, 6),
                "duration_s": round(self.duration_s, 6), "ok": self.ok, **({"attrs": self.attrs} if self.attrs else {})}


@dataclass
class Trace:
    """The spans of one operation (a transition, weight session, sleep, resume, reconcile), relative to its start."""

    step: int
    # A phase (train, sync, rollout) or another operation (weights, weight_group, sleep, resume,
    # reconcile:<engine>); the wire calls it "phase" in /v1/traces and /v1/steps (kept).
    operation: str
    started_at: float = field(default_factory=time.time)
    _t0: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)
    # Set once it ended (``finish``): its wall time and outcome (ok, failed, committed, aborted, ...).
    duration_s: float | None = None
    outcome: str | None = None
    attrs: dict[str, Any] = field(default_factory=dict)  # whole-trace facts: bytes, chunks, version
    # GPU (or engine-reported) memory readings taken while it ran: {t_s, source, value_bytes}.
    memory: list[dict[str, Any]] = field(default_factory=list)

    @contextmanager
    def span(self, name: str, engine: str | None = None, **attrs: Any) -> Iterator[Span]:
        span = Span(name, engine, time.perf_counter() - self._t0, attrs=dict(attrs))
        try:
            yield span
        except BaseException as exc:
            span.ok = False
            span.attrs.setdefault("error", f"{type(exc).__name__}: {exc}"[:500])
            raise
        finally:
            span.duration_s = time.perf_counter() - self._t0 - span.start_s
            self.spans.append(span)

    def add(self, span: Span) -> None:
        self.spans.append(span)

    def finish(self, outcome: str, **attrs: Any) -> None:
        """Record that it ended; the first call wins (a failure path may run after a recorded end)."""
        if self.outcome is None:
            self.duration_s = self.elapsed_s()
            self.outcome = outcome
        self.attrs.update(attrs)

    @contextmanager
    def timed(self) -> Iterator[None]:
        """``with trace.timed(): ...`` finishes it as ``ok``, or ``failed`` if the block raised."""
        try:
            yield
        except BaseException:
            self.finish("failed")
            raise
        self.finish("ok")

    def sample_memory(self, source: str, value_bytes: int) -> None:
        """One memory reading (``source`` is ``gpu:N`` from NVML or ``engine:NAME`` from its own report)."""
        self.memory.append({"t_s": round(self.elapsed_s(), 6), "source": source, "value_bytes": int(value_bytes)})

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.operation, "started_at": self.started_at,
                "duration_s": None if self.duration_s is None else round(self.duration_s, 6),
                "outcome": self.outcome, **({"attrs": self.attrs} if self.attrs else {}),
                **({"memory": self.memory} if self.memory else {}),
                "spans": [s.to_json() for s in sorted(self.spans, key=lambda s: s.start_s)]}

    def to_chrome(self) -> list[dict[str, Any]]:
        """Chrome trace-event format (load in Perfetto): one complete event per span, a row per engine."""
        base_us = self.started_at * 1e6
        return [
            {"name": s.name, "ph": "X", "ts": base_us + s.start_s * 1e6, "dur": s.duration_s * 1e6,
             "pid": f"step {self.step}", "tid": s.engine or "node", "cat": self.operation,
             "args": {"ok": s.ok, **s.attrs}}
            for s in self.spans
        ] + [
            # Counter events: Perfetto draws each source as a memory track.
            {"name": f"memory {m['source']}", "ph": "C", "ts": base_us + m["t_s"] * 1e6, "pid": f"step {self.step}",
             "args": {"bytes": m["value_bytes"]}}
            for m in self.memory
        ]


def _error_of(trace: Trace) -> str | None:
    return next((str(s.attrs.get("error")) for s in trace.spans if not s.ok and s.attrs.get("error")), None)


def _phase_summary(trace: Trace) -> dict[str, Any]:
    out: dict[str, Any] = {"phase": trace.operation, "started_at": trace.started_at,
                           "duration_s": None if trace.duration_s is None else round(trace.duration_s, 6),
                           "result": trace.outcome or "in_progress"}
    for key in ("bytes", "chunks", "freed_bytes", "version"):
        if key in trace.attrs:
            out[key] = trace.attrs[key]
    if (error := _error_of(trace)) is not None:
        out["error"] = error
    return out


def step_summary(step: int, traces: Mapping[str, Trace]) -> dict[str, Any]:
    """One step: its phases, switch breakdown and bytes; its result failed, ok (rollout ended) or in_progress."""
    ordered = sorted(traces.values(), key=lambda t: (_PHASE_ORDER.index(t.operation)
                                                       if t.operation in _PHASE_ORDER else len(_PHASE_ORDER),
                                                       t.started_at))
    breakdown = dict.fromkeys(PARTS, 0.0)
    for trace in ordered:
        if (part := _PHASE_PART.get(trace.operation)) is not None and trace.duration_s is not None:
            breakdown[part] += trace.duration_s
        for span in trace.spans:
            if span.name.startswith("trainer.cleanup"):
                breakdown["cleanup"] += span.duration_s
            elif span.name == "trainer.process_groups":
                breakdown["groups"] += span.duration_s
    outcomes = [t.outcome for t in ordered]
    if any(o in ("failed", "aborted") for o in outcomes):
        result = "failed"
    elif (rollout := traces.get("rollout")) is not None and rollout.outcome == "ok":
        result = "ok"
    else:
        result = "in_progress"
    weights = traces.get("weights")
    return {"step": step, "result": result, "started_at": min((t.started_at for t in ordered), default=None),
            "switch_s": round(sum(breakdown.values()), 6), "breakdown": {k: round(v, 6) for k, v in breakdown.items()},
            "bytes": int(weights.attrs.get("bytes", 0)) if weights is not None else 0,
            "chunks": int(weights.attrs.get("chunks", 0)) if weights is not None else 0,
            "phases": [_phase_summary(t) for t in ordered]}


def log_rejected(phase: str, step: int, reason: str, *, session: str | None = None) -> None:
    """A transition refused before it started (409): logged, it has no trace."""
    emit("transition", logging.INFO, engine=None, session=session, step=step, phase=phase, result="rejected",
         error=reason)


def log_failed(phase: str, step: int, exc: BaseException, *, session: str | None = None) -> None:
    """A transition that failed at any point (before its trace began, too): the caller's error and its engine."""
    emit("transition", logging.WARNING, engine=getattr(exc, "engine", None), session=session, step=step,
         phase=phase, result="failed", error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class TraceStore:
    """The last ``capacity`` steps' traces, keyed by step then operation. Each stored trace is logged (one line)
    and recorded in the step metrics; bookkeeping never fails the operation it describes."""

    def __init__(self, metrics: Metrics, capacity: int = 64) -> None:
        self._metrics = metrics
        self._capacity = capacity
        self._steps: OrderedDict[int, dict[str, Trace]] = OrderedDict()

    def put(self, trace: Trace) -> None:
        operations = self._steps.get(trace.step, {})
        operations[trace.operation] = trace
        remember(self._steps, trace.step, operations, self._capacity)
        try:
            self._log(trace)
            self._record(trace)
        except Exception:
            log.exception("trace store: could not record step %s phase %s", trace.step, trace.operation)

    def get(self, step: int) -> dict[str, Trace] | None:
        return self._steps.get(step)

    def steps(self) -> list[int]:
        return list(self._steps)

    def summaries(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` steps, newest first (``GET /v1/steps``)."""
        return [step_summary(s, self._steps[s]) for s in self.steps()[-limit:][::-1]]

    def _log(self, trace: Trace) -> None:
        session = trace.operation == "weights"
        if trace.operation in _NODE_PHASES and trace.outcome != "ok":
            return  # Transitions.transition logs it (failed), with the caller's error
        if trace.operation.startswith("reconcile:"):
            return  # EngineWorker logs each reconcile (event reconcile), with its plan
        failed = next((s for s in trace.spans if not s.ok and s.engine and s.engine != "trainer"), None)
        fields: dict[str, Any] = {
            "step": trace.step, "phase": trace.operation, "result": trace.outcome or "in_progress",
            "duration_s": None if trace.duration_s is None else round(trace.duration_s, 6),
            "bytes": trace.attrs.get("bytes") if session else trace.attrs.get("freed_bytes"),
            "chunks": trace.attrs.get("chunks"), "version": trace.attrs.get("version"),
            "engines": ",".join(sorted({s.engine for s in trace.spans if s.engine and s.engine != "trainer"})) or None,
            "error": _error_of(trace)}
        level = logging.WARNING if trace.outcome in ("failed", "aborted", "expired") else logging.INFO
        emit("weight_session" if session else "transition", level,
             engine=failed.engine if failed is not None else None, session=trace.attrs.get("session"), **fields)

    def _record(self, trace: Trace) -> None:
        m = self._metrics
        if trace.operation == "weights":
            if trace.duration_s is not None:
                m.observe_phase("weights", "all", trace.duration_s)  # once per session (daemon/fanout.py)
                m.weight_session_duration.labels(trace.outcome or "unknown").observe(trace.duration_s)
            for span in trace.spans:
                if span.name == "load_chunk" and span.ok and span.engine:
                    m.chunk_load_duration.labels(span.engine).observe(span.duration_s)
        for span in trace.spans:
            if span.engine == "trainer":
                m.trainer_substep_duration.labels(span.name.removeprefix("trainer.")).observe(span.duration_s)
                if span.name == "trainer.weight_sync":
                    m.weight_syncs.labels(str(span.attrs.get("requested", "sync")),
                                          str(span.attrs.get("mode", "sync"))).inc()
                    if span.attrs.get("fallback_reason"):
                        m.fallbacks.labels("weight_sync").inc()
                if span.name == "trainer.process_groups":
                    if span.attrs.get("fallback_reason"):
                        m.fallbacks.labels("process_groups").inc()
                    if isinstance(kept := span.attrs.get("kept_bytes"), int):
                        m.trainer_groups_kept_bytes.clear()  # only the last pause's action is current
                        m.trainer_groups_kept_bytes.labels(str(span.attrs.get("action", "unknown"))).set(kept)
        if trace.operation == "rollout" and trace.outcome == "ok":
            summary = step_summary(trace.step, self._steps.get(trace.step) or {})
            m.step_switch.observe(summary["switch_s"])
            for part, seconds in summary["breakdown"].items():
                m.step_part_duration.labels(part).observe(seconds)
                m.last_step_part.labels(part).set(seconds)
            m.last_step_part.labels("total").set(summary["switch_s"])
            m.last_step.set(trace.step)
