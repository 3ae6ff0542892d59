"""The trainer-side cleanup mechanism enacting each plan: spans, timing, bytes, bounded retries."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict

import torch

from colocd.policies import (
    AggressiveCleanupPolicy,
    CleanupAction,
    CleanupPlan,
    EmptyCachePolicy,
    NoCleanupPolicy,
)
from colocd.trainer.cleanup import run_cleanup

GIB = 1 << 30
CPU = torch.device("cpu")


def test_aggressive_on_cpu_runs_each_step_once_and_says_bytes_are_unmeasurable() -> None:
    calls: list[str] = []
    report = run_cleanup(AggressiveCleanupPolicy().plan(), device=CPU, collect=lambda: calls.append("gc"))
    assert calls == ["gc"]
    assert [s["name"] for s in report.spans] == [
        "cleanup.gc_collect",
        "cleanup.synchronize",
        "cleanup.empty_cache",
    ]
    assert all(s["freed_bytes"] is None for s in report.spans)
    assert report.freed_bytes is None and "no CUDA" in report.memory_note
    assert report.rounds == 1


def test_spans_are_timed_and_ordered() -> None:
    report = run_cleanup(AggressiveCleanupPolicy().plan(), device=CPU)
    starts = [s["start_s"] for s in report.spans]
    assert starts == sorted(starts)
    assert all(s["duration_s"] >= 0 for s in report.spans)
    assert report.seconds >= sum(s["duration_s"] for s in report.spans)
    assert {"name", "round", "start_s", "duration_s", "freed_bytes"} <= set(report.spans[0])


def _meter(levels: list[int]) -> Iterator[int]:
    yield from levels


def test_aggressive_retries_while_a_round_frees_a_gib_and_stops_after_max_retries() -> None:
    held = [20 * GIB]

    def collect() -> None:
        held[0] -= 2 * GIB  # every round frees 2 GiB: it would go on forever without the bound

    report = run_cleanup(AggressiveCleanupPolicy().plan(), device=CPU, collect=collect, meter=lambda: held[0])
    assert report.rounds == 4  # the first round plus max_retries=3
    assert report.freed_bytes == 8 * GIB
    assert [s["freed_bytes"] for s in report.spans if s["name"] == "cleanup.gc_collect"] == [2 * GIB] * 4


def test_aggressive_stops_as_soon_as_a_round_frees_less_than_the_threshold() -> None:
    frees = iter([3 * GIB, GIB // 2, 5 * GIB])
    held = [20 * GIB]

    def collect() -> None:
        held[0] -= next(frees)

    report = run_cleanup(AggressiveCleanupPolicy().plan(), device=CPU, collect=collect, meter=lambda: held[0])
    assert report.rounds == 2
    assert report.freed_bytes == 3 * GIB + GIB // 2


def test_empty_cache_is_one_step_and_none_is_nothing() -> None:
    assert [s["name"] for s in run_cleanup(EmptyCachePolicy().plan(), device=CPU).spans] == [
        "cleanup.empty_cache"
    ]
    report = run_cleanup(NoCleanupPolicy().plan(), device=CPU)
    assert (report.spans, report.rounds) == ([], 0)


def test_report_serialises() -> None:
    plan = CleanupPlan(policy="x", steps=(CleanupAction.GC_COLLECT,))
    d = asdict(run_cleanup(plan, device=CPU))
    assert d["policy"] == "x" and isinstance(d["spans"], list)
