"""Which trainer rank feeds a GPU engine when the trainer's tensors are in host memory.

A trainer rank whose tensors live on the CPU declares a ``cpu`` device; its chunks travel by shared
memory, which an engine on any GPU reads. Such a rank feeds the engine TP rank of its own index once
every rank joined, where matching by device would find no rank on that GPU. A GPU rank on another GPU
does not (CUDA IPC cannot cross GPUs), and CPU engines still match their declared device ids exactly.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from colocd.daemon.metrics import Metrics
from colocd.daemon.trace import Trace
from colocd.daemon.weights import WeightSession
from colocd.errors import RequestInvalid
from colocd.policies import Transport

GPU0 = "GPU-c84bc8ec-c721-6836-0423-0963f9a5acdc"
GPU1 = "GPU-00000000-1111-2222-3333-444444444444"


def _engine(name: str, *devices: str) -> Any:
    return SimpleNamespace(name=name, config=SimpleNamespace(tp_size=len(devices)), tp_devices=tuple(devices),
                           transports=frozenset(Transport))


def _session(ranks: int, *engines: Any) -> WeightSession:
    return WeightSession(step=1, version="v1", ranks=ranks, engines=list(engines), depth=1, chunk_timeout_s=1.0,
                         trace=Trace(1, "weights"), metrics=Metrics(), idle_s=30.0)


async def test_a_cpu_trainer_rank_feeds_a_gpu_engine_it_shares_no_device_with() -> None:
    session = _session(1, _engine("gpu0", GPU0))
    joined = await session.join(0, "cpu:0")
    assert joined.feeds == (("gpu0", 0),)


async def test_host_ranks_feed_the_tp_ranks_of_their_own_index() -> None:
    session = _session(2, _engine("tp2", GPU0, GPU1))
    await session.join(0, "cpu:0")
    second = await session.join(1, "cpu:1")
    assert second.feeds == (("tp2", 1),)


async def test_a_gpu_rank_on_another_gpu_leaves_the_layout_unserved() -> None:
    session = _session(1, _engine("gpu0", GPU0))
    with pytest.raises(RequestInvalid, match="layout cannot be served"):
        await session.join(0, GPU1.removeprefix("GPU-"))


async def test_cpu_engines_still_match_declared_device_ids_exactly() -> None:
    session = _session(1, _engine("cpu-engine", "cpu:4"))
    with pytest.raises(RequestInvalid, match="layout cannot be served"):
        await session.join(0, "cpu:0")
