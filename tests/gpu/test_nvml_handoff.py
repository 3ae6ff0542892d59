"""On a GPU: the daemon lets the trainer in only once NVML shows the engine's memory free, and a full
step still serves exactly the trainer's weights (reference engine on CUDA, daemon with NVML)."""

from __future__ import annotations

import pytest
import torch
from support import NvmlNode, served_checksums, weights_checksum

from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.gpu


async def test_train_waits_for_nvml_to_show_the_memory_free_and_sync_serves_the_trainers_weights(
        nvml_node: NvmlNode) -> None:
    client, model = nvml_node.client, QwenLikeConfig(**nvml_node.model)
    train = await client.phase("train", 1)
    freed = train["freed_bytes"]["gpu0"]["gpu:0"]
    weights_bytes = sum(p.numel() * p.element_size() for p in
                        build_model(model, seed=0).parameters())
    assert freed >= weights_bytes, (freed, weights_bytes)
    spans = {s["name"]: s for s in train["trace"]["spans"]}
    assert spans["confirm_memory_freed"]["attrs"]["source"] == "nvml"

    trained = build_model(model, seed=9)
    await client.phase("sync", 1)
    await WeightPusher(client, transport="inline").push(trained.named_parameters(), version="1")
    await client.phase("rollout", 1)
    assert await served_checksums(nvml_node.engine_url) == [weights_checksum(trained.named_parameters())]
    assert torch.cuda.is_available()
