"""A real ``colocd serve`` SIGKILLed and started again on its journal drives the engine it launched.

Real processes only: ``colocd serve`` as a child (``daemon_node(subprocess=True)``, SIGKILLed and
restarted), the reference engine as its child (its own process group), the trainer on the client. The
engine processes of one test are found by a marker in their environment, so "one engine per config
entry" is counted on the machine, not taken from status.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from support import DaemonNode, daemon_node, served_checksums, weights_checksum

from colocd.api.client import AsyncColocdClient
from colocd.engines.processes import free_port, process_start_time
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

DEADLINE_S = 90.0


def model_for(step: int) -> torch.nn.Module:
    return build_model(QwenLikeConfig(), seed=step * 101)


def node_config(tmp_path: Path, *, url: str | None = None, **launch: Any) -> dict[str, Any]:
    engine: dict[str, Any] = {"kind": "reference", "name": "ref0", "device": "cpu", "seed": 0,
                              "launch": {"ready_timeout_s": 120, "backoff_initial_s": 0.2, "backoff_max_s": 1,
                                         "stop_grace_s": 2, "env": {"COLOCD_TEST_NODE": str(tmp_path)},
                                         **launch}}
    if url is not None:
        engine["url"] = url
    return {"engines": [engine], "journal": str(tmp_path / "journal.jsonl"),
            "timeouts": {"health_interval_s": 0.5, "default_s": 20}}


def engines_of(tmp_path: Path) -> set[int]:
    """Pids of the reference engines started for this test's node (found by their environment)."""
    marker = f"COLOCD_TEST_NODE={tmp_path}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError):
            if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0") and \
                    b"colocd.engines.reference" in Path(f"/proc/{entry}/cmdline").read_bytes():
                found.add(int(entry))
    return found


@pytest.fixture
def node_dir(tmp_path: Path) -> Iterator[Path]:
    """The node's directory; whatever engine of this node outlives a failed test is killed at teardown."""
    yield tmp_path
    for pid in engines_of(tmp_path):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


@asynccontextmanager
async def serve(tmp_path: Path, config: dict[str, Any]) -> AsyncIterator[DaemonNode]:
    """``colocd serve`` on ``config``, ready; ``kill()`` and ``restart()`` it on the same journal."""
    async with asyncio.timeout(DEADLINE_S), daemon_node(
            config["engines"], subprocess=True, workdir=tmp_path,
            **{k: v for k, v in config.items() if k != "engines"}) as node:
        yield node


async def push(client: AsyncColocdClient, step: int) -> None:
    await WeightPusher(client, bucket_mb=0.05).push(model_for(step).named_parameters(), version=f"v{step}", step=step)


async def full_step(client: AsyncColocdClient, step: int) -> None:
    await client.phase("train", step)
    await client.phase("sync", step)
    await push(client, step)
    await client.phase("rollout", step)


async def stream_half(client: AsyncColocdClient, step: int) -> None:
    params = list(model_for(step).named_parameters())
    session = (await client.open_session(f"v{step}", step=step, ranks=1))["session_id"]
    await WeightPusher(client, bucket_mb=0.05).stream(session, params[: len(params) // 2])


async def gone(pids: set[int], timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while any(process_start_time(p) is not None for p in pids):  # a zombie counts as gone
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)  # polling for another process's exit, bounded by the deadline
    return True


async def test_a_daemon_sigkilled_mid_push_adopts_its_engine_reconciles_it_and_the_next_push_verifies(
        node_dir: Path) -> None:
    tmp_path = node_dir
    config = node_config(tmp_path)
    async with serve(tmp_path, config) as node:
        await full_step(node.client, 1)
        await node.client.phase("train", 2)
        await node.client.phase("sync", 2)
        await stream_half(node.client, 2)  # the engine has an update open, half the tensors in
        engine = (await node.client.status())["engines"]["ref0"]["launched"]
        await node.kill()
        assert engines_of(tmp_path) == {engine["pid"]}  # the engine outlived its daemon

        await node.restart()
        client = node.client
        assert engines_of(tmp_path) == {engine["pid"]}  # adopted: no second engine beside it
        status = await client.status()
        ref0 = status["engines"]["ref0"]
        assert ref0["launched"]["adopted"] is True and ref0["launched"]["pid"] == engine["pid"]
        assert ref0["launched"]["url"] == engine["url"]
        # Reconciled like any engine the daemon lost sight of: the update it left open is ended, weights stale.
        assert status["reconcile"]["startup"]["engines"]["ref0"]["actions"] == ["end_engine_session"]
        assert (ref0["weights"], ref0["generation"]) == ("stale", "paused")
        replay = await client.phase("sync", 2)  # finished before the crash: replayed, not refused
        assert replay["replayed"] is True

        await push(client, 2)
        await client.phase("rollout", 2)
        assert await served_checksums(engine["url"]) == [weights_checksum(model_for(2).named_parameters())]
        await full_step(client, 3)
        assert await served_checksums(engine["url"]) == [weights_checksum(model_for(3).named_parameters())]
    assert await gone({engine["pid"]}) and engines_of(tmp_path) == set()  # the adopter stopped it on SIGTERM


async def test_with_a_fixed_port_an_engine_that_no_longer_answers_is_stopped_and_one_is_launched_there(
        node_dir: Path) -> None:
    tmp_path = node_dir
    url = f"http://127.0.0.1:{free_port()}"
    config = node_config(tmp_path, url=url)
    async with serve(tmp_path, config) as node:
        await full_step(node.client, 1)
        old = int((await node.client.status())["engines"]["ref0"]["launched"]["pid"])
        await node.kill()
        os.kill(old, signal.SIGSTOP)  # alive, its port held, but it answers nothing: not adoptable
        try:
            await node.restart()
            client = node.client
            assert await gone({old})  # its process group was stopped before the new engine was launched
            ref0 = (await client.status())["engines"]["ref0"]
            assert ref0["launched"]["adopted"] is False and ref0["launched"]["url"] == url
            assert engines_of(tmp_path) == {ref0["launched"]["pid"]}
            assert (ref0["weights"], ref0["generation"]) == ("stale", "paused")
            await full_step(client, 2)
            assert await served_checksums(url) == [weights_checksum(model_for(2).named_parameters())]
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(old, signal.SIGKILL)
