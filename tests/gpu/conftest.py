"""Shared GPU fixtures: a reference engine on cuda:0 behind a daemon that confirms releases through NVML, and
the tiny checkpoint's tensors on cuda:0. Requested only by tests marked ``gpu``, which skip without CUDA."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import NvmlNode, serve_app

from colocd.api.app import create_app
from colocd.api.client import AsyncColocdClient
from colocd.daemon.config import NodeConfig
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.sink import hf_shapes

# ~0.4 GB of fp32 weights plus the KV pool: large enough that NVML sees a release clearly.
NVML_MODEL: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 8, "num_heads": 16,
                              "num_kv_heads": 8, "head_dim": 64, "max_position": 128}


@pytest_asyncio.fixture
async def nvml_node() -> AsyncIterator[NvmlNode]:
    """Engine ``gpu0`` on cuda:0 and a daemon configured with GPU 0, so every release is confirmed by NVML."""
    pytest.importorskip("pynvml")
    engine_cfg = ReferenceEngineConfig(name="gpu0", url="http://127.0.0.1:0", device="cuda:0", model=NVML_MODEL)
    async with ReferenceEngineProcess(engine_cfg) as engine:
        config = NodeConfig.model_validate({"engines": [{"kind": "reference", "name": "gpu0", "url": engine.url,
                                                         "gpus": [0]}], "timeouts": {"memory_confirm_s": 30}})
        async with serve_app(create_app(config)) as url, AsyncColocdClient(url) as client:
            await client.wait_ready(60)
            assert (await client.status())["nvml"] is True
            yield NvmlNode(client, str(engine.url), NVML_MODEL)


@pytest.fixture
def named() -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tiny checkpoint's tensors (HF names and shapes, bf16) on cuda:0, freed again after the test."""
    tensors = [(n, torch.empty(s, dtype=torch.bfloat16, device="cuda:0")) for n, s in hf_shapes("tiny")]
    yield tensors
    del tensors
    torch.cuda.empty_cache()
