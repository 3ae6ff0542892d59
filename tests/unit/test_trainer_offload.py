"""RankState: a training rank's state survives an offload/onload round trip, and a step changes the weights."""

from __future__ import annotations

import pytest
import torch

from benchmarks.offload import RankState
from benchmarks.sink import hf_shapes


def _snapshot(state: RankState) -> tuple[list[torch.Tensor], torch.Tensor]:
    assert state.optimizer is not None
    return [w.clone() for _, w in state.named_weights()], state.optimizer.clone()


def test_offload_then_onload_restores_weights_and_optimizer_and_zeroes_grads() -> None:
    state = RankState(hf_shapes("tiny"), torch.device("cpu"), shards=4, seed=1)
    state.step(8, seed=2)  # moments are non-zero now
    weights, optim = _snapshot(state)
    out = state.offload(("weights", "grads", "optimizer"))
    assert out.copied_bytes == state.nbytes("weights") + state.nbytes("optimizer")  # grads are dropped
    assert not any(state.resident(p) for p in ("weights", "grads", "optimizer"))
    with pytest.raises(RuntimeError, match="offloaded"):
        state.named_weights()
    back = state.onload(("weights", "grads", "optimizer"))
    assert back.copied_bytes == out.copied_bytes
    assert all(torch.equal(a, b) for a, (_, b) in zip(weights, state.named_weights(), strict=True))
    assert state.optimizer is not None and torch.equal(optim, state.optimizer)
    assert state.grads is not None and not state.grads.any()


def test_a_step_updates_only_the_shard_it_owns() -> None:
    state = RankState(hf_shapes("tiny"), torch.device("cpu"), shards=4, seed=1)
    weights, _ = _snapshot(state)
    state.step(8, seed=3, lr=1e-2)
    changed = [not torch.equal(a, b) for a, (_, b) in zip(weights, state.named_weights(), strict=True)]
    assert any(changed[: state.owned]) and not any(changed[state.owned :])
    assert 4 * state.shard_numel >= state.param_numel  # the shard covers at least 1/4 of the parameters


def test_unknown_parts_are_refused() -> None:
    state = RankState(hf_shapes("tiny"), torch.device("cpu"), shards=1)
    with pytest.raises(ValueError, match="unknown parts"):
        state.offload(("weights", "activations"))


@pytest.mark.gpu
def test_on_cuda_the_offload_waits_for_the_last_write_queued_on_the_callers_stream() -> None:
    """The copies run on the state's own stream: they must still see a write the caller queued just before."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda", 0)
    state = RankState(hf_shapes("tiny"), device, shards=4, seed=1)
    last = state.named_weights()[-1][1]
    torch.cuda._sleep(50_000_000)  # ~tens of ms of GPU time queued ahead of the write, on the default stream
    last.fill_(3.0)
    state.offload(("weights", "grads", "optimizer"))
    state.onload(("weights", "grads", "optimizer"))
    assert bool((state.named_weights()[-1][1] == 3.0).all())
    assert state.grads is not None and not bool(state.grads.any())


def test_copies_cut_into_pieces_still_move_every_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    import benchmarks.offload as offload

    monkeypatch.setattr(offload, "COPY_PIECE_BYTES", 1000)  # far below the tensors' sizes, and not a divisor
    state = RankState(hf_shapes("tiny"), torch.device("cpu"), shards=4, seed=1)
    state.step(8, seed=2)
    weights, optim = _snapshot(state)
    state.offload(("weights", "grads", "optimizer"))
    state.onload(("weights", "grads", "optimizer"))
    assert all(torch.equal(a, b) for a, (_, b) in zip(weights, state.named_weights(), strict=True))
    assert state.optimizer is not None and torch.equal(optim, state.optimizer)
