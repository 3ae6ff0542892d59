"""The pipeline plan a ``sync`` reply carries is bounded by the GPU memory free when it is made.

A real daemon and a real reference engine (on CPU), with a stand-in NVML for the one GPU they are
configured on: the GPU's used memory is the engine's own resident bytes (tests/support.py ``engine_tags``) plus
a fixed base, as if the engine were the GPU's only tenant, and the test sets how big the GPU is.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support import BASE, node_on_mirrored_gpu

pytestmark = pytest.mark.asyncio(loop_scope="module")

MIB = 1 << 20
# ~16 MB of fp32 weights: several MiB-sized chunks once the guard shrinks the buckets.
MODEL: dict[str, Any] = {"hidden_size": 256, "intermediate_size": 1024, "num_layers": 4, "num_heads": 4,
                         "num_kv_heads": 2, "head_dim": 64}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node() -> AsyncIterator[dict[str, Any]]:
    async with node_on_mirrored_gpu(MODEL) as n:
        yield n


async def _put_policy(url: str, text: str) -> None:
    async with httpx.AsyncClient(base_url=url, trust_env=False) as http:
        r = await http.put("/v1/policies", content=text)
        assert r.status_code < 300, r.text


async def test_release_confirmation_settles_on_the_bytes_the_engine_reported(node: dict[str, Any]) -> None:
    client = node["client"]
    train = await client.phase("train", 1)
    span = next(s for s in train["trace"]["spans"] if s["name"] == "confirm_memory_freed")
    assert span["attrs"]["criterion"] == "expected" and span["attrs"]["expected_from"] == "engine_report"
    assert train["freed_bytes"]["ref0"]["gpu:0"] == span["attrs"]["expected_bytes"] > 16 * MIB
    # The wait is timed in the metrics too, by the criterion that ended it.
    assert 'colocd_memory_confirm_seconds_count{criterion="expected",engine="ref0"} 1.0' in await client.metrics()


async def test_with_little_free_gpu_memory_the_sync_plan_stages_only_what_fits(node: dict[str, Any]) -> None:
    client, nvml = node["client"], node["nvml"]
    await _put_policy(node["url"], "apiVersion: colocd/v1\npipeline: {policy: overlap, depth: 2, bucket_mb: 512}\n")
    # The GPU is made just big enough for the engine's weights plus 6 MiB: once `sync` has brought the
    # weights back, 6 MiB are left for the trainer's staging buckets.
    nvml.total = BASE + nvml.tag_size("weights") + 6 * MIB
    plan = (await client.phase("sync", 1))["directives"]["pipeline"]
    assert plan["transport"] == "cuda_ipc"  # a GPU-staged transport: the guard applies
    assert (plan["depth"], plan["bucket_bytes"]) == (2, 3 * MIB)  # 512 MiB buckets would not fit
    assert "bucket shrunk to fit 2 in 6 MiB free GPU memory" in plan["reason"]
    assert "6.0 MiB free (nvml:0)" in plan["reason"]
    assert "(engine_report)" in plan["reason"]  # the sync's size came from the engine's own report
