"""Launching SGLang: the command and environment colocation needs, and the process lifecycle.

SGLang cannot run here, so ``sglang_command`` is checked as a pure function and ``launch_sglang``
(readiness under a deadline, logs, SIGTERM then SIGKILL, early exit) runs a stand-in HTTP server
process on loopback in SGLang's place.
"""

from __future__ import annotations

import logging
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from colocd.engines.config import LaunchConfig, SGLangEngineConfig
from colocd.engines.processes import free_port, strip_expandable_segments
from colocd.engines.sglang import launcher
from colocd.engines.sglang.launcher import launch_sglang, sglang_command
from colocd.errors import EngineLaunchError


def engine(**overrides: Any) -> SGLangEngineConfig:
    launch = overrides.pop("launch", {})
    data: dict[str, Any] = {
        "name": "sgl0",
        "model_path": "/models/qwen",
        "launch": LaunchConfig(**launch),
        **overrides,
    }
    return SGLangEngineConfig(**data)


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


# --- the command ---------------------------------------------------------------------------------


def test_command_has_the_flags_colocation_needs() -> None:
    argv, env = sglang_command(engine(tp_size=2), 31000, python="/venv/bin/python", environ={})
    assert argv[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert flag(argv, "--model-path") == "/models/qwen"
    assert flag(argv, "--host") == "127.0.0.1"
    assert flag(argv, "--port") == "31000"
    assert flag(argv, "--tp-size") == "2"
    assert "--enable-memory-saver" in argv
    assert flag(argv, "--weight-cache-mode") == "off"
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in env and "NCCL_GRAPH_REGISTER" not in env


def test_cuda_graph_ownership_sets_both_environment_variables() -> None:
    _, env = sglang_command(engine(memory_saver_cuda_graph=True), 1, environ={})
    assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"
    assert env["NCCL_GRAPH_REGISTER"] == "0"


def test_an_inherited_cuda_graph_setting_is_dropped_when_the_config_says_no() -> None:
    _, env = sglang_command(engine(), 1, environ={"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1", "HOME": "/root"})
    assert "SGLANG_MEMORY_SAVER_CUDA_GRAPH" not in env and env["HOME"] == "/root"


@pytest.mark.parametrize(
    ("value", "expected", "removed"),
    [
        ("expandable_segments:True", "", True),
        ("max_split_size_mb:128,expandable_segments:True", "max_split_size_mb:128", True),
        (
            "expandable_segments:true, garbage_collection_threshold:0.6",
            "garbage_collection_threshold:0.6",
            True,
        ),
        ("expandable_segments:False", "expandable_segments:False", False),
        ("max_split_size_mb:64", "max_split_size_mb:64", False),
    ],
)
def test_expandable_segments_are_stripped(value: str, expected: str, removed: bool) -> None:
    assert strip_expandable_segments(value) == (expected, removed)


def test_expandable_segments_are_removed_from_the_engine_environment_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    environ = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:128"}
    config = engine(launch={"env": {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}})
    with caplog.at_level(logging.WARNING, logger=launcher.__name__):
        _, env = sglang_command(config, 1, environ=environ)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"
    assert "PYTORCH_ALLOC_CONF" not in env
    assert sum("expandable_segments" in r.getMessage() for r in caplog.records) == 2


def test_gpus_become_cuda_visible_devices_uuids_first() -> None:
    _, env = sglang_command(engine(tp_size=2, gpus=[3, 5]), 1, environ={})
    assert env["CUDA_VISIBLE_DEVICES"] == "3,5"
    _, env = sglang_command(engine(gpus=[0], gpu_uuids=["GPU-aaaa"]), 1, environ={})
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-aaaa"


def test_extra_args_and_env_are_passed_through() -> None:
    config = engine(
        launch={"args": ["--enable-weights-cpu-backup", "--mem-fraction-static=0.7"], "env": {"X": "1"}}
    )
    argv, env = sglang_command(config, 1, environ={})
    assert argv[-2:] == ["--enable-weights-cpu-backup", "--mem-fraction-static=0.7"]
    assert env["X"] == "1"


def test_api_key_becomes_the_servers_key() -> None:
    argv, _ = sglang_command(engine(api_key="s3cret"), 1, environ={})
    assert flag(argv, "--api-key") == "s3cret"


def test_weight_cache_flag_is_left_out_for_versions_without_it() -> None:
    argv, _ = sglang_command(engine(), 1, environ={}, sglang_version="0.5.9")
    assert "--weight-cache-mode" not in argv
    argv, _ = sglang_command(engine(), 1, environ={}, sglang_version="0.5.23")
    assert flag(argv, "--weight-cache-mode") == "off"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"launch": {"args": ["--port", "1"]}}, "--port"),
        ({"launch": {"args": ["--tp=4"]}}, "--tp"),
        ({"launch": {"args": ["--model", "x"]}}, "model_path"),
        ({"launch": {"args": ["--weight-cache-mode", "daemon"]}}, "disables weight updates"),
        ({"launch": {"args": ["--dp-size", "2"]}}, "one SGLang server per DP replica"),
        ({"launch": {"env": {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}}}, "set memory_saver_cuda_graph"),
        (
            {"memory_saver_cuda_graph": True, "launch": {"env": {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "0"}}},
            "contradicts",
        ),
        ({"tp_size": 2, "gpus": [0]}, "one GPU per TP rank"),
        ({"gpus": [1], "launch": {"env": {"CUDA_VISIBLE_DEVICES": "2"}}}, "differs from the configured GPUs"),
        ({"model_path": None}, "model_path"),
    ],
)
def test_settings_that_break_colocation_are_refused_by_name(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(EngineLaunchError, match=message):
        sglang_command(engine(**overrides), 1, environ={})


def test_an_attach_only_engine_has_no_command() -> None:
    config = SGLangEngineConfig(name="sgl0", url="http://127.0.0.1:30000")
    with pytest.raises(EngineLaunchError, match="attaches"):
        sglang_command(config, 1, environ={})


# --- the process ---------------------------------------------------------------------------------

_STAND_IN = textwrap.dedent(
    """
    import http.server, signal, sys, time
    port, not_ready, ignore_term = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "1"
    if ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    seen = {"n": 0}
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            seen["n"] += 1
            self.send_response(503 if seen["n"] <= not_ready else 200)
            self.end_headers()
        def log_message(self, *a):
            print("health", *a, flush=True)
    print("stand-in up", flush=True)
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
    """
)


StandIn = Callable[..., SGLangEngineConfig]


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> StandIn:
    """The config of an engine whose launch runs a stand-in HTTP server in place of ``python -m
    sglang.launch_server`` (the same config path: the command is built, then its argv replaced), answering
    ``/health`` 503 ``not_ready`` times, then 200; ``argv`` replaces it with another command."""
    script = tmp_path / "stand_in.py"
    script.write_text(_STAND_IN)
    real = launcher.sglang_command

    def config(*, not_ready: int = 2, ignore_term: bool = False, argv: list[str] | None = None,
               extra: tuple[str, ...] = (), **overrides: Any) -> SGLangEngineConfig:
        def command(config: SGLangEngineConfig, port: int, **kw: Any) -> tuple[list[str], dict[str, str]]:
            _, env = real(config, port, **kw)
            return argv or [sys.executable, str(script), str(port), str(not_ready), "1" if ignore_term else "0",
                            *extra], env

        monkeypatch.setattr(launcher, "sglang_command", command)
        launch = {"ready_timeout_s": 20, "log_file": str(tmp_path / "sgl0.log"), **overrides.pop("launch", {})}
        return engine(launch=launch, **overrides)

    return config


async def test_server_is_ready_once_health_answers_200_and_stops_cleanly(stand_in: StandIn, tmp_path: Path) -> None:
    log = tmp_path / "logs" / "sgl0.log"
    launched = await launch_sglang(stand_in(launch={"log_file": str(log)}))
    async with httpx.AsyncClient(trust_env=False) as client:
        assert (await client.get(f"{launched.url}/health")).status_code == 200
    assert await launched.process.stop(grace_s=10) is not None
    text = log.read_text()
    assert "# colocd:" in text and "stand-in up" in text and "health" in text


async def test_a_server_ignoring_sigterm_is_killed_after_the_grace(stand_in: StandIn) -> None:
    launched = await launch_sglang(stand_in(not_ready=0, ignore_term=True))
    assert await launched.process.stop(grace_s=0.5) == -9


async def test_an_early_exit_is_reported_with_the_log_tail(stand_in: StandIn) -> None:
    argv = [sys.executable, "-c", "import sys; print('CUDA out of memory', flush=True); sys.exit(3)"]
    with pytest.raises(EngineLaunchError, match="exited with code 3") as info:
        await launch_sglang(stand_in(argv=argv))
    assert "CUDA out of memory" in str(info.value)


async def test_readiness_has_a_deadline_that_names_the_setting(stand_in: StandIn) -> None:
    with pytest.raises(EngineLaunchError, match="ready_timeout_s"):
        await launch_sglang(stand_in(not_ready=10**6, launch={"ready_timeout_s": 1.0}))


async def test_launch_runs_the_command_on_the_configured_port(stand_in: StandIn) -> None:
    port = free_port()
    launched = await launch_sglang(stand_in(not_ready=1, url=f"http://127.0.0.1:{port}"))
    try:
        assert launched.url == f"http://127.0.0.1:{port}"
    finally:
        await launched.process.stop(grace_s=5)


async def test_the_logged_command_hides_the_api_key(stand_in: StandIn, tmp_path: Path) -> None:
    launched = await launch_sglang(stand_in(not_ready=0, extra=("--api-key", "s3cret")))
    await launched.process.stop(grace_s=5)
    log = tmp_path / "sgl0.log"
    assert "s3cret" not in log.read_text() and "--api-key '***'" in log.read_text()
    assert log.stat().st_mode & 0o777 == 0o600


async def test_a_launched_server_only_listens_on_loopback() -> None:
    with pytest.raises(EngineLaunchError, match=r"127\.0\.0\.1"):
        await launch_sglang(engine(url="http://10.0.0.5:30000"))


def test_launcher_exports_are_sorted_and_complete() -> None:
    # ruff RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical.
    assert launcher.__all__ == sorted(
        launcher.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n)
    )
    assert all(hasattr(launcher, n) for n in launcher.__all__)
