"""Per-transition traces: timed spans of every sub-step, exported as JSON or Chrome trace events."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..recent import remember

__all__ = ["Span", "Trace", "TraceStore"]


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
    """The spans of one operation (a transition, a weight session, a sleep or resume, a reconcile), relative to
    its start."""

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


class TraceStore:
    """The last ``capacity`` steps' traces, keyed by step then operation. ``on_put`` sees each stored trace
    (the daemon's step book: logs and step metrics)."""

    def __init__(self, capacity: int = 64, *, on_put: Callable[[Trace], None] | None = None) -> None:
        self._capacity = capacity
        self._steps: OrderedDict[int, dict[str, Trace]] = OrderedDict()
        self._on_put = on_put

    def put(self, trace: Trace) -> None:
        operations = self._steps.get(trace.step, {})
        operations[trace.operation] = trace
        remember(self._steps, trace.step, operations, self._capacity)
        if self._on_put is not None:
            self._on_put(trace)

    def get(self, step: int) -> dict[str, Trace] | None:
        return self._steps.get(step)

    def steps(self) -> list[int]:
        return list(self._steps)
