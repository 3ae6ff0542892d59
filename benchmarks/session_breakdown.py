"""Where one weight session's wall time goes, open → commit: the breakdown ``python3 -m benchmarks.weights`` prints.

Every figure comes from a timestamp: the trainer's own timers around its three calls (open, stream, commit), its
pusher's per-chunk timers (the join, the digests on its export thread), and the spans of the session's trace that
the commit reply carries (daemon/sessions.py: ``node_lock`` (twice: open and commit; the node's lock and the
reconcile that observes every engine), ``open_checks``, ``manifest_check``,
``begin_weight_update``, ``load_chunk``, ``drain``, ``check_complete``, ``verify`` with its ``weight_digests`` calls,
``end_weight_update`` (the version with it), ``commit_bookkeeping``, ``journal``). An engine call made on several
engines at once counts as the extent of its spans (first start → last end), a per-chunk one as the sum. The two
``outside`` rows are the trainer's round trip less the daemon's extent of the same call (both measured): the HTTP
hop, the route and the reply's encoding.

Against the round-trip floors measured in the same run (a no-op trainer → daemon request, a no-op engine request):
open and commit each make one trainer round trip and a number of engine round trips in a row (the observation
under the node lock, then each engine call whose span the trace has), and ``round_trips`` prices them at the floors,
so what open and commit cost beyond their round trips is visible.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["STAGES", "RoundTrips", "breakdown", "breakdown_table", "round_trips", "round_trips_lines"]

# (key, what): the rows, in the order they happen; nested ones are indented in the table.
STAGES: tuple[tuple[str, str], ...] = (
    ("open", "trainer: open + join -> replies"),
    ("open.daemon", "  daemon: trace start -> last open span"),
    ("open.lock", "    node lock (+ reconcile where made)"),
    ("open.checks", "    state, step, ranks, manifest parse"),
    ("open.manifest_check", "    declared manifest against them"),
    ("open.begin", "    engines' begin_weight_update"),
    ("open.outside", "  outside the daemon's open (transport, route, reply)"),
    ("open.join", "  join after it"),
    ("open.rt_floor", "  its round trips at their floors (see below)"),
    ("stream", "trainer: open's reply -> last ack"),
    ("stream.trainer_digest", "  trainer digests (export thread, overlapped)"),
    ("stream.load", "  engines' chunk loads, summed"),
    ("commit", "trainer: POST commit -> reply"),
    ("commit.daemon", "  daemon: node lock -> journal end"),
    ("commit.lock", "    node lock (+ reconcile where made)"),
    ("commit.drain", "    drain"),
    ("commit.check_complete", "    completeness"),
    ("commit.verify", "    verification"),
    ("commit.engine_digest", "      engines' weight_digests (HTTP + device)"),
    ("commit.compare", "      compare (last digests reply -> verdict)"),
    ("commit.end", "    engines' end_weight_update"),
    ("commit.bookkeeping", "    versions, records, metrics"),
    ("commit.journal", "    journal record"),
    ("commit.outside", "  outside the daemon's commit (transport, route, reply)"),
    ("commit.rt_floor", "  its round trips at their floors (see below)"),
    ("wall", "trainer: open -> commit reply"),
)
_OPEN_SPANS = ("node_lock", "open_checks", "manifest_check", "begin_weight_update")
_COMMIT_SPANS = ("node_lock", "drain", "check_complete", "verify", "weight_digests", "end_weight_update",
                 "commit_bookkeeping", "journal")


def _spans(trace: Mapping[str, Any], name: str) -> list[tuple[float, float]]:
    return [(float(s["start_s"]), float(s["start_s"]) + float(s["duration_s"]))
            for s in trace.get("spans", ()) if s.get("name") == name]


def _extent(spans: Iterable[tuple[float, float]]) -> float:
    got = list(spans)
    return max(e for _, e in got) - min(s for s, _ in got) if got else 0.0


# The engine calls of open and commit, each one round trip after the observation (one more) under the node lock.
_OPEN_CALLS = ("begin_weight_update",)
_COMMIT_CALLS = ("weight_digests", "end_weight_update")


@dataclass(frozen=True, slots=True)
class RoundTrips:
    """The no-op round trips of this run, seconds (medians): trainer → daemon, and to an engine."""

    trainer_s: float
    engine_s: float


def round_trips(trace: Mapping[str, Any]) -> dict[str, list[str]]:
    """The engine round trips open and commit made one after another: the observation the node lock makes, then
    each engine call the trace has a span of (several engines asked at once count once)."""
    names = {s.get("name") for s in trace.get("spans", ())}
    return {"open": ["observe", *(n for n in _OPEN_CALLS if n in names)],
            "commit": ["observe", *(n for n in _COMMIT_CALLS if n in names)]}


def breakdown(*, open_s: float, stream_s: float, commit_s: float, wall_s: float, trace: Mapping[str, Any],
              join_s: float = 0.0, digest_s: Sequence[float] = (),
              floors: RoundTrips | None = None) -> dict[str, float]:
    """The stages of one session in seconds (keys of ``STAGES``), from the trainer's timers and the commit's
    trace; a stage the session did not have (no verification, no manifest) is 0, and so are the round-trip
    floors without ``floors``."""
    by = {n: _spans(trace, n) for n in (*_OPEN_SPANS, *_COMMIT_SPANS, "load_chunk")}
    # The first node_lock is the open's, a second the commit's.
    locks = sorted(by.pop("node_lock"))
    open_lock, commit_lock = locks[:1], locks[1:2]
    open_spans = [s for n in _OPEN_SPANS if n != "node_lock" for s in by[n]] + open_lock
    commit_spans = [s for n in _COMMIT_SPANS if n != "node_lock" for s in by[n]] + commit_lock
    open_daemon = max((e for _, e in open_spans), default=0.0)  # the trace starts as the daemon's open does
    commit_daemon = _extent(commit_spans)
    digests_end = max((e for _, e in by["weight_digests"]), default=None)
    verify_end = max((e for _, e in by["verify"]), default=None)
    out = {
        "open": open_s,
        "open.daemon": open_daemon,
        "open.lock": _extent(open_lock),
        "open.checks": _extent(by["open_checks"]),
        "open.manifest_check": _extent(by["manifest_check"]),
        "open.begin": _extent(by["begin_weight_update"]),
        "open.outside": open_s - open_daemon - join_s,
        "open.join": join_s,
        "stream": stream_s,
        "stream.trainer_digest": sum(digest_s),
        "stream.load": sum(e - s for s, e in by["load_chunk"]),
        "commit": commit_s,
        "commit.daemon": commit_daemon,
        "commit.lock": _extent(commit_lock),
        "commit.drain": _extent(by["drain"]),
        "commit.check_complete": _extent(by["check_complete"]),
        "commit.verify": _extent(by["verify"]),
        "commit.engine_digest": _extent(by["weight_digests"]),
        "commit.compare": (verify_end - digests_end) if verify_end is not None and digests_end is not None else 0.0,
        "commit.end": _extent(by["end_weight_update"]),
        "commit.bookkeeping": _extent(by["commit_bookkeeping"]),
        "commit.journal": _extent(by["journal"]),
        "commit.outside": commit_s - commit_daemon,
        "wall": wall_s,
    }
    calls = round_trips(trace)
    for part in ("open", "commit"):
        out[f"{part}.rt_floor"] = floors.trainer_s + len(calls[part]) * floors.engine_s if floors else 0.0
    return out


def round_trips_lines(rows: Sequence[tuple[str, Mapping[str, float], Mapping[str, Sequence[str]]]],
                      floors: RoundTrips, copy_floor_s: float) -> str:
    """Per variant (name, its breakdown, its ``round_trips``): open and commit as multiples of their round trips at the
    floors, and the wall against the copy floor plus those round trips (what HTTP makes irreducible)."""
    lines = [f"round-trip floors, same run (medians): trainer -> daemon no-op {floors.trainer_s * 1e3:.3f} ms, "
             f"engine no-op {floors.engine_s * 1e3:.3f} ms"]
    for name, b, calls in rows:
        for part in ("open", "commit"):
            floor = b[f"{part}.rt_floor"]
            lines.append(f"  {name}: {part} {b[part] * 1e3:.2f} ms = {b[part] / floor:.2f}x its round trips "
                         f"(1 trainer + {len(calls[part])} engine: {', '.join(calls[part])}; {floor * 1e3:.2f} ms)")
        bound = copy_floor_s + b["open.rt_floor"] + b["commit.rt_floor"]
        lines.append(f"  {name}: wall {b['wall'] * 1e3:.2f} ms = {b['wall'] / copy_floor_s:.2f}x the copy floor, "
                     f"{b['wall'] / bound:.2f}x the copy floor + those round trips ({bound * 1e3:.2f} ms, "
                     f"{bound / copy_floor_s:.2f}x the copy floor)")
    return "\n".join(lines)


def breakdown_table(rows: Sequence[tuple[str, Mapping[str, float]]], floor_s: float) -> str:
    """One column per variant (ms), the rows of ``STAGES``, and the wall against ``floor_s``."""
    if not rows:
        return ""
    width = max(14, *(len(name) + 2 for name, _ in rows))
    lines = [f"session breakdown, best wall push, ms (floor {floor_s * 1e3:.2f} ms):",
             f"{'stage':<52}" + "".join(f"{name:>{width}}" for name, _ in rows)]
    for key, what in STAGES:
        lines.append(f"{what:<52}" + "".join(f"{1e3 * b.get(key, 0.0):>{width}.2f}" for _, b in rows))
    lines.append(f"{'wall / floor':<52}" + "".join(f"{b['wall'] / floor_s:>{width}.2f}" for _, b in rows))
    return "\n".join(lines)
