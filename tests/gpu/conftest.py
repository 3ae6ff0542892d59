"""Shared GPU fixtures: a reference engine on cuda:0 behind a daemon that confirms releases through NVML, and
the tiny checkpoint's tensors on cuda:0. Requested only by tests marked ``gpu``, which skip without CUDA."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import NvmlNode, daemon_node, reference_engine

from benchmarks.sink import hf_shapes

# ~0.4 GB of fp32 weights plus the KV pool: large enough that NVML sees a release clearly.
NVML_MODEL: dict[str, Any] = {"hidden_size": 1024, "intermediate_size": 4096, "num_layers": 8, "num_heads": 16,
                              "num_kv_heads": 8, "head_dim": 64, "max_position": 128}


@pytest_asyncio.fixture
async def nvml_node() -> AsyncIterator[NvmlNode]:
    """Engine ``gpu0`` on cuda:0 and a daemon configured with GPU 0, so every release is confirmed by NVML."""
    pytest.importorskip("pynvml")
    async with reference_engine("gpu0", device="cuda:0", model=NVML_MODEL) as engine, daemon_node(
            [{"kind": "reference", "name": "gpu0", "url": str(engine.url), "gpus": [0]}],
            timeouts={"memory_confirm_s": 30}) as node:
        assert (await node.client.status())["nvml"] is True
        yield NvmlNode(node.client, str(engine.url), NVML_MODEL)


@pytest.fixture
def named() -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The tiny checkpoint's tensors (HF names and shapes, bf16) on cuda:0, freed again after the test."""
    tensors = [(n, torch.empty(s, dtype=torch.bfloat16, device="cuda:0")) for n, s in hf_shapes("tiny")]
    yield tensors
    del tensors
    torch.cuda.empty_cache()
