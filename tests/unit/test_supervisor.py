"""The process supervisor every launcher uses, and the daemon's relaunch-with-backoff, on real processes.

The children are small Python scripts (no engine, no torch): one announces itself in a ready file
and sleeps, another spawns a grandchild, another ignores SIGTERM. The daemon side
(``EngineSupervision``) is driven with a launcher that starts such a script, so start-up,
relaunch, backoff and shutdown are checked in well under a second each.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from colocd.daemon.journal import Journal
from colocd.daemon.metrics import Metrics
from colocd.daemon.supervision import Backoff, EngineSupervision, LaunchState
from colocd.engines.config import LaunchConfig, ReferenceEngineConfig
from colocd.engines.processes import (
    Launched,
    LaunchOptions,
    ManagedProcess,
    free_port,
    group_alive,
    read_ready_file,
)
from colocd.errors import EngineLaunchError

DEADLINE_S = 20.0

# argv: ready_file ("-" for none), exit_code_or_"sleep", ignore_term (0/1), grandchild_pid_file ("-" for none)
_CHILD = textwrap.dedent(
    """
    import json, os, signal, subprocess, sys, time
    ready, mode, ignore_term, grandchild = sys.argv[1:5]
    if ignore_term == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("child up", os.getpid(), flush=True)
    if grandchild != "-":
        g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(grandchild + ".tmp", "w") as f:
            f.write(str(g.pid))
        os.replace(grandchild + ".tmp", grandchild)
    if mode != "sleep":
        sys.exit(int(mode))
    if ready != "-":
        with open(ready + ".tmp", "w") as f:
            json.dump({"url": "http://127.0.0.1:1", "pid": os.getpid()}, f)
        os.replace(ready + ".tmp", ready)
    time.sleep(600)
    """
)


def child(tmp_path: Path, *, ready: Path | None = None, mode: str = "sleep", ignore_term: bool = False,
          grandchild: Path | None = None, extra: tuple[str, ...] = ()) -> list[str]:
    script = tmp_path / "child.py"
    script.write_text(_CHILD)
    return [sys.executable, str(script), str(ready or "-"), mode, "1" if ignore_term else "0",
            str(grandchild or "-"), *extra]


def ready_probe(path: Path) -> Any:
    async def probe() -> str | None:
        return read_ready_file(path)

    return probe


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


async def until(predicate: Any, what: str, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)  # poll cadence, bounded by the deadline


# --- ManagedProcess ------------------------------------------------------------------------------


async def test_a_child_is_ready_when_its_probe_answers_and_stop_ends_its_whole_group(tmp_path: Path) -> None:
    ready, grandchild = tmp_path / "ready.json", tmp_path / "grandchild.pid"
    proc = ManagedProcess("c0", child(tmp_path, ready=ready, grandchild=grandchild), dict(os.environ),
                          label="test child", log_file=tmp_path / "c0.log")
    proc.spawn()
    assert await proc.wait_ready(ready_probe(ready), DEADLINE_S) == "http://127.0.0.1:1"
    assert proc.pid is not None and os.getpgid(proc.pid) == proc.pid  # its own process group
    grandchild_pid = int(grandchild.read_text())
    assert await proc.stop(grace_s=5) == -signal.SIGTERM
    assert not group_alive(proc.pid) and pid_gone(grandchild_pid)  # the grandchild went with it
    assert await proc.stop() == -signal.SIGTERM  # idempotent
    assert "child up" in (tmp_path / "c0.log").read_text()


async def test_an_early_exit_fails_readiness_at_once_with_the_log_tail(tmp_path: Path) -> None:
    proc = ManagedProcess("c0", child(tmp_path, mode="3"), dict(os.environ), label="test child")
    proc.spawn()
    started = time.monotonic()
    with pytest.raises(EngineLaunchError, match="exited with code 3 before it was ready") as info:
        await proc.wait_ready(ready_probe(tmp_path / "never.json"), 60)
    assert time.monotonic() - started < 10  # the exit was noticed, not the deadline
    assert info.value.engine == "c0" and "child up" in str(info.value)
    assert "\n" not in info.value.summary and str(proc.log_path) in info.value.summary
    assert await proc.wait_exit() == 3


async def test_readiness_has_a_deadline_that_names_the_setting_and_leaves_the_child_to_the_caller(
        tmp_path: Path) -> None:
    proc = ManagedProcess("c0", child(tmp_path), dict(os.environ), label="test child")
    proc.spawn()
    with pytest.raises(EngineLaunchError, match=r"was not ready within 0\.3s \(launch\.ready_timeout_s\)"):
        await proc.wait_ready(ready_probe(tmp_path / "never.json"), 0.3)
    assert proc.running
    await proc.stop(grace_s=5)
    assert not proc.running


async def test_a_child_ignoring_sigterm_is_killed_after_the_grace(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = ManagedProcess("c0", child(tmp_path, ready=ready, ignore_term=True), dict(os.environ))
    proc.spawn()
    await proc.wait_ready(ready_probe(ready), DEADLINE_S)
    started = time.monotonic()
    assert await proc.stop(grace_s=0.3) == -signal.SIGKILL
    assert time.monotonic() - started < 10


def test_the_blocking_stop_stops_a_child_from_outside_any_event_loop(tmp_path: Path) -> None:
    ready = tmp_path / "ready.json"
    proc = ManagedProcess("c0", child(tmp_path, ready=ready), dict(os.environ))
    proc.spawn()
    assert asyncio.run(proc.wait_ready(ready_probe(ready), DEADLINE_S)) == "http://127.0.0.1:1"
    assert proc.stop_sync(grace_s=5) == -signal.SIGTERM
    assert proc.pid is not None and not group_alive(proc.pid)


async def test_the_log_is_private_and_its_command_line_hides_the_api_key(tmp_path: Path) -> None:
    log = tmp_path / "logs" / "c0.log"
    proc = ManagedProcess("c0", child(tmp_path, mode="0", extra=("--api-key", "s3cret")), dict(os.environ),
                          log_file=log)
    proc.spawn()
    assert await proc.wait_exit() == 0
    text = log.read_text()
    assert "# colocd:" in text and "s3cret" not in text and "--api-key '***'" in text
    assert log.stat().st_mode & 0o777 == 0o600


def test_a_command_that_cannot_start_is_a_launch_error_naming_it(tmp_path: Path) -> None:
    proc = ManagedProcess("c0", [str(tmp_path / "no-such-binary")], {}, label="test child")
    with pytest.raises(EngineLaunchError, match=r"engine 'c0': test child .* could not be started"):
        proc.spawn()


def test_free_port_is_bindable() -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))


# --- backoff -------------------------------------------------------------------------------------


def test_backoff_doubles_per_consecutive_failure_up_to_its_bound() -> None:
    backoff = Backoff(initial_s=1.0, max_s=10.0, reset_after_s=60.0)
    assert [backoff.delay(n) for n in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_a_run_that_stayed_up_resets_the_backoff() -> None:
    backoff = Backoff(initial_s=1.0, max_s=10.0, reset_after_s=60.0)
    assert backoff.counts_as_failure(None)  # never became ready
    assert backoff.counts_as_failure(5.0)  # died soon after
    assert not backoff.counts_as_failure(61.0)


def test_backoff_bounds_are_checked_in_the_config() -> None:
    with pytest.raises(ValueError, match="backoff_max_s"):
        LaunchConfig(backoff_initial_s=5, backoff_max_s=1)


def test_an_engine_with_neither_url_nor_launch_is_a_config_error_naming_it() -> None:
    with pytest.raises(ValueError, match="engine 'ref9': set 'url' \\(attach\\) or 'launch'"):
        ReferenceEngineConfig(name="ref9")


# --- EngineSupervision (the daemon side) ---------------------------------------------------------


class ScriptLauncher:
    """Launches the child script for an engine config, ready when its ready file appears."""

    def __init__(self, tmp_path: Path, *, fail: set[str] | None = None) -> None:
        self.tmp_path = tmp_path
        self.fail = fail or set()
        self.configs: list[Any] = []
        self.options: list[LaunchOptions] = []
        self.processes: list[ManagedProcess] = []

    async def __call__(self, config: Any, options: LaunchOptions) -> Launched:
        self.configs.append(config)
        self.options.append(options)
        n = len(self.configs)
        ready = self.tmp_path / f"ready-{config.name}-{n}.json"
        mode = "4" if config.name in self.fail else "sleep"
        proc = ManagedProcess(config.name, child(self.tmp_path, ready=ready, mode=mode), dict(os.environ),
                              label="test engine", log_file=config.launch.log_file, on_spawn=options.on_spawn)
        proc.spawn()
        self.processes.append(proc)
        try:
            await proc.wait_ready(ready_probe(ready), config.launch.ready_timeout_s)
        except BaseException:
            await proc.stop(1)
            raise
        return Launched(str(config.url), proc)


def launch_config(name: str, **launch: Any) -> ReferenceEngineConfig:
    settings = {"ready_timeout_s": DEADLINE_S, "backoff_initial_s": 0.05, "backoff_max_s": 0.2, "stop_grace_s": 2,
                **launch}
    return ReferenceEngineConfig(name=name, launch=LaunchConfig(**settings))


def counter(metrics: Metrics, name: str, engine: str) -> float:
    value = metrics.registry.get_sample_value(name, {"engine": engine})
    return float(value or 0.0)


async def test_launched_engines_get_a_derived_url_and_one_log_and_attached_ones_are_left_alone(
        tmp_path: Path) -> None:
    attached = ReferenceEngineConfig(name="ext", url="http://127.0.0.1:30000")
    launcher = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a"), attached], Metrics(), launcher=launcher)
    await supervision.start()
    try:
        by_name = {c.name: c for c in supervision.configs()}
        assert by_name["ext"] is attached and "ext" not in supervision.launched
        url = by_name["a"].url
        assert url is not None and url.startswith("http://127.0.0.1:") and not url.endswith(":0")
        snap = supervision.launched["a"].snapshot()
        assert snap is not None and snap["state"] == "running" and snap["pid"] == launcher.processes[0].pid
        assert snap["log"] == by_name["a"].launch.log_file
    finally:
        await supervision.aclose()
    assert not group_alive(launcher.processes[0].pid or 0)


async def test_a_dead_engine_is_relaunched_on_the_same_url_and_the_daemon_is_told(tmp_path: Path) -> None:
    metrics = Metrics()
    launcher = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a")], metrics, launcher=launcher)
    relaunched: list[str] = []

    async def on_relaunch(name: str) -> None:
        relaunched.append(name)

    await supervision.start()
    supervision.supervise(on_relaunch)
    try:
        first = launcher.processes[0]
        os.kill(first.pid or 0, signal.SIGKILL)
        await until(lambda: relaunched == ["a"], "the relaunch reported")
        engine = supervision.launched["a"]
        assert engine.state is LaunchState.RUNNING and engine.restarts == 1 and engine.last_exit == -9
        assert launcher.configs[1].url == launcher.configs[0].url  # the adapter's URL still holds
        assert engine.process is launcher.processes[1] and engine.process.running
        assert counter(metrics, "colocd_engine_launches_total", "a") == 2
        log = Path(launcher.configs[0].launch.log_file).read_text()  # noqa: ASYNC240 (a test's small file)
        assert log.count("# colocd:") == 2  # both runs in the one log
    finally:
        await supervision.aclose()
    assert not group_alive(launcher.processes[1].pid or 0)


async def test_relaunches_back_off_while_the_engine_keeps_failing(tmp_path: Path) -> None:
    metrics = Metrics()
    launcher = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a", backoff_initial_s=0.1, backoff_max_s=0.4)], metrics,
                                    launcher=launcher)
    await supervision.start()

    async def ignore(name: str) -> None:
        return None

    supervision.supervise(ignore)
    try:
        launcher.fail.add("a")  # from now on every launch exits before it is ready
        os.kill(launcher.processes[0].pid or 0, signal.SIGKILL)
        await until(lambda: supervision.launched["a"].failures >= 4, "four failures in a row")
        engine = supervision.launched["a"]
        assert engine.state in (LaunchState.BACKOFF, LaunchState.STARTING)
        assert "exited with code 4" in (engine.last_error or "")
        assert counter(metrics, "colocd_engine_launch_failures_total", "a") >= 3
        # Launch times: the gaps grow (0.1, 0.2, 0.4, 0.4 s) instead of a busy loop.
        starts = [p.started_at or 0.0 for p in launcher.processes]
        gaps = [b - a for a, b in itertools.pairwise(starts[1:])]
        assert gaps and min(gaps) >= 0.15
        launcher.fail.clear()  # the cause is fixed: the next relaunch succeeds and stays up
        await until(lambda: engine.state is LaunchState.RUNNING, "a successful relaunch")
        assert engine.restarts == 1
    finally:
        await supervision.aclose()
    assert all(not p.running for p in launcher.processes)


async def test_shutdown_stops_engines_without_relaunching_them(tmp_path: Path) -> None:
    launcher = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a"), launch_config("b")], Metrics(), launcher=launcher)
    await supervision.start()

    async def ignore(name: str) -> None:
        return None

    supervision.supervise(ignore)
    await supervision.aclose()
    assert len(launcher.processes) == 2 and all(not group_alive(p.pid or 0) for p in launcher.processes)
    assert {e.state for e in supervision.launched.values()} == {LaunchState.STOPPED}


async def test_one_engine_failing_to_start_stops_the_others_and_names_it(tmp_path: Path) -> None:
    launcher = ScriptLauncher(tmp_path, fail={"bad"})
    supervision = EngineSupervision([launch_config("good"), launch_config("bad")], Metrics(), launcher=launcher)
    with pytest.raises(EngineLaunchError, match=r"engine 'bad': test engine .* exited with code 4"):
        await supervision.start()
    assert all(not p.running for p in launcher.processes)
    await supervision.aclose()


def test_the_example_launch_config_is_valid() -> None:
    from colocd.daemon.config import load_node_config

    config = load_node_config(Path(__file__).resolve().parents[2] / "deploy" / "examples" / "reference-launch.yaml")
    (engine,) = config.engines
    assert engine.kind == "reference" and engine.url is None and engine.launch is not None
    json.dumps(engine.model_dump())


# --- adoption: a daemon started again on its journal ----------------------------------------------


def answering(url: str) -> Any:
    async def answers(_url: str) -> bool:
        return True

    return answers


async def never_answers(url: str) -> bool:
    return False


async def first_daemon(tmp_path: Path, journal: Path, **launch: Any) -> tuple[EngineSupervision, ScriptLauncher]:
    """A daemon's supervision that launched engine 'a' and then died (it is never closed, only abandoned)."""
    launcher = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a", **launch)], Metrics(), launcher=launcher,
                                    journal=Journal(journal))
    await supervision.start()
    assert supervision._journal is not None
    await supervision._journal.drain()
    # Stands for init, which reaps an orphan: here the engine stays this process's child.
    reaper = asyncio.get_running_loop().create_task(launcher.processes[0].wait_exit())
    supervision._watchers.add(reaper)  # type: ignore[arg-type]
    return supervision, launcher


