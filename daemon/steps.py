"""The step book: turns each finished trace into one log line and step metrics, and summarises steps.

A step's switch is what the daemon and the trainer spend handing the GPU over, split into parts:
``sleep`` (train: engines pause and release), ``load_weights_memory`` (sync: weights memory back),
``update`` (the weight session, open to commit), ``wake`` (rollout: KV back, generation continues),
and the trainer-side ``cleanup`` and ``groups`` it reports with ``sync``. Training itself is not part of it.
Knows nothing of HTTP; the api shapes ``summaries()`` into ``GET /v1/steps``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from .events import emit
from .metrics import Metrics
from .trace import Trace, TraceStore

__all__ = ["PARTS", "StepBook", "step_summary"]

log = logging.getLogger("colocd.events")
# The phases Transitions.transition runs: it logs each failure itself, with the error that reached the caller.
_NODE_PHASES = ("train", "sync", "rollout")

# The parts of a switch, in the order they happen; ``total`` is their sum.
PARTS = ("sleep", "load_weights_memory", "update", "wake", "cleanup", "groups")
_PHASE_PART = {"train": "sleep", "sync": "load_weights_memory", "weights": "update", "rollout": "wake"}
# Phases of the train → sync → weights → rollout cycle, in order; manual ones follow.
_PHASE_ORDER = ("train", "sync", "weights", "rollout", "sleep", "resume", "weight_group")


def _trainer_parts(trace: Trace) -> dict[str, float]:
    parts = {"cleanup": 0.0, "groups": 0.0}
    for span in trace.spans:
        if span.name.startswith("trainer.cleanup"):
            parts["cleanup"] += span.duration_s
        elif span.name == "trainer.process_groups":
            parts["groups"] += span.duration_s
    return parts


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
    """One step: its phases with durations, the switch breakdown, bytes moved and the step's result.

    result: ``failed`` if any phase failed, ``ok`` once rollout finished, else ``in_progress``.
    """
    ordered = sorted(traces.values(), key=lambda t: (_PHASE_ORDER.index(t.operation)
                                                       if t.operation in _PHASE_ORDER else len(_PHASE_ORDER),
                                                       t.started_at))
    breakdown = dict.fromkeys(PARTS, 0.0)
    for trace in ordered:
        if (part := _PHASE_PART.get(trace.operation)) is not None and trace.duration_s is not None:
            breakdown[part] += trace.duration_s
        for part, seconds in _trainer_parts(trace).items():
            breakdown[part] += seconds
    outcomes = [t.outcome for t in ordered]
    if any(o in ("failed", "aborted") for o in outcomes):
        result = "failed"
    elif (rollout := traces.get("rollout")) is not None and rollout.outcome == "ok":
        result = "ok"
    else:
        result = "in_progress"
    weights = traces.get("weights")
    return {
        "step": step,
        "result": result,
        "started_at": min((t.started_at for t in ordered), default=None),
        "switch_s": round(sum(breakdown.values()), 6),
        "breakdown": {k: round(v, 6) for k, v in breakdown.items()},
        "bytes": int(weights.attrs.get("bytes", 0)) if weights is not None else 0,
        "chunks": int(weights.attrs.get("chunks", 0)) if weights is not None else 0,
        "phases": [_phase_summary(t) for t in ordered],
    }


def log_rejected(phase: str, step: int, reason: str, *, session: str | None = None) -> None:
    """A transition refused before it started (409): logged, it has no trace."""
    emit("transition", logging.INFO, engine=None, session=session, step=step, phase=phase, result="rejected",
         error=reason)


def log_failed(phase: str, step: int, exc: BaseException, *, session: str | None = None) -> None:
    """A transition that failed, at any point (before its trace began, too): one line with the error the caller
    got and the engine it names."""
    emit("transition", logging.WARNING, engine=getattr(exc, "engine", None), session=session, step=step,
         phase=phase, result="failed", error=f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


class StepBook:
    """Sees every stored trace (``TraceStore(on_put=book.observe)``): logs it and records step metrics."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self._store: TraceStore | None = None

    def attach(self, store: TraceStore) -> None:
        self._store = store

    def observe(self, trace: Trace) -> None:
        # Bookkeeping must never fail the transition it describes.
        try:
            self._log(trace)
            self._record(trace)
        except Exception:
            log.exception("step book: could not record step %s phase %s", trace.step, trace.operation)

    def summaries(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` steps, newest first."""
        if self._store is None:
            return []
        steps = self._store.steps()[-limit:][::-1]
        return [step_summary(s, self._store.get(s) or {}) for s in steps]

    # -- internals -----------------------------------------------------------------------------
    def _log(self, trace: Trace) -> None:
        session = trace.operation == "weights"
        if trace.operation in _NODE_PHASES and trace.outcome != "ok":
            return  # Transitions.transition logs it (failed), with the caller's error
        if trace.operation.startswith("reconcile:"):
            return  # EngineWorker logs each reconcile (event reconcile), with its plan
        failed = next((s for s in trace.spans if not s.ok and s.engine and s.engine != "trainer"), None)
        fields: dict[str, Any] = {
            "step": trace.step,
            "phase": trace.operation,
            "result": trace.outcome or "in_progress",
            "duration_s": None if trace.duration_s is None else round(trace.duration_s, 6),
            "bytes": trace.attrs.get("bytes") if session else trace.attrs.get("freed_bytes"),
            "chunks": trace.attrs.get("chunks"),
            "version": trace.attrs.get("version"),
            "engines": ",".join(sorted({s.engine for s in trace.spans if s.engine and s.engine != "trainer"})) or None,
            "error": _error_of(trace),
        }
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
        if trace.operation == "rollout" and trace.outcome == "ok" and self._store is not None:
            summary = step_summary(trace.step, self._store.get(trace.step) or {})
            m.step_switch.observe(summary["switch_s"])
            for part, seconds in summary["breakdown"].items():
                m.step_part_duration.labels(part).observe(seconds)
                m.last_step_part.labels(part).set(seconds)
            m.last_step_part.labels("total").set(summary["switch_s"])
            m.last_step.set(trace.step)
