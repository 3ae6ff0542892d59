"""Restarts, as a node sees them: the engine or the daemon is SIGKILLed and started again (issue 9).

A reference engine runs as its own process on loopback; the daemon runs in the test's event loop, or as
``colocd serve`` in the tests that kill the daemon itself; the trainer uses the client. Each test kills
one process at one point of a step, starts it again (the engine on the same URL, the daemon with the
same config and journal) and then runs the next step with no call made to the engine by hand. It ends
on the engine's own checksum equal to the last complete push, and no shared-memory segment or process
left behind. A prober asks the engine for greedy completions all through the fault window: every answer
must come from one complete version (the one it is labelled with), and none from a request started
after the daemon saw the restart may carry stale weights.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support import (
    DaemonNode,
    daemon_node,
    leaves_no_shm_segments,
    restartable_engine,
    served_checksums,
    weights_checksum,
)

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.daemon.journal import Journal
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

HEALTH_S = 0.5  # the daemon's health interval in these tests
DEADLINE_S = 90
PROMPT = [1, 2, 3]


def model_for(step: int) -> torch.nn.Module:
    """The trainer's weights after ``step`` (step 0: the engine's own seed)."""
    return build_model(QwenLikeConfig(), seed=step * 101)


def greedy(model: torch.nn.Module, n: int = 6) -> list[int]:
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, len(PROMPT):].tolist()


# --- the node: an engine and a daemon over it with a journal, in this event loop or as ``colocd serve`` ------

pytestmark = pytest.mark.timeout(DEADLINE_S)
TIMEOUTS = {"health_interval_s": HEALTH_S, "default_s": 20}


@pytest.fixture(autouse=True)
def _no_segment_left() -> Iterator[None]:
    with leaves_no_shm_segments():
        yield


async def until(n: DaemonNode, what: str, check: Any, timeout_s: float = 20) -> float:
    """Poll ``await check()`` until truthy; returns the seconds it took."""
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            while True:
                if await check():
                    return time.monotonic() - t0
                await asyncio.sleep(0.05)  # poll cadence, bounded by the timeout above
    except TimeoutError:
        raise AssertionError(f"not within {timeout_s}s: {what}; status {await n.client.status()}") from None


async def restart_seen(n: DaemonNode) -> bool:
    last = (await n.client.status())["reconcile"]["last"].get("ref0") or {}
    return bool(last.get("restarted")) and bool(last.get("ok"))


async def journaled(n: DaemonNode, journal: Path, step: int, phase: str) -> None:
    """Until the journal file holds (step, phase) as finished: the daemon answers a transition before its
    journal thread has written it (daemon/journal.py), and a kill in between loses it."""
    async def on_disk() -> bool:
        return any((c["step"], c["phase"]) == (step, phase) for c in Journal(journal).completed())
    await until(n, f"{phase}@{step} in the journal", on_disk)


async def full_step(client: AsyncColocdClient, step: int) -> None:
    await client.phase("train", step)
    await push(client, step)
    await client.phase("rollout", step)


async def push(client: AsyncColocdClient, step: int) -> None:
    if (await client.status())["node"]["phase"] == "train":
        await client.phase("sync", step)
    await WeightPusher(client, bucket_mb=0.05).push(model_for(step).named_parameters(), version=f"v{step}", step=step)


async def stream_half(client: AsyncColocdClient, step: int) -> str:
    """Open a session and stream the first half of the tensors: an update caught mid-stream."""
    params = list(model_for(step).named_parameters())
    session = (await client.open_session(f"v{step}", step=step, ranks=1))["session_id"]
    await WeightPusher(client, bucket_mb=0.05).stream(session, params[: len(params) // 2])
    return str(session)


@dataclass
class Prober:
    """Greedy completions from the engine, all through a fault window, with when each was asked."""

    url: str
    # (asked at, version, ids, aborted): a pause in abort mode ends a request early, with a prefix.
    answers: list[tuple[float, str, list[int], bool]] = field(default_factory=list)
    _task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        async with httpx.AsyncClient(trust_env=False, timeout=1.0) as http:
            while True:
                asked = time.monotonic()
                with contextlib.suppress(httpx.HTTPError):
                    r = await http.post(self.url + "/generate", json={
                        "input_ids": PROMPT,
                        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}})
                    if r.status_code == 200:
                        meta = r.json()["meta_info"]
                        aborted = (meta.get("finish_reason") or {}).get("type") == "abort"
                        self.answers.append((asked, meta["weight_version"], r.json()["output_ids"], aborted))
                await asyncio.sleep(0.05)  # probe cadence

    def __enter__(self) -> Prober:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    def check(self, versions: dict[str, int], *, stale_after: float, fresh: str) -> None:
        """Every answer matches the complete version it is labelled with; none asked after
        ``stale_after`` carries any version but ``fresh``."""
        expected = {v: greedy(model_for(step)) for v, step in versions.items()}
        for asked, version, ids, aborted in self.answers:
            assert version in expected, f"answer labelled {version!r}: not a complete version"
            want = expected[version][: len(ids)] if aborted else expected[version]
            assert ids == want, f"answer labelled {version!r} came from other weights"
            if asked > stale_after:
                assert version == fresh, f"answered on {version!r} after the daemon saw the restart"


# --- the engine restarts --------------------------------------------------------------------------


async def test_engine_restarted_during_train_is_released_again_and_the_next_step_needs_no_manual_call(
        tmp_path: Path) -> None:
    async with restartable_engine() as engine, daemon_node(
            {"ref0": engine.url}, journal=str(tmp_path / "journal.jsonl"), timeouts=TIMEOUTS) as n:
        await full_step(n.client, 1)
        await n.client.phase("train", 2)
        with Prober(n.engine_url) as prober:
            await engine.restart(drivable=True)  # the daemon may pause it first
            took = await until(n, "restart seen", lambda: restart_seen(n))
            seen_at = time.monotonic()
            assert await n.engine_memory() == {"weights": False, "kv_cache": False, "cuda_graph": False}
            ref0 = (await n.client.status())["engines"]["ref0"]
            assert (ref0["weights"], ref0["generation"], ref0["last_error"]) == ("stale", "paused", None)
            assert set(ref0["tags"].values()) == {"released"}
            await push(n.client, 2)
            await n.client.phase("rollout", 2)
            await until(n, "an answer on v2", lambda: _answered(prober, "v2"))
        prober.check({"default": 0, "v2": 2}, stale_after=seen_at, fresh="v2")
        assert took < HEALTH_S + 5  # one interval, plus the engine's own start on two shared cores
        print(f"engine restart during train: reconciled {took:.2f}s after the new engine answered")
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(2).named_parameters())]
        await full_step(n.client, 3)
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(3).named_parameters())]
        metrics = await n.client.metrics()
        assert 'colocd_engine_restarts_total{engine="ref0"} 1.0' in metrics
        assert 'colocd_reconcile_actions_total{action="release",engine="ref0"} 1.0' in metrics


async def test_engine_restarted_mid_stream_fails_the_session_and_a_complete_push_then_commits(
        tmp_path: Path) -> None:
    async with restartable_engine() as engine, daemon_node(
            {"ref0": engine.url}, journal=str(tmp_path / "journal.jsonl"), timeouts=TIMEOUTS) as n:
        await full_step(n.client, 1)
        await n.client.phase("train", 2)
        await n.client.phase("sync", 2)
        session = await stream_half(n.client, 2)
        with Prober(n.engine_url) as prober:
            await engine.restart(drivable=True)  # the daemon may pause it first
            await until(n, "restart seen", lambda: restart_seen(n))
            seen_at = time.monotonic()
            status = await n.client.status()
            assert status["weight_session"]["state"] != "open"
            assert status["engines"]["ref0"]["weights"] == "stale"
            # KV cache and graphs were released in 'train' and stay so; weights stay for the push.
            assert await n.engine_memory() == {"weights": True, "kv_cache": False, "cuda_graph": False}
            with pytest.raises(ColocdHTTPError) as err:
                await n.client.commit(session)
            # The session failed when the engine lost it (502 today; 409/410 once sessions say "gone").
            assert err.value.status in (409, 410, 502), err.value.body
            await push(n.client, 2)
            await n.client.phase("rollout", 2)
            await until(n, "an answer on v2", lambda: _answered(prober, "v2"))
        prober.check({"default": 0, "v2": 2}, stale_after=seen_at, fresh="v2")
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(2).named_parameters())]
        await full_step(n.client, 3)
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(3).named_parameters())]


async def test_engine_restarted_during_rollout_is_paused_until_a_complete_push_commits(tmp_path: Path) -> None:
    async with restartable_engine() as engine, daemon_node(
            {"ref0": engine.url}, journal=str(tmp_path / "journal.jsonl"), timeouts=TIMEOUTS) as n:
        await full_step(n.client, 1)
        with Prober(n.engine_url) as prober:
            await engine.restart(drivable=True)  # the daemon may pause it first
            await until(n, "restart seen", lambda: restart_seen(n))
            seen_at = time.monotonic()
            ref0 = (await n.client.status())["engines"]["ref0"]
            assert (ref0["weights"], ref0["generation"], ref0["weight_version"]) == ("stale", "paused", "default")
            assert (await n.engine_get("/server_info"))["internal_states"][0]["paused"] == "abort"
            assert (await n.client.ready()) is True  # the daemon can take the next step
            await full_step(n.client, 2)
            await until(n, "an answer on v2", lambda: _answered(prober, "v2"))
        prober.check({"v1": 1, "default": 0, "v2": 2}, stale_after=seen_at, fresh="v2")
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(2).named_parameters())]


async def _answered(prober: Prober, version: str) -> bool:
    return any(v == version for _, v, _, _ in prober.answers)


# --- the daemon restarts --------------------------------------------------------------------------


async def test_daemon_killed_mid_stream_ends_the_engines_orphaned_session_and_reports_it(tmp_path: Path) -> None:
    async with restartable_engine() as engine, daemon_node(
            {"ref0": engine.url}, subprocess=True, workdir=tmp_path, journal=str(tmp_path / "journal.jsonl"),
            timeouts=TIMEOUTS) as n:
        await full_step(n.client, 1)
        await n.client.phase("train", 2)
        await n.client.phase("sync", 2)
        await stream_half(n.client, 2)
        assert (await n.engine_get("/server_info"))["internal_states"][0]["weight_update_session"] is not None

        await journaled(n, tmp_path / "journal.jsonl", 2, "sync")
        await n.kill()
        await n.restart()
        assert (await n.engine_get("/server_info"))["internal_states"][0]["weight_update_session"] is None
        status = await n.client.status()
        assert status["node"] == {"phase": "sync", "step": 2}  # from the journal
        startup = status["reconcile"]["startup"]
        assert startup["journal_restored"] is True and startup["unreconciled"] == []
        assert startup["engines"]["ref0"]["actions"] == ["end_engine_session"]
        ref0 = status["engines"]["ref0"]
        assert (ref0["weights"], ref0["generation"], ref0["last_error"]) == ("stale", "paused", None)
        assert 'colocd_reconcile_actions_total{action="end_engine_session",engine="ref0"} 1.0' in \
            await n.client.metrics()

        await push(n.client, 2)
        await n.client.phase("rollout", 2)
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(2).named_parameters())]
        await full_step(n.client, 3)
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(3).named_parameters())]


async def test_restarted_daemon_refuses_mutating_calls_until_it_reconciled_with_its_engines(tmp_path: Path) -> None:
    async with restartable_engine() as engine, daemon_node(
            {"ref0": engine.url}, subprocess=True, workdir=tmp_path, journal=str(tmp_path / "journal.jsonl"),
            timeouts=TIMEOUTS) as n:
        await full_step(n.client, 1)
        await journaled(n, tmp_path / "journal.jsonl", 1, "rollout")
        await n.kill()
        await engine.kill()
        await n.restart(ready=False)
        with pytest.raises(ColocdHTTPError) as err:
            await n.client.phase("train", 2)
        assert err.value.status == 409, err.value.body
        assert "not yet reconciled engines ['ref0']" in err.value.body["message"]
        assert (await n.client.status())["reconcile"]["unreconciled"] == ["ref0"]

        await engine.restart(drivable=True)
        await until(n, "reconciled", lambda: _reconciled(n))
        await full_step(n.client, 2)
        assert await served_checksums(n.engine_url) == [weights_checksum(model_for(2).named_parameters())]


async def _reconciled(n: DaemonNode) -> bool:
    return (await n.client.status())["reconcile"]["unreconciled"] == []
