"""``colocd serve`` launches its own engines (``launch:``): start, relaunch after a death, stop, deadline.

Real processes: ``colocd serve`` as a child, the reference engine as its child (in its own process
group), the trainer on the client; the relaunch spec runs the daemon in the test's event loop (the
engine's process is under test there, not the daemon's). Nothing here starts or stops an engine by hand except
the SIGKILL that stands for a crash; every wait is a poll under a deadline.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from support import daemon_node, leaves_no_shm_segments, served_checksums, weights_checksum

from colocd.api.client import AsyncColocdClient
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "reference-launch.yaml"
HEALTH_S = 0.5
DEADLINE_S = 90.0


def model_for(step: int) -> torch.nn.Module:
    """The trainer's weights after ``step``."""
    return build_model(QwenLikeConfig(), seed=step * 101)


def example_config(**overrides: Any) -> dict[str, Any]:
    """deploy/examples/reference-launch.yaml as shipped, on an OS-chosen port (DaemonProcess sets it)."""
    config: dict[str, Any] = yaml.safe_load(EXAMPLE.read_text())
    config.pop("listen")
    return {**config, **overrides}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


async def until(what: str, check: Any, client: AsyncColocdClient, timeout_s: float = 60) -> None:
    try:
        async with asyncio.timeout(timeout_s):
            while not await check():  # noqa: ASYNC110 (polls another process, bounded by the timeout)
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}; status {await client.status()}") from None


pytestmark = pytest.mark.timeout(DEADLINE_S)


@pytest.fixture(autouse=True)
def _no_segment_left() -> Iterator[None]:
    with leaves_no_shm_segments():
        yield


async def launched(client: AsyncColocdClient) -> dict[str, Any]:
    info: dict[str, Any] = (await client.status())["engines"]["ref0"]["launched"]
    return info


async def full_step(client: AsyncColocdClient, step: int) -> None:
    await client.phase("train", step)
    await client.phase("sync", step)
    await WeightPusher(client, bucket_mb=0.05).push(model_for(step).named_parameters(), version=f"v{step}", step=step)
    await client.phase("rollout", step)


async def test_colocd_serve_alone_brings_up_a_cpu_node_and_sigterm_stops_its_engine(tmp_path: Path) -> None:
    async with daemon_node(**example_config(), subprocess=True, workdir=tmp_path) as node:
        daemon, client = node.process, node.client
        engine = await launched(client)
        assert engine["state"] == "running" and engine["launches"] == 1 and engine["restarts"] == 0
        pid, url = int(engine["pid"]), str(engine["url"])
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0")
        assert alive(pid) and os.getpgid(pid) == pid  # its own process group, not the daemon's
        await full_step(client, 1)
        assert await served_checksums(url) == [weights_checksum(model_for(1).named_parameters())]
        assert 'colocd_engine_launches_total{engine="ref0"} 1.0' in await client.metrics()
        assert daemon.process is not None
        # SIGTERM, and it exits in the grace (uvicorn re-raises the signal once it has shut down), not SIGKILL.
        assert await daemon.process.stop(grace_s=30) in (0, -signal.SIGTERM)
    assert not alive(pid) and not group_alive(pid)  # the daemon stopped the engine it launched


async def test_a_launched_engine_that_dies_is_relaunched_reconciled_and_the_next_step_needs_no_manual_call(
        tmp_path: Path) -> None:
    config = example_config(timeouts={"health_interval_s": HEALTH_S, "default_s": 20})
    config["engines"][0]["launch"].update(backoff_initial_s=0.2, backoff_max_s=1)
    # The daemon in this event loop: the engine's death and relaunch are under test, not the daemon's process.
    async with daemon_node(**config) as node:
        client = node.client
        await full_step(client, 1)
        first = await launched(client)
        os.kill(int(first["pid"]), signal.SIGKILL)  # the crash

        async def relaunched_and_reconciled() -> bool:
            status = await client.status()
            last = status["reconcile"]["last"].get("ref0") or {}
            return bool(status["engines"]["ref0"]["launched"]["restarts"] == 1 and last.get("restarted")
                        and last.get("ok"))

        await until("relaunched and reconciled", relaunched_and_reconciled, client)
        status = await client.status()
        ref0 = status["engines"]["ref0"]
        # Exactly as for an engine restarted by someone else: paused, stale until a complete push commits.
        assert (ref0["weights"], ref0["generation"], ref0["healthy"]) == ("stale", "paused", True)
        again = ref0["launched"]
        assert again["state"] == "running" and again["url"] == first["url"] and again["pid"] != first["pid"]
        assert again["last_exit_code"] == -signal.SIGKILL and again["launches"] == 2
        assert not alive(int(first["pid"]))
        metrics = await client.metrics()
        assert 'colocd_engine_launches_total{engine="ref0"} 2.0' in metrics
        assert 'colocd_engine_restarts_total{engine="ref0"} 1.0' in metrics
        assert await client.ready() is True

        await full_step(client, 2)  # no call to the engine, no call to colocd beyond the step itself
        assert await served_checksums(str(again["url"])) == [weights_checksum(model_for(2).named_parameters())]
        ref0 = (await client.status())["engines"]["ref0"]
        assert (ref0["weights"], ref0["generation"], ref0["weight_version"]) == ("clean", "serving", "v2")
    assert not alive(int(again["pid"]))


async def test_a_tethered_daemon_killed_outright_takes_the_engines_it_launched_with_it(tmp_path: Path) -> None:
    """The cluster actor's case: nobody gets to stop anything, the kernel does (engines/tether.py).

    The engine is in its own process group and its parent is the daemon, so only its own tether
    (``COLOCD_TETHER=1`` in the daemon's environment) can reach it once the daemon is SIGKILLed.
    """
    async with daemon_node(**example_config(), subprocess=True, workdir=tmp_path, tether=True) as node:
        daemon, client = node.process, node.client
        engine = int((await launched(client))["pid"])
        assert alive(engine) and os.getpgid(engine) == engine  # still its own group, tether or not
        assert daemon.pid is not None
        os.kill(daemon.pid, signal.SIGKILL)  # no SIGTERM handler runs: nothing stops the engine but the kernel
        deadline = time.monotonic() + 30
        while group_alive(engine):
            assert time.monotonic() < deadline, f"engine {engine} outlived its daemon by 30s"
            await asyncio.sleep(0.05)  # polling for the kernel's kill, bounded by the deadline


async def test_a_launch_that_is_never_ready_fails_serve_with_one_line_naming_the_engine(tmp_path: Path) -> None:
    config = example_config()
    config["engines"][0]["launch"]["ready_timeout_s"] = 0.5  # the engine imports torch: never this fast
    path = tmp_path / "node.yaml"
    path.write_text(yaml.safe_dump({**config, "listen": {"host": "127.0.0.1", "port": 0}}))
    started = time.monotonic()
    out = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "colocd.cli", "serve", "--config", str(path),
                         "--log-level", "warning"],
        capture_output=True, text=True, timeout=DEADLINE_S)
    assert out.returncode == 1, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert re.fullmatch(r"colocd: engine 'ref0': reference engine \(pid \d+\) was not ready within 0\.5s "
                        r"\(launch\.ready_timeout_s\); log \S+\.log", lines[0]), lines[0]
    assert time.monotonic() - started < 60
    pid = int(re.search(r"pid (\d+)", lines[0]).group(1))  # type: ignore[union-attr]
    assert not alive(pid) and not group_alive(pid)  # stopped, not left behind
    assert "colocd listening" not in out.stdout
