"""The operator's view against a real daemon and reference engine: the Grafana dashboard's queries,
``GET /v1/steps``, ``colocd trace`` (a PNG), ``colocd top --once`` and JSON log lines.

One daemon serves the module: two full steps run once (with a trainer report of cleanup and
process-group work), then each test reads what it needs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support import EnginePool, daemon_node

from colocd.api.client import AsyncColocdClient
from colocd.cli import main as cli_main
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
TRAINER_REPORT = {
    "spans": [{"name": "cleanup.gc_collect", "duration_s": 0.004},
              {"name": "cleanup.empty_cache", "duration_s": 0.001}],
    "groups_report": {"seconds": 0.012, "action": "destroy", "kept_bytes": 0, "fallback_reason": "canary failed"},
}


async def _step(client: AsyncColocdClient, step: int, model: Any) -> None:
    await client.phase("train", step)
    await client.phase("sync", step, trainer=TRAINER_REPORT)
    await WeightPusher(client, bucket_mb=0.05, depth=2).push(model.named_parameters(), version=f"v{step}", step=step)
    await client.phase("rollout", step)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node(engine_pool: EnginePool) -> AsyncIterator[dict[str, Any]]:
    engine = engine_pool.borrow()
    try:
        async with daemon_node({"ref0": str(engine.url)}) as daemon:
            model = build_model(QwenLikeConfig(), seed=7)
            for step in (1, 2):
                await _step(daemon.client, step, model)
            yield {"url": daemon.url, "client": daemon.client, "metrics": await daemon.client.metrics()}
    finally:
        engine_pool.give_back(engine)


def _dashboard_module() -> Any:
    spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "deploy/grafana/build_dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exposed_names(exposition: str) -> set[str]:
    """Every sample name the exposition can carry: a family's own name plus its type's suffixes."""
    names: set[str] = set()
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", exposition, flags=re.M):
        if kind == "counter":  # the TYPE line names a counter with or without _total by client version
            names.add(family.removesuffix("_total") + "_total")
        else:
            names.update(family + s for s in suffixes.get(kind, ("",)))
    return names


def _query_metrics(expr: str) -> set[str]:
    # Metric names are identifiers not followed by "(" (functions) and not label names inside {...} or by (...).
    without_labels = re.sub(r"\{[^}]*\}", "", expr)
    without_groupings = re.sub(r"\b(by|on|without|ignoring)\s*\([^)]*\)", "", without_labels)
    idents = re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", without_groupings)
    keywords = {"by", "on", "without", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}
    return {i for i in idents if i not in keywords and not i.startswith("__") and not re.fullmatch(r"[0-9.e]+", i)}


async def test_every_dashboard_query_names_a_metric_the_daemon_exposes(node: dict[str, Any]) -> None:
    exposed = _exposed_names(node["metrics"])
    dashboard = _dashboard_module().build()
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(queries) > 25
    missing = {}
    for expr in queries:
        names = _query_metrics(expr.replace("$__rate_interval", "5m"))
        assert names, expr
        if unknown := {n for n in names if n not in exposed}:
            missing[expr] = sorted(unknown)
    assert not missing, missing


async def test_the_dashboard_file_is_the_builders_output() -> None:
    module = _dashboard_module()
    on_disk = json.loads((REPO / "deploy/grafana/colocd-dashboard.json").read_text())
    assert on_disk == module.build(), "run: python deploy/grafana/build_dashboard.py"


async def test_metric_name_parser_sees_through_functions_and_labels() -> None:
    expr = 'sum by (engine) (colocd_a_info{x="y"} * on (instance, gpu) group_left colocd_b_bytes{kind="used"})'
    assert _query_metrics(expr) == {"colocd_a_info", "colocd_b_bytes"}


async def test_step_metrics_record_the_breakdown_of_the_last_step(node: dict[str, Any]) -> None:
    text = node["metrics"]
    assert re.search(r"^colocd_last_step 2\.0$", text, re.M)
    assert re.search(r'^colocd_step_switch_seconds_count 2\.0$', text, re.M)
    assert re.search(r'^colocd_last_step_part_seconds\{part="groups"\} 0\.012$', text, re.M)
    assert re.search(r'^colocd_fallbacks_total\{kind="process_groups"\} 2\.0$', text, re.M)
    assert re.search(r'^colocd_weight_chunk_load_seconds_count\{engine="ref0"\} [1-9]', text, re.M)


async def test_the_weights_phase_is_observed_once_per_session_for_the_node(node: dict[str, Any]) -> None:
    text = node["metrics"]
    assert re.search(r'^colocd_phase_duration_seconds_count\{engine="all",phase="weights"\} 2\.0$', text, re.M)
    assert not re.search(r'^colocd_phase_duration_seconds_count\{engine="ref0",phase="weights"\}', text, re.M)


async def test_without_nvml_there_are_no_gpu_readings_and_the_gauge_says_so(node: dict[str, Any]) -> None:
    text = node["metrics"]
    assert re.search(r"^colocd_nvml_available 0\.0$", text, re.M)
    assert not re.search(r"^colocd_gpu_memory_(used|free|total)_bytes\{", text, re.M)
    assert re.search(r'^colocd_engine_memory_bytes\{engine="ref0",tag="weights"\} [1-9]', text, re.M)


async def test_steps_lists_recent_steps_newest_first_with_phases_breakdown_and_bytes(node: dict[str, Any]) -> None:
    steps = await node["client"].steps(5)
    assert [s["step"] for s in steps] == [2, 1]
    last = steps[0]
    assert last["result"] == "ok"
    assert [p["phase"] for p in last["phases"]] == ["train", "sync", "weights", "rollout"]
    assert all(p["duration_s"] > 0 for p in last["phases"])
    assert last["phases"][2]["result"] == "committed"
    assert last["bytes"] > 0 and last["chunks"] > 1
    assert last["breakdown"]["cleanup"] == pytest.approx(0.005)
    assert last["switch_s"] == pytest.approx(sum(last["breakdown"].values()), abs=1e-5)
    assert last["phases"][0]["freed_bytes"] > 0


async def test_steps_limit_outside_1_to_64_is_rejected(node: dict[str, Any]) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        response = await http.get(f"{node['url']}/v1/steps", params={"limit": 0})
    assert response.status_code == 422


async def test_trace_command_writes_a_png_of_the_step(node: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "step.png"
    rc = await asyncio.to_thread(cli_main, ["trace", "2", "-o", str(out), "--url", node["url"]])
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 20_000


async def test_trace_command_for_an_unknown_step_fails_with_the_daemons_message(
        node: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = await asyncio.to_thread(cli_main, ["trace", "999", "-o", str(tmp_path / "x.png"), "--url", node["url"]])
    assert rc == 1
    assert "999" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


async def test_top_once_renders_node_engines_steps_and_the_absence_of_nvml(
        node: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    rc = await asyncio.to_thread(cli_main, ["top", "--once", "--width", "160", "--url", node["url"]])
    assert rc == 0
    frame = capsys.readouterr().out
    assert "phase rollout" in frame and "step 2" in frame
    assert "ref0" in frame and "serving" in frame
    assert re.search(r"│\s*2 │ ok", frame) or re.search(r"\b2\s+.?\s*ok\b", frame), frame
    assert "NVML not available" in frame


@pytest.mark.parametrize("width", [80, 60])
async def test_top_keeps_each_header_label_on_the_line_of_its_value(
        node: dict[str, Any], capsys: pytest.CaptureFixture[str], width: int) -> None:
    rc = await asyncio.to_thread(cli_main, ["top", "--once", "--width", str(width), "--url", node["url"]])
    assert rc == 0
    frame = capsys.readouterr().out
    assert max(len(line) for line in frame.splitlines()) <= width, frame
    for pair in (r"phase rollout", r"step 2", r"daemon running", r"busy idle", r"policy \S+/\S+/\S+ v\d+"):
        assert re.search(pair, frame), f"{pair!r} is not on one line at {width} columns:\n{frame}"


async def test_json_logs_have_one_parsable_line_per_transition(engine_pool: EnginePool) -> None:
    # colocd serve, not the module's daemon: the log format is the process's (its CLI sets up logging).
    engine = engine_pool.borrow("ref1")
    try:
        async with daemon_node({"ref1": str(engine.url)}, subprocess=True, log_format="json",
                               log_level="info") as node:
            client, daemon = node.client, node.process
            await client.phase("train", 1)
            with pytest.raises(Exception):  # noqa: B017 - a rejected transition is logged too
                await client.phase("rollout", 1)
            lines = [ln for ln in daemon.log_tail(200_000).splitlines()
                     if ln.strip() and not ln.startswith("colocd listening on")]  # that one is stdout, not a log
    finally:
        engine_pool.give_back(engine)
    records = [json.loads(ln) for ln in lines]  # every log line is one JSON object
    train = [r for r in records if r.get("event") == "transition" and r.get("phase") == "train"]
    assert len(train) == 1
    assert train[0]["step"] == 1 and train[0]["result"] == "ok" and train[0]["duration_s"] > 0
    assert train[0]["bytes"] > 0 and train[0]["level"] == "info"
    assert any(r.get("event") == "transition" and r.get("result") == "rejected" for r in records)


async def test_engine_state_gauges_are_one_hot_after_a_full_step(node: dict[str, Any]) -> None:
    text = node["metrics"]
    assert re.search(r'^colocd_engine_generation_state\{engine="ref0",state="serving"\} 1\.0$', text, re.M)
    assert re.search(r'^colocd_engine_generation_state\{engine="ref0",state="paused"\} 0\.0$', text, re.M)
    weights = dict(re.findall(r'^colocd_engine_weights_state\{engine="ref0",state="(\w+)"\} ([0-9.]+)$', text, re.M))
    assert weights == {"clean": "1.0", "updating": "0.0", "stale": "0.0"}
