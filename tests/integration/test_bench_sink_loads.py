"""A benchmark sink on CPU loads ``flattened_bucket`` chunks (the ``inline`` transport) by its plans, push after push.

Real processes: a reference engine holding ``tiny`` sink tensors, an in-process daemon, this process the trainer.
Each push carries fresh values; what the engine holds must be what the trainer sent, byte for byte.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import torch
from support import daemon_node, reference_engine

from benchmarks.sink import device_checksum, hf_shapes
from benchmarks.sink_engine import sink_launch
from colocd.api.client import AsyncColocdClient
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node() -> AsyncIterator[tuple[AsyncColocdClient, str]]:
    async with (reference_engine(device="cpu", launch=sink_launch("tiny")) as engine,
                daemon_node({"ref0": str(engine.url)}, synced_at=1) as daemon):
        yield daemon.client, str(engine.url)


async def _held(engine_url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        return (await http.get(f"{engine_url}/colocd/sink")).raise_for_status().json()  # type: ignore[no-any-return]


async def test_inline_buckets_land_byte_identical_in_the_sink_push_after_push(
    node: tuple[AsyncColocdClient, str],
) -> None:
    client, engine_url = node
    gen = torch.Generator().manual_seed(0)
    named = [(n, torch.empty(s, dtype=torch.bfloat16)) for n, s in hf_shapes("tiny")]
    async with WeightPusher(client, transport="inline", bucket_mb=1, depth=2) as pusher:
        for version in ("v1", "v2", "v3"):  # the second and third reuse the first push's plans
            for _, t in named:
                t.copy_(torch.randn(t.shape, generator=gen))
            report = await pusher.push(named, version=version)
            assert report.chunks > 1
            held = await _held(engine_url)
            assert [held["checksums"][n] for n, _ in named] == device_checksum(t for _, t in named)
