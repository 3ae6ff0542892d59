"""The operator's view under a real Prometheus (Debian's package; scripts/install-prometheus.sh), and the daemon's
JSON log as ``colocd serve`` writes it.

One real ``colocd serve`` launches the reference engine; Prometheus scrapes it every second (with the shipped alert
rules loaded) while the module drives it through two steps, a rejected transition, a failed one (the engine
SIGSTOPped), an expired weight session and an engine SIGKILLed and relaunched. Then every query of the Grafana
dashboard is evaluated through Prometheus's HTTP API. The shipped alert rules pass ``promtool check rules`` and
their own unit tests (``promtool test rules``).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import pytest_asyncio
import yaml
from support import daemon_node

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.api.procs import DaemonProcess
from colocd.engines.processes import ManagedProcess, free_port
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher, manifest_of

pytestmark = pytest.mark.asyncio(loop_scope="module")

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy/prometheus/colocd-alerts.yaml"
RULE_TESTS = REPO / "deploy/prometheus/colocd-alerts.test.yaml"
PROMETHEUS = os.environ.get("COLOCD_PROMETHEUS") or shutil.which("prometheus")
PROMTOOL = os.environ.get("COLOCD_PROMTOOL") or shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (scripts/install-prometheus.sh "
                                      "installs Debian's package; COLOCD_SKIP_PROMETHEUS=1 skipped it)")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="no promtool (scripts/install-prometheus.sh)")
# What Grafana's $__rate_interval is at a 1 s scrape interval (4 x the interval): the shortest window a panel sees.
RATE_INTERVAL = "4s"
T = TypeVar("T")


async def poll(probe: Callable[[], Awaitable[T | None]], what: str, timeout_s: float = 30.0) -> T:
    """``probe()`` until it returns a value, within a deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        if (value := await probe()) is not None:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        await _tick()


async def _tick() -> None:
    await asyncio.sleep(0.1)  # the polling cadence of poll(); every wait above has its own condition