async def test_a_restarted_daemon_adopts_the_engine_its_journal_names_instead_of_launching_another(
        tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    dead, first = await first_daemon(tmp_path, journal)
    pid = first.processes[0].pid
    assert pid is not None
    again = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a")], Metrics(), launcher=again, journal=Journal(journal),
                                    answers=answering(""))
    await supervision.start()
    try:
        assert again.configs == []  # nothing launched: the running engine is the one
        snap = supervision.launched["a"].snapshot()
        assert snap is not None and (snap["state"], snap["pid"], snap["adopted"]) == ("running", pid, True)
        assert supervision.configs()[0].url == dead.configs()[0].url  # where the adapter finds it
    finally:
        await supervision.aclose()
    assert not group_alive(pid)  # the adopter stops it on shutdown, as its own
    assert Journal(journal).launches() == {}  # and says so: nothing left to adopt
    await dead.aclose()


async def test_a_recorded_engine_that_does_not_answer_is_stopped_with_its_group_before_another_is_launched(
        tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    dead, first = await first_daemon(tmp_path, journal)
    old = first.processes[0].pid
    assert old is not None
    again = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a")], Metrics(), launcher=again, journal=Journal(journal),
                                    answers=never_answers)
    await supervision.start()
    try:
        assert not group_alive(old)  # gone before the new one started: never two engines for one entry
        assert len(again.processes) == 1 and again.processes[0].running
        snap = supervision.launched["a"].snapshot()
        assert snap is not None and snap["adopted"] is False and snap["pid"] == again.processes[0].pid
        assert Journal(journal).launches()["a"].pid == again.processes[0].pid
    finally:
        await supervision.aclose()
        await dead.aclose()


async def test_status_never_shows_a_dead_pid_while_the_engine_is_relaunched(tmp_path: Path) -> None:
    launcher = ScriptLauncher(tmp_path)
    supervision = EngineSupervision([launch_config("a", backoff_initial_s=0.5, backoff_max_s=0.5)], Metrics(),
                                    launcher=launcher)
    await supervision.start()

    async def ignore(name: str) -> None:
        return None

    supervision.supervise(ignore)
    try:
        dead = launcher.processes[0].pid
        os.kill(dead or 0, signal.SIGKILL)
        engine = supervision.launched["a"]
        await until(lambda: engine.state is LaunchState.BACKOFF, "the backoff")
        snap = supervision.launched["a"].snapshot()
        assert snap is not None and snap["pid"] is None
        assert engine.unready_reason() is not None and "backoff" in engine.unready_reason()  # type: ignore[operator]
        await until(lambda: engine.state is LaunchState.STARTING or engine.restarts == 1, "the relaunch started")
        await until(lambda: len(launcher.processes) == 2, "the new process")
        snap = supervision.launched["a"].snapshot()
        assert snap is not None and snap["pid"] in (launcher.processes[1].pid, None) and snap["pid"] != dead
    finally:
        await supervision.aclose()
