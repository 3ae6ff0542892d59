"""The benchmark sink follows the engine's memory tags: released with them, allocated again on resume."""

from __future__ import annotations

import pytest
import torch

from colocd.engines.base import MemoryTag
from colocd.engines.reference.memory import MemoryRegions
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.engines.reference.sink import WeightSink


def _regions(kv_bytes: int = 4096) -> tuple[MemoryRegions, WeightSink, torch.nn.Module]:
    model = build_model(QwenLikeConfig(), seed=1)
    sink = WeightSink("tiny", torch.device("cpu"), kv_bytes=kv_bytes)
    return MemoryRegions(model, max_batch=2, max_seq=16, device=torch.device("cpu"), sink=sink), sink, model


def test_weights_and_kv_tags_count_the_sink_and_release_it() -> None:
    regions, sink, _ = _regions()
    with_sink = regions.resident_nbytes(MemoryTag.WEIGHTS)
    assert with_sink > sink.nbytes > 0
    assert regions.resident_nbytes(MemoryTag.KV_CACHE) > sink.kv_bytes
    regions.release([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
    assert sink.tensors == {} and sink._kv is None
    with pytest.raises(ValueError, match="released"):
        sink.load_weights([("model.norm.weight", torch.zeros(256, dtype=torch.bfloat16))])
    regions.resume([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
    assert sum(t.nbytes for t in sink.tensors.values()) == sink.nbytes
    assert sink._kv is not None and sink._kv.numel() == sink.kv_bytes


def test_with_a_sink_the_models_own_weights_survive_a_release() -> None:
    # Pushes land in the sink, so nothing would restore the tiny model: its weights are kept on the host.
    regions, _, model = _regions()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    regions.release([MemoryTag.WEIGHTS])
    assert all(p.numel() == 0 for p in model.parameters())
    regions.resume([MemoryTag.WEIGHTS])
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
