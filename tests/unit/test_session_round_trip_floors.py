"""The session breakdown prices open and commit at the same run's round-trip floors (benchmarks/session_breakdown.py):
one trainer round trip each, plus the observation and every engine call the commit's trace has a span of."""

from __future__ import annotations

import pytest

from benchmarks.session_breakdown import RoundTrips, breakdown, round_trips, round_trips_lines


def _trace(*names: str) -> dict[str, object]:
    return {"spans": [{"name": n, "start_s": 0.01 * i, "duration_s": 0.001} for i, n in enumerate(names)]}


def test_open_and_commit_count_the_observation_and_each_engine_call_in_a_row() -> None:
    trace = _trace("node_lock", "begin_weight_update", "begin_weight_update", "load_chunk", "node_lock",
                   "end_weight_update")
    assert round_trips(trace) == {"open": ["observe", "begin_weight_update"],
                                  "commit": ["observe", "end_weight_update"]}
    verified = _trace("node_lock", "parameter_manifest", "begin_weight_update", "node_lock", "weight_digests",
                      "end_weight_update")
    assert [len(v) for v in round_trips(verified).values()] == [3, 3]


def test_the_floors_price_each_round_trip_and_the_lines_say_the_multiples() -> None:
    trace = _trace("node_lock", "begin_weight_update", "node_lock", "weight_digests", "end_weight_update")
    floors = RoundTrips(trainer_s=0.001, engine_s=0.002)
    b = breakdown(open_s=0.010, stream_s=0.020, commit_s=0.014, wall_s=0.044, trace=trace, floors=floors)
    assert b["open.rt_floor"] == pytest.approx(0.001 + 2 * 0.002)
    assert b["commit.rt_floor"] == pytest.approx(0.001 + 3 * 0.002)
    text = round_trips_lines([("v", b, round_trips(trace))], floors, copy_floor_s=0.010)
    assert "open 10.00 ms = 2.00x its round trips (1 trainer + 2 engine" in text
    assert "commit 14.00 ms = 2.00x its round trips (1 trainer + 3 engine" in text
    assert "4.40x the copy floor" in text
    assert breakdown(open_s=1, stream_s=1, commit_s=1, wall_s=3, trace=trace)["open.rt_floor"] == 0.0

