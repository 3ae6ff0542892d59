"""On a GPU: the daemon lets the trainer in only once NVML shows the engine's memory free, and a full
step still serves exactly the trainer's weights (reference engine on CUDA, daemon with NVML)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import torch
from support import serve_app

from colocd.api.app import create_app
from colocd.api.client import AsyncColocdClient
from colocd.daemon.config import NodeConfig
from colocd.engines.chunks import tensor_checksum
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.gpu

# ~0.4 GB of fp32 weights plus the KV pool: large enough that NVML sees the release clearly.
MODEL: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 8, "num_heads": 16,
                         "num_kv_heads": 8, "head_dim": 64, "max_position": 128}


async def test_train_waits_for_nvml_to_show_the_memory_free_and_sync_serves_the_trainers_weights() -> None:
    pytest.importorskip("pynvml")
    engine_cfg = ReferenceEngineConfig(name="gpu0", url="http://127.0.0.1:0", device="cuda:0", model=MODEL)
    async with ReferenceEngineProcess(engine_cfg) as engine:
        config = NodeConfig.model_validate({"engines": [{"kind": "reference", "name": "gpu0", "url": engine.url,
                                                         "gpus": [0]}], "timeouts": {"memory_confirm_s": 30}})
        async with serve_app(create_app(config)) as url, AsyncColocdClient(url) as client:
            await client.wait_ready(60)
            assert (await client.status())["nvml"] is True
            train = await client.phase("train", 1)
            freed = train["freed_bytes"]["gpu0"]["gpu:0"]
            weights_bytes = sum(p.numel() * p.element_size() for p in
                                build_model(QwenLikeConfig(**MODEL), seed=0).parameters())
            assert freed >= weights_bytes, (freed, weights_bytes)
            spans = {s["name"]: s for s in train["trace"]["spans"]}
            assert spans["confirm_memory_freed"]["attrs"]["source"] == "nvml"

            trained = build_model(QwenLikeConfig(**MODEL), seed=9)
            await client.phase("sync", 1)
            await WeightPusher(client, transport="shm", bucket_mb=64).push(trained.named_parameters(), version="1")
            await client.phase("rollout", 1)
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                r = await http.post(f"{engine.url}/weights_checker", json={"action": "checksum"})
            assert r.json()["colocd_checksum"] == tensor_checksum(trained.named_parameters())
            assert torch.cuda.is_available()
