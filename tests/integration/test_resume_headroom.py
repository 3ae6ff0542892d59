"""A resume that the GPU's free memory cannot hold is refused before any engine call, and the trainer
agent can post a phase while its own offload is still running, waiting for it only when refused.

A real daemon and a real reference engine (on CPU) with a stand-in NVML for the one GPU they are
configured on (``support.EngineMirrorNvml``): the GPU's used memory is the engine's own resident bytes,
plus a base, plus ``extra`` standing for what the trainer still holds; each test sets how big the GPU is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support import BASE, EngineMirrorNvml, node_on_mirrored_gpu

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer import TrainerAgent, WeightPusher

pytestmark = pytest.mark.asyncio(loop_scope="module")

MIB = 1 << 20
MODEL: dict[str, Any] = {"hidden_size": 128, "intermediate_size": 256, "num_layers": 2, "num_heads": 4,
                         "num_kv_heads": 2, "head_dim": 32}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node() -> AsyncIterator[dict[str, Any]]:
    async with node_on_mirrored_gpu(MODEL) as n:
        yield n


@pytest_asyncio.fixture(loop_scope="module")
async def in_train(node: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """The node at a fresh step in `train`, the GPU big enough for everything and the trainer holding
    nothing. Every test ends its step in `rollout`."""
    client, nvml = node["client"], node["nvml"]
    nvml.total, nvml.extra = 1 << 40, 0
    status = await client.status()
    assert status["node"]["phase"] == "rollout", status["node"]
    step = int(status["node"].get("step") or 0) + 1
    await client.phase("train", step)
    yield {**node, "step": step}


async def _push(node: dict[str, Any], step: int) -> None:
    named = list(build_model(QwenLikeConfig(**MODEL), seed=step).named_parameters())
    await WeightPusher(node["client"], bucket_mb=0.05).push(named, version=f"headroom-{step}", step=step)


def _kv_and_graph(nvml: EngineMirrorNvml) -> int:
    return nvml.tag_size("kv_cache") + nvml.tag_size("cuda_graph")


async def _to_synced(node: dict[str, Any], step: int) -> None:
    await node["client"].phase("sync", step)
    await _push(node, step)


async def _until_rejected(client: AsyncColocdClient, phase: str, before: float, deadline_s: float = 30) -> None:
    """Poll the daemon's metrics (within a deadline) until one more ``phase`` transition was rejected."""
    async with asyncio.timeout(deadline_s):
        while _rejected(await client.metrics(), phase) <= before:  # noqa: ASYNC110 (polls the daemon, bounded)
            await asyncio.sleep(0.01)


def _rejected(metrics: str, phase: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(f'colocd_transitions_total{{outcome="rejected",phase="{phase}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_a_rollout_whose_kv_cache_does_not_fit_is_refused_and_no_engine_is_touched(
        in_train: dict[str, Any]) -> None:
    client, nvml, step = in_train["client"], in_train["nvml"], in_train["step"]
    await _to_synced(in_train, step)
    # The trainer still holds memory: one MiB short of what the engine's KV cache and graphs take.
    nvml.total = BASE + nvml.tag_size("weights") + _kv_and_graph(nvml) - MIB
    with pytest.raises(ColocdHTTPError) as refused:
        await client.phase("rollout", step)
    assert refused.value.status == 409
    message = refused.value.body["message"]
    assert "GPU 0 has" in message and "engine 'ref0': kv_cache+cuda_graph" in message
    assert "from engine_report" in message and "no engine was touched" in message
    gpu = refused.value.body["state"]["headroom"]["0"]
    assert gpu["needed_bytes"] == _kv_and_graph(nvml) and gpu["free_bytes"] == gpu["needed_bytes"] - MIB
    status = await client.status()
    engine = status["engines"]["ref0"]
    assert engine["tags"]["kv_cache"] == "released" and status["node"]["phase"] == "sync"
    # The trainer frees the memory: the same call goes through.
    nvml.total += MIB
    await client.phase("rollout", step)
    assert (await client.status())["engines"]["ref0"]["tags"]["kv_cache"] == "resident"


async def test_the_headroom_is_added_to_what_the_engine_needs(in_train: dict[str, Any]) -> None:
    client, nvml, url, step = in_train["client"], in_train["nvml"], in_train["url"], in_train["step"]
    await _to_synced(in_train, step)
    nvml.total = BASE + nvml.tag_size("weights") + _kv_and_graph(nvml) + 4 * MIB  # 4 MiB to spare
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        put = await http.put("/v1/policies", content="apiVersion: colocd/v1\nengines: {resume_headroom_mb: 8}\n")
        assert put.status_code < 300, put.text
        try:
            with pytest.raises(ColocdHTTPError) as refused:
                await client.phase("rollout", step)
            assert "+ 0.01 GiB headroom" in refused.value.body["message"]
            assert refused.value.body["state"]["headroom"]["0"]["headroom_bytes"] == 8 * MIB
        finally:
            await http.put("/v1/policies", content="apiVersion: colocd/v1\n")
    await client.phase("rollout", step)  # the staged default (no headroom) is in force for the next transition


async def test_a_sync_whose_weights_do_not_fit_is_refused_before_the_resume(in_train: dict[str, Any]) -> None:
    client, nvml, step = in_train["client"], in_train["nvml"], in_train["step"]
    nvml.total = BASE + nvml.tag_size("weights") - 1
    with pytest.raises(ColocdHTTPError) as refused:
        await client.phase("sync", step)
    assert refused.value.status == 409 and "engine 'ref0': weights" in refused.value.body["message"]
    assert (await client.status())["engines"]["ref0"]["tags"]["weights"] == "released"
    nvml.total = 1 << 40
    await _to_synced(in_train, step)
    await client.phase("rollout", step)


async def test_the_agent_posts_the_rollout_early_and_waits_for_its_offload_only_when_refused(
        in_train: dict[str, Any]) -> None:
    client, nvml, step = in_train["client"], in_train["nvml"], in_train["step"]
    await _to_synced(in_train, step)
    nvml.total = BASE + nvml.tag_size("weights") + _kv_and_graph(nvml) + 64 * MIB
    nvml.extra = 128 * MIB  # the trainer's weights, still on the GPU while they offload
    offloaded = asyncio.Event()

    async def offload() -> None:
        await offloaded.wait()
        nvml.extra = 0

    agent = TrainerAgent(client)
    before = _rejected(await client.metrics(), "rollout")
    freeing = asyncio.ensure_future(offload())
    rollout = asyncio.ensure_future(agent.rollout(step, freeing=freeing))
    await _until_rejected(client, "rollout", before)  # posted at once, and refused: the 128 MiB are in the way
    assert not rollout.done()  # now it waits for the offload
    offloaded.set()
    await asyncio.wait_for(rollout, 30)
    room = agent.last_reports["rollout_room"]
    assert room["early"] is False and "GPU 0 has" in room["refused"]


async def test_the_agent_rollout_goes_through_while_the_offload_runs_when_it_fits(
        in_train: dict[str, Any]) -> None:
    client, nvml, step = in_train["client"], in_train["nvml"], in_train["step"]
    await _to_synced(in_train, step)
    nvml.extra = 128 * MIB  # still held, but the GPU is big enough for both
    never = asyncio.Event()
    freeing = asyncio.ensure_future(never.wait())
    try:
        await asyncio.wait_for(TrainerAgent(client).rollout(step, freeing=freeing), 30)
        assert not freeing.done()  # the rollout did not wait for the offload
    finally:
        freeing.cancel()
    assert (await client.status())["node"]["phase"] == "rollout"

