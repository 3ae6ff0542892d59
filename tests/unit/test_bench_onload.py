"""The switch bench's onload levers (benchmarks/onload.py): each brings back exactly the state the offload took."""

from __future__ import annotations

import pytest
import torch

from benchmarks import onload as O
from benchmarks.offload import RankState

SHAPES = [("embed.weight", (64, 32)), ("layers.0.mlp.gate_proj.weight", (48, 32)),
          ("layers.0.mlp.up_proj.weight", (48, 32)), ("layers.0.mlp.down_proj.weight", (32, 48)),
          ("norm.weight", (32,))]


@pytest.mark.parametrize("how", O.ONLOADS)
def test_every_onload_restores_the_offloaded_weights_and_optimizer_and_zeroes_the_grads(how: str) -> None:
    state = RankState(SHAPES, torch.device("cpu"), shards=2, seed=3)
    state.step(4, seed=1)
    weights = [w.clone() for _, w in state.named_weights()]
    assert state.optimizer is not None
    optimizer = state.optimizer.clone()
    state.offload(("weights", "grads", "optimizer"))
    report = O.onloader(state, how)(("weights", "grads", "optimizer"))
    assert report.parts == ("weights", "grads", "optimizer")
    assert report.copied_bytes == state.nbytes("weights") + state.nbytes("optimizer")
    assert all(torch.equal(a, b) for a, (_, b) in zip(weights, state.named_weights(), strict=True))
    assert state.optimizer is not None and torch.equal(state.optimizer, optimizer)
    assert state.grads is not None and not state.grads.any()


def test_an_onload_brings_back_only_what_is_offloaded() -> None:
    state = RankState(SHAPES, torch.device("cpu"), shards=2)
    state.offload(("grads",))
    report = O.onloader(state, "interleaved")(("weights", "grads", "optimizer"))
    assert report.parts == ("grads",) and report.copied_bytes == 0


def test_an_unknown_onload_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown onload 'fast'"):
        O.onloader(RankState(SHAPES, torch.device("cpu")), "fast")
