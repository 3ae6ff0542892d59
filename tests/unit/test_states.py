"""The state machines as specifications: what is legal, what is refused, and what the refusal says."""

from __future__ import annotations

import subprocess
import sys

import pytest

from colocd.daemon.states import (
    EngineRecord,
    Generation,
    NodePhase,
    NodeState,
    TagState,
    WeightsState,
    check_phase_request,
)
from colocd.engines.base import MemoryTag
from colocd.errors import TransitionRejected

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


def test_double_release_is_refused() -> None:
    engine = EngineRecord("e").with_tags((KV,), TagState.RELEASED)
    engine.check_tags("release", (W,))
    with pytest.raises(TransitionRejected, match=r"\['kv_cache'\]: already released"):
        engine.check_tags("release", (KV, W))


def test_resume_of_a_resident_tag_is_refused() -> None:
    with pytest.raises(TransitionRejected, match="already resident"):
        EngineRecord("e").check_tags("resume", (W,))


def test_tags_the_engine_does_not_own_are_refused() -> None:
    engine = EngineRecord("e", owned_tags=(W, KV))
    with pytest.raises(TransitionRejected, match="does not own tags \\['cuda_graph'\\]"):
        engine.check_tags("release", (CG,))
    engine.check_tags("release", None)  # every owned tag


def test_releasing_weights_makes_them_stale_and_serving_is_refused_until_clean() -> None:
    engine = EngineRecord("e").with_tags((W, KV), TagState.RELEASED)
    assert engine.weights is WeightsState.STALE
    engine = engine.with_tags((W, KV), TagState.RESIDENT)
    with pytest.raises(TransitionRejected, match="weights are stale"):
        engine.check_can_serve()
    engine.with_(weights=WeightsState.CLEAN, generation=Generation.PAUSED).check_can_serve()


def test_serving_on_released_memory_is_refused() -> None:
    engine = EngineRecord("e").with_tags((KV,), TagState.RELEASED)
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


# -- the daemon's own rules: one operation at a time, only while running, only once reconciled ----------
def test_a_daemon_takes_work_only_while_running_and_one_operation_at_a_time() -> None:
    from colocd.daemon.states import DaemonState, check_can_start

    node = NodeState(NodePhase.TRAIN, 2)
    check_can_start("sync@2", lifecycle=DaemonState.RUNNING, busy_with=None, node=node)
    for lifecycle in (DaemonState.UNOPENED, DaemonState.CLOSED):
        with pytest.raises(TransitionRejected, match=f"^daemon is {lifecycle.value}$"):
            check_can_start("sync@2", lifecycle=lifecycle, busy_with=None, node=node)
    with pytest.raises(TransitionRejected, match=r"^cannot start sync@2: sleep is in progress$") as caught:
        check_can_start("sync@2", lifecycle=DaemonState.RUNNING, busy_with="sleep", node=node)
    assert caught.value.state == {"phase": "train", "step": 2}


def test_a_restarted_daemon_refuses_work_until_every_engine_is_reconciled() -> None:
    from colocd.daemon.states import check_reconciled

    node = NodeState(NodePhase.SYNC, 4)
    check_reconciled("sync@4", {}, node)
    with pytest.raises(TransitionRejected, match=r"engines \['a', 'b'\] with its journal: not observed; down"):
        check_reconciled("sync@4", {"b": "down", "a": None}, node)


def test_rollout_needs_clean_weights_on_every_engine_before_any_resumes() -> None:
    from colocd.daemon.states import check_rollout_weights

    node = NodeState(NodePhase.SYNC, 1)
    clean, stale = EngineRecord(name="a"), EngineRecord(name="b", weights=WeightsState.STALE)
    check_rollout_weights([clean], node)
    with pytest.raises(TransitionRejected, match="weights not updated since release: engine 'b'"):
        check_rollout_weights([clean, stale], node)


def test_a_weight_session_opens_alone_on_paused_engines_with_weights_resident() -> None:
    from colocd.daemon.states import check_can_open_session, check_partial_allowed

    node = NodeState(NodePhase.SYNC, 1)
    paused = EngineRecord(name="a", generation=Generation.PAUSED)
    check_can_open_session(None, [paused], node)
    with pytest.raises(TransitionRejected, match=r"session s1 is already open \(idle 2.0s; it expires after 30.0s"):
        check_can_open_session("s1", [paused], node, idle_for=2.0, idle_s=30.0)
    with pytest.raises(TransitionRejected, match="must be paused with weights resident"):
        check_can_open_session(None, [EngineRecord(name="a")], node)  # serving
    with pytest.raises(TransitionRejected, match="must be paused with weights resident"):
        check_can_open_session(None, [paused.with_tags((W,), TagState.RELEASED)], node)
    check_partial_allowed([paused], node)
    with pytest.raises(TransitionRejected, match="a partial update needs intact weights"):
        check_partial_allowed([paused.with_(weights=WeightsState.STALE)], node)


def test_an_engine_takes_mutating_calls_only_attached_and_healthy() -> None:
    from colocd.daemon.states import check_attached, unready_reason
    from colocd.errors import EngineUnreachable

    healthy = EngineRecord(name="a")
    check_attached("a", True, healthy)
    assert unready_reason("a", True, healthy) is None
    with pytest.raises(EngineUnreachable, match="not attached"):
        check_attached("a", False, healthy)
    lost = healthy.with_(healthy=False, last_error="engine 'a': connection refused")
    with pytest.raises(EngineUnreachable, match="connection refused"):
        check_attached("a", True, lost)
    assert unready_reason("a", True, lost) == "engine 'a': connection refused"
    assert unready_reason("a", False, healthy) == "engine 'a' unhealthy"
