"""Step summaries, the log line per transition, and docs/metrics.md covering every registered metric."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest

from colocd.api.logs import JsonFormatter
from colocd.daemon.metrics import Metrics
from colocd.daemon.trace import Span, Trace, TraceStore, step_summary

DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def test_every_registered_metric_is_documented_in_metrics_md() -> None:
    text = DOC.read_text()
    documented = set(re.findall(r"`((?:colocd|process|python)_[a-z0-9_]+)`", text))
    registry = Metrics().registry
    registered = {f.name + ("_total" if f.type == "counter" else "") for f in registry.collect()}
    assert registered, "no metrics registered?"
    assert not registered - documented, sorted(registered - documented)


def _trace(phase: str, step: int, seconds: float, outcome: str, *spans: Span) -> Trace:
    trace = Trace(step, phase)
    trace.spans.extend(spans)
    trace.duration_s, trace.outcome = seconds, outcome
    return trace


def test_a_step_with_a_failed_phase_is_failed_and_names_the_error() -> None:
    failed = Span("release_memory", "ref0", 0.0, 0.2, ok=False, attrs={"error": "EngineTimeout: release"})
    summary = step_summary(4, {"train": _trace("train", 4, 0.3, "failed", failed)})
    assert summary["result"] == "failed"
    assert summary["phases"][0]["error"] == "EngineTimeout: release"
    assert summary["breakdown"]["sleep"] == pytest.approx(0.3)


def test_a_step_without_rollout_yet_is_in_progress() -> None:
    summary = step_summary(5, {"train": _trace("train", 5, 0.1, "ok"), "sync": _trace("sync", 5, 0.1, "ok")})
    assert summary["result"] == "in_progress"
    assert [p["phase"] for p in summary["phases"]] == ["train", "sync"]


def test_each_stored_trace_logs_one_line_whose_json_form_carries_the_fields(
        caplog: pytest.LogCaptureFixture) -> None:
    store = TraceStore(Metrics())
    session = _trace("weights", 2, 0.25, "committed")
    session.attrs.update(bytes=1024, chunks=3, version="v2")
    with caplog.at_level(logging.INFO, logger="colocd.events"):
        store.put(session)
    assert len(caplog.records) == 1
    line = json.loads(JsonFormatter().format(caplog.records[0]))
    assert {k: line[k] for k in ("event", "step", "phase", "result", "duration_s", "bytes", "chunks")} == {
        "event": "weight_session", "step": 2, "phase": "weights", "result": "committed", "duration_s": 0.25,
        "bytes": 1024, "chunks": 3}
    assert caplog.records[0].getMessage().startswith("event=weight_session step=2 phase=weights result=committed")


class _FakeNvml:
    """Stands in for pynvml where the machine has no GPU: two GPUs, one hides its processes."""

    class NVMLError(Exception):
        pass

    def __init__(self) -> None:
        from types import SimpleNamespace

        self._mem = {0: SimpleNamespace(used=30 << 30, free=110 << 30, total=140 << 30),
                     1: SimpleNamespace(used=1 << 30, free=139 << 30, total=140 << 30)}
        self._procs = {0: [SimpleNamespace(pid=101, usedGpuMemory=20 << 30),
                           SimpleNamespace(pid=102, usedGpuMemory=None)]}

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetUUID(self, h: int) -> str:
        return f"GPU-0000000{h}-aaaa-bbbb-cccc-ddddeeeeffff"

    def nvmlDeviceGetMemoryInfo(self, h: int) -> object:
        return self._mem[h]

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[object]:
        if h not in self._procs:
            raise self.NVMLError("Not Supported")
        return self._procs[h]


def _samples(metrics: Metrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {tuple(sorted(s.labels.items())): s.value for f in metrics.registry.collect() for s in f.samples
            if s.name == name}


def test_nvml_gauges_give_each_gpu_and_each_process_nvml_attributes_memory_to() -> None:
    from colocd.daemon.memory import NvmlProbe

    metrics = Metrics()
    metrics.set_gpus(NvmlProbe(_FakeNvml()), {"a": [0], "b": [0, 1]})
    assert _samples(metrics, "colocd_nvml_available") == {(): 1.0}
    uuid0 = ("uuid", "GPU-00000000-aaaa-bbbb-cccc-ddddeeeeffff")
    uuid1 = ("uuid", "GPU-00000001-aaaa-bbbb-cccc-ddddeeeeffff")
    # One metric per quantity, each GPU once (GPU 0 is shared by two engines), labelled by index and UUID.
    assert _samples(metrics, "colocd_gpu_memory_used_bytes") == {(("gpu", "0"), uuid0): 30 << 30,
                                                                 (("gpu", "1"), uuid1): 1 << 30}
    assert _samples(metrics, "colocd_gpu_memory_free_bytes")[(("gpu", "0"), uuid0)] == 110 << 30
    assert _samples(metrics, "colocd_gpu_memory_total_bytes")[(("gpu", "1"), uuid1)] == 140 << 30
    # pid 102's usage is hidden (None) and GPU 1 refuses the query: neither becomes a made-up number.
    assert _samples(metrics, "colocd_gpu_process_memory_bytes") == {(("gpu", "0"), ("pid", "101")): 20 << 30}
    assert set(_samples(metrics, "colocd_engine_gpu_info")) == {
        (("engine", "a"), ("gpu", "0")), (("engine", "b"), ("gpu", "0")), (("engine", "b"), ("gpu", "1"))}


def test_without_nvml_no_gpu_series_exist() -> None:
    metrics = Metrics()
    metrics.set_gpus(None, {"a": []})
    assert _samples(metrics, "colocd_nvml_available") == {(): 0.0}
    for quantity in ("used", "free", "total"):
        assert _samples(metrics, f"colocd_gpu_memory_{quantity}_bytes") == {}
    assert _samples(metrics, "colocd_gpu_process_memory_bytes") == {}


def test_every_event_counter_exists_at_zero_for_each_engine_and_label_value() -> None:
    metrics = Metrics()
    metrics.declare(["ref0", "ref1"], ["ref1"])
    text = generate_latest(metrics.registry).decode()
    for line in ('colocd_engine_restarts_total{engine="ref0"} 0.0',
                 'colocd_reconcile_actions_total{action="pause",engine="ref1"} 0.0',
                 'colocd_transitions_total{outcome="failed",phase="train"} 0.0',
                 'colocd_transitions_total{outcome="rejected",phase="rollout"} 0.0',
                 'colocd_weight_sessions_total{outcome="expired"} 0.0',
                 'colocd_engine_launch_failures_total{engine="ref1"} 0.0',
                 # histograms too: a mean over the first observations needs their 0 before them
                 'colocd_phase_duration_seconds_count{engine="ref0",phase="train"} 0.0',
                 'colocd_step_part_duration_seconds_count{part="sleep"} 0.0',
                 'colocd_trainer_substep_duration_seconds_count{substep="process_groups"} 0.0'):
        assert line in text.splitlines(), line
    assert 'colocd_engine_launches_total{engine="ref0"}' not in text  # ref0 is attached, not launched


def test_a_failed_transition_logs_one_line_naming_engine_step_phase_session_and_error(
        caplog: pytest.LogCaptureFixture) -> None:
    from colocd.daemon.trace import log_failed
    from colocd.errors import EngineUnreachable

    with caplog.at_level(logging.INFO, logger="colocd.events"):
        log_failed("train", 3, EngineUnreachable("ref0", "no answer to observe within 1s"), session="s-1")
    [record] = caplog.records
    line = json.loads(JsonFormatter().format(record))
    assert {k: line[k] for k in ("event", "engine", "step", "phase", "session", "result", "level")} == {
        "event": "transition", "engine": "ref0", "step": 3, "phase": "train", "session": "s-1",
        "result": "failed", "level": "warning"}
    assert "no answer to observe" in line["error"]


def test_a_failed_transitions_trace_is_not_logged_a_second_time(caplog: pytest.LogCaptureFixture) -> None:
    store = TraceStore(Metrics())
    with caplog.at_level(logging.INFO, logger="colocd.events"):
        store.put(_trace("train", 3, 0.2, "failed"))
    assert caplog.records == []  # Transitions.transition logs it, with the caller's error (above)


def test_weight_session_phase_time_is_observed_once_per_session() -> None:
    metrics = Metrics()
    store = TraceStore(metrics)
    store.put(_trace("weights", 2, 0.25, "committed"))
    counts = {k: v for k, v in _samples(metrics, "colocd_phase_duration_seconds_count").items() if v}
    assert counts == {(("engine", "all"), ("phase", "weights")): 1.0}
    assert _samples(metrics, "colocd_last_phase_duration_seconds") == {(("engine", "all"), ("phase", "weights")): 0.25}


def test_busy_and_the_open_sessions_idle_age_are_read_when_the_exposition_renders() -> None:
    metrics = Metrics()
    node: dict[str, Any] = {"busy": True, "idle": 12.5}
    metrics.watch_node(["ref0"], [], busy=lambda: node["busy"], session_idle_s=lambda: node["idle"])
    text = generate_latest(metrics.registry).decode().splitlines()
    assert "colocd_node_busy 1.0" in text
    assert "colocd_weight_session_open 1.0" in text and "colocd_weight_session_idle_seconds 12.5" in text
    node.update(busy=False, idle=None)  # no session open
    text = generate_latest(metrics.registry).decode().splitlines()
    assert "colocd_node_busy 0.0" in text and "colocd_weight_session_open 0.0" in text
    assert "colocd_weight_session_idle_seconds 0.0" in text


def test_the_phase_clock_restarts_only_when_the_node_moves() -> None:
    from colocd.daemon.states import NodePhase, NodeState

    metrics = Metrics()
    metrics.set_node(NodeState(NodePhase.SYNC, 4))
    entered = _samples(metrics, "colocd_node_phase_entered_timestamp_seconds")[()]
    assert entered > 0
    assert _samples(metrics, "colocd_node_phase") == {
        (("phase", "rollout"),): 0.0, (("phase", "train"),): 0.0, (("phase", "sync"),): 1.0}
    metrics.node_phase_entered.set(1.0)  # marks the value: a refresh that keeps it changed nothing
    metrics.set_node(NodeState(NodePhase.SYNC, 4))  # a new record of the same (step, phase): the clock keeps running
    assert _samples(metrics, "colocd_node_phase_entered_timestamp_seconds")[()] == 1.0
    metrics.set_node(NodeState(NodePhase.ROLLOUT, 4))
    assert _samples(metrics, "colocd_node_phase_entered_timestamp_seconds")[()] >= entered
    assert _samples(metrics, "colocd_node_step")[()] == 4.0