class Prometheus:
    """A real Prometheus on a loopback port, with its own data directory, scraping ``target`` every second."""

    def __init__(self, target: str, workdir: Path) -> None:
        self.target, self.dir = target, workdir
        self.url = ""
        self.process: ManagedProcess | None = None
        self.http = httpx.AsyncClient(trust_env=False, timeout=10.0)

    async def __aenter__(self) -> Prometheus:
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
                  "rule_files": [str(RULES)],
                  "scrape_configs": [{"job_name": "colocd", "static_configs": [{"targets": [self.target]}]}]}
        (self.dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        for attempt in (1, 2):  # Prometheus takes only a port: a port taken meanwhile is retried once
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.process = ManagedProcess(
                "prometheus", [str(PROMETHEUS), f"--config.file={self.dir / 'prometheus.yml'}",
                               f"--storage.tsdb.path={self.dir / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                               "--log.level=warn"],
                {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}, label="prometheus",
                log_file=self.dir / "prometheus.log", failure=lambda proc, what: RuntimeError(
                    f"prometheus {what}: {proc.log_tail()}"))
            self.process.spawn()
            try:
                await self.process.wait_ready(self._ready, 30, setting="the test's deadline")
                return self
            except RuntimeError as exc:
                await self.process.stop(5)
                if attempt == 2 or "address already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")

    async def __aexit__(self, *exc: object) -> None:
        if self.process is not None:
            await self.process.stop(5)
        await self.http.aclose()

    async def _ready(self) -> bool | None:
        try:
            return True if (await self.http.get(f"{self.url}/-/ready")).status_code == 200 else None
        except httpx.TransportError:
            return None

    async def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query now; the result vector (``[{metric, value: [t, "v"]}]``)."""
        reply = (await self.http.get(f"{self.url}/api/v1/query", params={"query": expr})).json()
        assert reply["status"] == "success", (expr, reply)
        assert reply["data"]["resultType"] in ("vector", "scalar"), (expr, reply["data"]["resultType"])
        result = reply["data"]["result"]
        return result if isinstance(result, list) and (not result or isinstance(result[0], dict)) else [
            {"metric": {}, "value": result}]

    async def has(self, expr: str) -> list[dict[str, Any]] | None:
        return (await self.query(expr)) or None


@dataclass
class Run:
    daemon: DaemonProcess
    prometheus: Prometheus
    log_lines: list[str] = field(default_factory=list)
    rejected_status: int = 0
    failed_status: int = 0
    quiet_since: float = 0.0  # Unix time after which no step finished


def _dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expr) for every query of the dashboard."""
    spec = importlib.util.spec_from_file_location("build_dashboard", REPO / "deploy/grafana/build_dashboard.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return [(p["title"], t["expr"]) for p in module.build()["panels"] for t in p.get("targets", [])]


def _grafana(expr: str, rate_interval: str) -> str:
    """The query as Grafana sends it for one daemon: its variables filled in."""
    return expr.replace('instance=~"$instance"', 'instance=~".+"').replace("$__rate_interval", rate_interval)


async def _step(client: AsyncColocdClient, step: int, model: Any) -> None:
    report = {"spans": [{"name": "cleanup.empty_cache", "duration_s": 0.001}],
              "groups_report": {"seconds": 0.01, "action": "destroy", "kept_bytes": 0}}
    await client.phase("train", step)
    await client.phase("sync", step, trainer=report)
    await WeightPusher(client, bucket_mb=0.05, depth=2).push(model.named_parameters(), version=f"v{step}", step=step)
    await client.phase("rollout", step)


async def _engine(client: AsyncColocdClient) -> dict[str, Any]:
    return dict((await client.status())["engines"]["ref0"])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def run() -> AsyncIterator[Run]:
    if PROMETHEUS is None:
        pytest.skip("no prometheus binary (scripts/install-prometheus.sh)")
    workdir = Path(tempfile.mkdtemp(prefix="colocd-prometheus-"))
    (workdir / "daemon").mkdir()
    async with daemon_node(
            [{"kind": "reference", "name": "ref0", "device": "cpu", "seed": 0,
              "launch": {"ready_timeout_s": 120, "backoff_initial_s": 0.2}}],
            subprocess=True, workdir=workdir / "daemon", log_level="info", deadline_s=120, ready=False,
            log_format="json",
            # observe_s: a hung engine fails the next transition after 3 s (a busy 2-core CI box answers well within it)
            timeouts={"observe_s": 3.0, "health_interval_s": 0.5, "session_idle_s": 1.0}) as node, \
            Prometheus(node.url.removeprefix("http://"), workdir) as prometheus:
        daemon, client = node.process, node.client
        result = Run(daemon, prometheus)
        await client.wait_ready(60)  # Prometheus scrapes from before the node is ready
        # Scraped once before anything happens: an event counter's first sample is the 0 before its first event.
        await poll(lambda: prometheus.has('colocd_node_step{job="colocd"}'), "a first scrape")
        model = build_model(QwenLikeConfig(), seed=7)
        for step in (1, 2):
            await _step(client, step, model)
        result.quiet_since = time.time()

        with pytest.raises(ColocdHTTPError) as rejected:
            await client.phase("rollout", 9)
        result.rejected_status = rejected.value.status

        engine_pid = (await _engine(client))["launched"]["pid"]
        os.kill(engine_pid, signal.SIGSTOP)  # the engine hangs: observations time out (observe_s)
        try:
            with pytest.raises(ColocdHTTPError) as failed:
                await client.phase("train", 3)
            result.failed_status = failed.value.status
        finally:
            os.kill(engine_pid, signal.SIGCONT)
        await poll(lambda: _healthy_again(client), "the engine healthy again")

        await client.phase("train", 3)
        await client.phase("sync", 3)
        # The trainer starts a push and goes quiet (it died): no chunk within session_idle_s expires the session.
        named = list(model.named_parameters())
        opened = await client.open_session("v3", step=3, ranks=1, manifest=manifest_of(named))
        session = opened["session_id"]
        await WeightPusher(client, bucket_mb=0.05).stream(session, named[:1])
        await poll(lambda: _session_state(client, session, "expired"), "the idle session to expire")

        os.kill(engine_pid, signal.SIGKILL)  # colocd relaunches it and reconciles the new process
        await poll(lambda: _restarted(client), "the engine relaunched and reconciled", timeout_s=120)
        reconciled_at = time.time()  # its actions are counted by now; a scrape after this shows them

        # Prometheus has scraped the end state, and the last step is older than the shortest panel window.
        await poll(lambda: prometheus.has('colocd_engine_restarts_total{engine="ref0"} > 0'), "a scrape after it")
        await poll(lambda: prometheus.has('colocd_weight_sessions_total{outcome="expired"} > 0'), "the expiry scraped")
        await poll(lambda: prometheus.has(f"timestamp(colocd_node_step) > {result.quiet_since + 5}"),
                   "a scrape 5 s after the last step")
        await poll(lambda: prometheus.has(f"timestamp(colocd_node_step) > {reconciled_at}"),
                   "a scrape after the relaunched engine's reconcile")
        result.log_lines = daemon.log_path.read_text().splitlines()
        yield result


async def _healthy_again(client: AsyncColocdClient) -> bool | None:
    return True if (await _engine(client))["healthy"] else None


async def _session_state(client: AsyncColocdClient, session: str, state: str) -> bool | None:
    return True if (await client.session(session)).get("state") == state else None


async def _restarted(client: AsyncColocdClient) -> bool | None:
    status = await client.status()
    engine, last = status["engines"]["ref0"], status["reconcile"]["last"].get("ref0") or {}
    return True if (engine["launched"]["restarts"] >= 1 and engine["healthy"] and last.get("restarted")
                    and last.get("ok")) else None


# -- the dashboard under Prometheus -------------------------------------------------------------------------------
_NVML_ONLY = ("colocd_gpu_memory_", "colocd_gpu_process_memory_bytes")  # no GPU here: colocd_nvml_available 0


@needs_prometheus
async def test_every_dashboard_query_is_valid_and_non_empty_at_grafanas_shortest_window(run: Run) -> None:
    empty, checked = [], 0
    for title, expr in _dashboard_queries():
        if any(name in expr for name in _NVML_ONLY):
            continue
        checked += 1
        series = await run.prometheus.query(_grafana(expr, RATE_INTERVAL))
        # NaN (0/0: a mean over a window without an observation) is a gap in Grafana, not a value.
        if not any(math.isfinite(float(s["value"][1])) for s in series):
            empty.append((title, expr, series))
    assert checked > 30
    assert not empty, empty  # e.g. a ratio over a short window, 5 s after the last step


@needs_prometheus
async def test_the_nvml_only_panels_are_valid_promql_and_empty_without_nvml(run: Run) -> None:
    for _title, expr in _dashboard_queries():
        if any(name in expr for name in _NVML_ONLY):
            assert await run.prometheus.query(_grafana(expr, RATE_INTERVAL)) == [], expr
    assert await run.prometheus.query("colocd_nvml_available == 0")


async def _panel(run: Run, title: str, window: str = "5m") -> list[dict[str, Any]]:
    """Every series of the dashboard panel ``title`` over ``window``."""
    series = []
    for panel, expr in _dashboard_queries():
        if panel == title:
            series += await run.prometheus.query(_grafana(expr, window))
    assert series, title
    return series


def _positive(series: list[dict[str, Any]], **labels: str) -> bool:
    return any(float(s["value"][1]) > 0 and all(s["metric"].get(k) == v for k, v in labels.items()) for s in series)


@needs_prometheus
async def test_the_first_engine_restart_shows_in_the_restarts_panel(run: Run) -> None:
    assert _positive(await _panel(run, "Engine restarts and launch failures"), engine="ref0")


@needs_prometheus
async def test_the_first_failed_and_rejected_transitions_show_by_phase(run: Run) -> None:
    assert run.rejected_status == 409 and run.failed_status in (502, 503)
    transitions = await _panel(run, "Transitions by outcome")
    assert _positive(transitions, phase="rollout", outcome="rejected")
    assert _positive(transitions, phase="train", outcome="failed")


@needs_prometheus
async def test_the_first_expired_session_shows_among_the_failures(run: Run) -> None:
    assert _positive(await _panel(run, "Failures: transitions and weight sessions"), outcome="expired")


@needs_prometheus
async def test_the_reconcile_of_the_relaunched_engine_shows_its_actions(run: Run) -> None:
    assert _positive(await _panel(run, "Reconcile actions"), engine="ref0")


@needs_prometheus
async def test_node_gauges_say_phase_step_and_that_the_node_is_idle(run: Run) -> None:
    phase = await run.prometheus.query("colocd_node_phase == 1")
    assert [s["metric"]["phase"] for s in phase] == ["sync"]
    assert float((await run.prometheus.query("colocd_node_step"))[0]["value"][1]) == 3
    # The health loop holds the node for each tick's observation (every 0.5 s here), so one scrape may land inside
    # a tick; an idle node reads 0 between ticks, a node left held would read 1 at every scrape of the window.
    assert float((await run.prometheus.query("min_over_time(colocd_node_busy[10s])"))[0]["value"][1]) == 0
    assert float((await run.prometheus.query("colocd_weight_session_open"))[0]["value"][1]) == 0
    [in_phase] = await run.prometheus.query("time() - colocd_node_phase_entered_timestamp_seconds")
    assert 0 < float(in_phase["value"][1]) < 120


@needs_prometheus
async def test_process_and_build_info_series_are_scraped(run: Run) -> None:
    assert await run.prometheus.query("process_resident_memory_bytes > 0")
    [build] = await run.prometheus.query("colocd_build_info")
    assert build["metric"]["version"]


@needs_prometheus
async def test_prometheus_loads_the_shipped_alert_rules(run: Run) -> None:
    reply = (await run.prometheus.http.get(f"{run.prometheus.url}/api/v1/rules")).json()
    names = {r["name"] for g in reply["data"]["groups"] for r in g["rules"]}
    assert {"ColocdSyncStuck", "ColocdEngineCrashLooping", "ColocdWeightSessionsExpiring", "ColocdMemoryNotFreed",
            "ColocdEngineWeightsStale"} <= names


# -- the daemon's JSON log ----------------------------------------------------------------------------------------
def _records(run: Run) -> list[dict[str, Any]]:
    records = []
    for line in run.log_lines:
        record = json.loads(line)  # every line, uvicorn's and the listening line included, is one JSON object
        assert isinstance(record, dict), line
        records.append(record)
    return records


@needs_prometheus
async def test_every_line_of_the_json_log_is_one_object_and_every_event_names_engine_and_session(run: Run) -> None:
    records = _records(run)
    assert any(r.get("event") == "listening" and r["url"] == run.daemon.url for r in records)
    assert any(r["logger"].startswith("uvicorn") for r in records)
    events = [r for r in records if "event" in r]
    assert len(events) > 10
    assert all("engine" in r and "session" in r for r in events), [r for r in events if "engine" not in r][:3]
    reprs = [r["message"] for r in records if "['" in r["message"] or "{'" in r["message"]]
    assert not reprs, reprs


@needs_prometheus
async def test_the_failed_transition_logs_one_line_with_engine_step_phase_session_and_error(run: Run) -> None:
    failed = [r for r in _records(run) if r.get("event") == "transition" and r.get("result") == "failed"]
    assert len(failed) == 1, failed
    [line] = failed
    assert (line["engine"], line["step"], line["phase"], line["level"]) == ("ref0", 3, "train", "warning")
    assert "session" in line and line["error"]


@needs_prometheus
async def test_each_health_change_logs_one_line(run: Run) -> None:
    health = [r for r in _records(run) if r.get("event") == "engine_health" and r["engine"] == "ref0"]
    assert [r["healthy"] for r in health][:2] == [False, True], health
    assert all({"step", "phase", "session", "error"} <= r.keys() for r in health)
    assert health[0]["error"]


@needs_prometheus
async def test_the_relaunch_logs_exit_launch_and_reconcile_as_events(run: Run) -> None:
    events = [r["event"] for r in _records(run) if r.get("engine") == "ref0"]
    exited = events.index("engine_exited")
    assert "engine_launched" in events[exited:] and "reconcile" in events[exited:], events


async def test_the_fatal_line_is_one_json_object(tmp_path: Path) -> None:
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        config = {"listen": {"host": "127.0.0.1", "port": taken.getsockname()[1]},
                  "engines": [{"kind": "reference", "name": "ref0", "url": "http://127.0.0.1:9"}]}
        (tmp_path / "node.yaml").write_text(yaml.safe_dump(config))
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "colocd.cli", "serve", "--config", str(tmp_path / "node.yaml"),
                             "--log-format", "json"], capture_output=True, text=True, timeout=60)
    finally:
        taken.close()
    assert done.returncode == 2
    lines = done.stderr.splitlines()
    records = [json.loads(line) for line in lines]
    assert records[-1]["event"] == "fatal" and records[-1]["level"] == "critical"
    assert "cannot listen" in records[-1]["message"]


# -- the shipped alert rules ----------------------------------------------------------------------------------------
@needs_promtool
async def test_the_shipped_alert_rules_pass_promtool_check_rules() -> None:
    done = await asyncio.to_thread(subprocess.run, [str(PROMTOOL), "check", "rules", str(RULES)],
                                   capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
async def test_the_shipped_alert_rules_pass_their_unit_tests() -> None:
    done = await asyncio.to_thread(subprocess.run, [str(PROMTOOL), "test", "rules", RULE_TESTS.name],
                                   cwd=RULE_TESTS.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
