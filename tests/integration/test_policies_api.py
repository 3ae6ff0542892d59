"""Policy hot swap through the daemon: PUT/GET /v1/policies, boundaries, metrics, the file on SIGHUP."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from support import InMemoryEngine, daemon_node, in_process_daemon

from colocd.daemon.states import NodePhase
from colocd.engines.base import MemoryTag, Observation, PauseMode, ReleaseReport
from colocd.policies import Budget, Transport

KEEP_ALIVE = "apiVersion: colocd/v1\nprocess_groups:\n  policy: keep_alive\npipeline:\n  policy: serial\n"
BAD_FIELD = "apiVersion: colocd/v1\npipeline:\n  policy: overlap\n  depht: 3\n"


class GatedEngine(InMemoryEngine):
    """An in-memory engine whose release waits on a gate: lets a test act while a transition is mid-way.
    (A real engine cannot be held mid-call on demand; the daemon under test is the real one.)"""

    transports = frozenset({Transport.SHM, Transport.DISK})
    incarnation = "gated"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.pause_modes: list[str] = []

    async def pause_generation(self, mode: PauseMode) -> None:
        self.pause_modes.append(mode.value)

    async def release_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        self.entered.set()
        await self.gate.wait()
        return ReleaseReport(tags)


@pytest.fixture
async def served() -> AsyncIterator[tuple[str, GatedEngine]]:
    engine = GatedEngine("e0")
    async with daemon_node(adapters={"e0": engine}) as node:
        yield node.url, engine


async def test_invalid_policy_is_400_with_line_and_column_and_the_old_policy_stays(
        served: tuple[str, GatedEngine]) -> None:
    url, _ = served
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        before = (await http.get("/v1/policies")).json()
        r = await http.put("/v1/policies", content=BAD_FIELD)
        assert r.status_code == 400
        body = r.json()
        assert "depht" in body["message"] and body["line"] == 4
        after = (await http.get("/v1/policies")).json()
        assert after["fingerprint"] == before["fingerprint"] and after["pending"] is None


async def test_swap_staged_during_a_transition_takes_effect_at_the_next_one(
        served: tuple[str, GatedEngine]) -> None:
    url, engine = served
    engine.gate.clear()
    async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http:
        train = asyncio.create_task(http.post("/v1/phase", json={"phase": "train", "step": 1}))
        await asyncio.wait_for(engine.entered.wait(), 10)
        staged = await http.put("/v1/policies", content=KEEP_ALIVE)
        assert staged.json()["applies"] == "at the next transition"
        engine.gate.set()
        during = (await train).json()
        assert during["directives"]["process_groups"]["policy"] == "deferred_cooldown"  # the old one
        assert (await http.get("/v1/policies")).json()["process_groups"] == "deferred_cooldown"

        sync = (await http.post("/v1/phase", json={"phase": "sync", "step": 1})).json()
        assert sync["directives"]["policy"]["process_groups"] == "keep_alive"
        assert sync["directives"]["pipeline"]["depth"] == 1  # serial
        status = (await http.get("/v1/status")).json()
        assert status["policy"]["process_groups"] == "keep_alive" and status["policy"]["version"] == "2"
        metrics = (await http.get("/metrics")).text
        assert 'colocd_policy_info{' in metrics and 'process_groups="keep_alive"' in metrics


async def test_policy_document_sets_the_pause_mode() -> None:
    engine = GatedEngine("e0")
    async with in_process_daemon({"e0": engine}) as daemon:
        daemon.policies.apply_yaml("apiVersion: colocd/v1\nengines:\n  pause_mode: in_place\n", source="test")
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
    assert engine.pause_modes == ["in_place"]


async def test_a_document_that_leaves_out_the_pause_mode_and_timeouts_keeps_the_node_configs() -> None:
    engine = GatedEngine("e0")
    async with in_process_daemon({"e0": engine}, pause_mode="abort",
                                 timeouts={"chunk_s": 7, "health_interval_s": 2}) as daemon:
        daemon.policies.apply_yaml("apiVersion: colocd/v1\ntimeouts:\n  chunk_s: 3\n", source="test")
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
        timeouts = daemon.policies.active.timeouts
        assert (timeouts.budget(Budget.CHUNK), timeouts.budget(Budget.HEALTH_INTERVAL)) == (3, 2)
    assert engine.pause_modes == ["abort"]


async def test_policy_file_is_loaded_at_start_and_reloaded_on_request(tmp_path: Any) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(KEEP_ALIVE)
    async with in_process_daemon({"e0": GatedEngine("e0")}, policy_file=str(path)) as daemon:
        assert daemon.policies.active.info()["process_groups"] == "keep_alive"
        path.write_text("apiVersion: colocd/v1\nprocess_groups:\n  policy: destroy\n")
        daemon.policies.reload_file()  # what SIGHUP calls
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
        assert daemon.policies.active.info()["process_groups"] == "destroy"
        path.write_text(BAD_FIELD)
        assert daemon.policies.reload_file() is None  # logged; the running policy stays
        assert daemon.policies.active.info()["process_groups"] == "destroy"


async def test_train_directive_reflects_the_trainers_group_snapshot() -> None:
    async with in_process_daemon({"e0": GatedEngine("e0")}) as daemon:
        daemon.policies.apply_yaml(
            "apiVersion: colocd/v1\nprocess_groups:\n  policy: auto\n  max_resident_gib: 1\n", source="test")
        result = await daemon.transitions.transition(
            NodePhase.TRAIN, 1, {"groups": {"group_count": 14, "resident_bytes": 7 * 2**30}})
    directive = result.directives["process_groups"]
    assert directive["action"] == "destroy"  # 7 GiB kept would exceed the 1 GiB budget
    assert result.directives["cleanup"]["policy"] == "empty_cache"


async def test_the_sync_reply_shapes_the_weight_pusher(served: tuple[str, GatedEngine]) -> None:
    from colocd.api.client import AsyncColocdClient
    from colocd.trainer.push import WeightPusher

    url, _ = served
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        await http.put("/v1/policies", content="apiVersion: colocd/v1\npipeline:\n  policy: overlap\n  depth: 3\n"
                                               "  bucket_mb: 8\n  transport: shm\n")
    async with AsyncColocdClient(url) as client:
        await client.phase("train", 1)
        plan = (await client.phase("sync", 1))["directives"]["pipeline"]
        assert (plan["depth"], plan["bucket_bytes"], plan["transport"]) == (3, 8 << 20, "shm")
        pusher = WeightPusher.from_plan(client, plan)
        assert (pusher._depth, pusher._bucket_bytes, pusher._transport) == (3, 8 << 20, "shm")


class StoppableEngine(GatedEngine):
    """A GatedEngine that can be stopped: from then on every observation fails as a dead engine's would."""

    stopped = False

    async def observe(self) -> Observation:
        if self.stopped:
            from colocd.errors import EngineUnreachable
            raise EngineUnreachable(self.name, "connection refused")
        return await super().observe()


