"""Per-transition traces: timed spans of every sub-step, exported as JSON or Chrome trace events."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

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
    """The spans of one transition (or one weight session), relative to its start."""

    step: int
    phase: str
    started_at: float = field(default_factory=time.time)
    _t0: float = field(default_factory=time.perf_counter)
    spans: list[Span] = field(default_factory=list)

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

    def elapsed_s(self) -> float:
        return time.perf_counter() - self._t0

    def to_json(self) -> dict[str, Any]:
        return {"step": self.step, "phase": self.phase, "started_at": self.started_at,
                "spans": [s.to_json() for s in sorted(self.spans, key=lambda s: s.start_s)]}

    def to_chrome(self) -> list[dict[str, Any]]:
        """Chrome trace-event format (load in Perfetto): one complete event per span, a row per engine."""
        base_us = self.started_at * 1e6
        return [
            {"name": s.name, "ph": "X", "ts": base_us + s.start_s * 1e6, "dur": s.duration_s * 1e6,
             "pid": f"step {self.step}", "tid": s.engine or "node", "cat": self.phase,
             "args": {"ok": s.ok, **s.attrs}}
            for s in self.spans
        ]


class TraceStore:
    """The last ``capacity`` steps' traces, keyed by step then phase."""

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._steps: OrderedDict[int, dict[str, Trace]] = OrderedDict()

    def put(self, trace: Trace) -> None:
        self._steps.setdefault(trace.step, {})[trace.phase] = trace
        self._steps.move_to_end(trace.step)
        while len(self._steps) > self._capacity:
            self._steps.popitem(last=False)

    def get(self, step: int) -> dict[str, Trace] | None:
        return self._steps.get(step)

    def steps(self) -> list[int]:
        return list(self._steps)
