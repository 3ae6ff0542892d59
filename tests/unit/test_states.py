"""The state machines as specifications: what is legal, what is refused, and what the refusal says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from colocd.daemon.errors import TransitionRejected
from colocd.daemon.states import (
    EngineState,
    Generation,
    NodePhase,
    NodeState,
    TagState,
    WeightsState,
    check_phase_request,
)
from colocd.engines.base import MemoryTag

W, KV, CG = MemoryTag.WEIGHTS, MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH


@pytest.mark.parametrize(("node", "phase", "step"), [
    (NodeState(NodePhase.ROLLOUT, 0), NodePhase.TRAIN, 1),
    (NodeState(NodePhase.ROLLOUT, 3), NodePhase.TRAIN, 7),
    (NodeState(NodePhase.TRAIN, 1), NodePhase.SYNC, 1),
    (NodeState(NodePhase.SYNC, 1), NodePhase.ROLLOUT, 1),
])
def test_legal_phase_moves_pass(node: NodeState, phase: NodePhase, step: int) -> None:
    check_phase_request(node, phase, step)


@pytest.mark.parametrize(("node", "phase", "step", "says"), [
    (NodeState(NodePhase.ROLLOUT, 0), NodePhase.SYNC, 0, "'sync' follows 'train'"),
    (NodeState(NodePhase.ROLLOUT, 2), NodePhase.TRAIN, 2, "greater than the current step 2"),
    (NodeState(NodePhase.TRAIN, 1), NodePhase.SYNC, 2, "node is at step 1"),
    (NodeState(NodePhase.TRAIN, 1), NodePhase.ROLLOUT, 1, "'rollout' follows 'sync'"),
    (NodeState(NodePhase.SYNC, 1), NodePhase.TRAIN, 2, "'train' follows 'rollout'"),
])
def test_illegal_phase_moves_name_the_current_state(node: NodeState, phase: NodePhase, step: int, says: str) -> None:
    with pytest.raises(TransitionRejected) as err:
        check_phase_request(node, phase, step)
    assert says in str(err.value)
    assert err.value.state == node.snapshot()


def test_double_release_is_refused_when_strict_and_skipped_otherwise() -> None:
    engine = EngineState("e").with_tags((KV,), TagState.RELEASED)
    assert engine.tags_to_release((KV, W), strict=False) == (W,)
    with pytest.raises(TransitionRejected, match=r"\['kv_cache'\]: already released"):
        engine.tags_to_release((KV,), strict=True)


def test_resume_of_a_resident_tag_is_refused_when_strict() -> None:
    with pytest.raises(TransitionRejected, match="already resident"):
        EngineState("e").tags_to_resume((W,), strict=True)


def test_tags_the_engine_does_not_own_are_refused() -> None:
    engine = EngineState("e", owned_tags=(W, KV))
    with pytest.raises(TransitionRejected, match="does not own tags \\['cuda_graph'\\]"):
        engine.tags_to_release((CG,), strict=True)
    assert engine.tags_to_release(None, strict=True) == (W, KV)


def test_releasing_weights_makes_them_stale_and_serving_is_refused_until_clean() -> None:
    engine = EngineState("e").with_tags((W, KV), TagState.RELEASED)
    assert engine.weights is WeightsState.STALE
    engine = engine.with_tags((W, KV), TagState.RESIDENT)
    with pytest.raises(TransitionRejected, match="weights are stale"):
        engine.check_can_serve()
    engine.with_(weights=WeightsState.CLEAN, generation=Generation.PAUSED).check_can_serve()


def test_serving_on_released_memory_is_refused() -> None:
    engine = EngineState("e").with_tags((KV,), TagState.RELEASED)
    with pytest.raises(TransitionRejected, match=r"tags \['kv_cache'\] are released"):
        engine.check_can_serve()


def test_importing_policies_loads_neither_torch_nor_engines() -> None:
    code = ("import sys, colocd.policies; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('colocd.engines')]; print(bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_sglang_engines_own_cuda_graph_memory_only_when_launched_to() -> None:
    from pydantic import ValidationError

    from colocd.engines.config import SGLangEngineConfig

    assert CG not in SGLangEngineConfig(name="s", url="http://x").owned_tags
    assert CG in SGLangEngineConfig(name="s", url="http://x", memory_saver_cuda_graph=True).owned_tags
    with pytest.raises(ValidationError, match="SGLANG_MEMORY_SAVER_CUDA_GRAPH"):
        SGLangEngineConfig(name="s", url="http://x", owned_tags=["weights", "cuda_graph"])