async def _until(condition: Any, what: str) -> None:
    """Poll ``condition`` (daemon state) until it holds; ``what`` names it when the deadline passes."""
    try:
        async with asyncio.timeout(10):
            while not condition():  # noqa: ASYNC110 - the daemon's state, polled with a deadline
                await asyncio.sleep(0.05)
    except TimeoutError:
        raise AssertionError(f"not within 10 s: {what}") from None


@pytest.mark.parametrize("bad", [b"apiVersion: colocd/v1\n\x00\n", b"apiVersion: colocd/v1\x07\n",
                                 b"apiVersion: colocd/v1\npipeline: {policy: \x1b[31moverlap}\n"],
                         ids=["NUL", "BEL", "ESC"])
async def test_a_live_reload_of_a_file_with_a_control_character_keeps_the_health_loop_and_reloads(
        tmp_path: Any, bad: bytes, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "policies.yaml"
    path.write_text(KEEP_ALIVE)
    engine = StoppableEngine("e0")
    async with in_process_daemon({"e0": engine}, policy_file=str(path), timeouts={"health_interval_s": 0.05}) as daemon:
        path.write_bytes(bad)
        await _until(lambda: any("not applied" in r.getMessage() and "U+00" in r.getMessage()
                                 for r in caplog.records), "the bad file was read")
        engine.stopped = True
        await _until(lambda: not daemon.ready()[0], "the stopped engine reads unhealthy")
        path.write_text("apiVersion: colocd/v1\nprocess_groups:\n  policy: destroy\n")
        await _until(lambda: daemon.policies.store.pending is not None, "the good edit is staged")
        pending = daemon.policies.store.pending
        assert pending is not None and pending.info()["process_groups"] == "destroy"
        assert daemon.policies.active.info()["process_groups"] == "keep_alive"  # the bad file changed nothing
