"""What a weight session's commit asks of the reference engine in one round trip (issue 29), and what that
shortcut must still catch: the engine's end of the session sets the pushed version, so an engine process that
restarted after the commit's observation (the gap before the version lands) takes no version it does not hold.

A reference engine runs as its own process on loopback; the daemon runs in the test's event loop.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import httpx
import pytest

from colocd.daemon.config import NodeConfig
from colocd.daemon.node import Daemon
from colocd.daemon.states import NodePhase, WeightsState
from colocd.daemon.weights import WeightSession
from colocd.engines.base import Capability, ChunkPart, Observation
from colocd.engines.chunks import ChunkLayout, SharedSegment, flatten_into
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import manifest_of


async def _open_and_send_everything(daemon: Daemon, segments: list[SharedSegment]) -> WeightSession:
    """Step 1's session, every tensor of the engine's model delivered in one shared-memory chunk (not committed)."""
    await daemon.transitions.transition(NodePhase.TRAIN, 1)
    await daemon.transitions.transition(NodePhase.SYNC, 1)
    named = list(build_model(QwenLikeConfig(), seed=7).named_parameters())
    session = await daemon.sessions.open(step=1, version="v1", ranks=1, manifest=manifest_of(named))
    layout = ChunkLayout.for_tensors(named)
    seg = SharedSegment.create(layout.nbytes)
    segments.append(seg)
    flatten_into(seg.tensor(), layout, named)
    handle = {"shm_name": seg.name, "nbytes": layout.nbytes, "layout": layout.to_json()}
    await daemon.sessions.submit_chunk(session.id, 0, ChunkPart(0, "shm", layout.nbytes, handle))
    return session


async def _served_version(url: str) -> str:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        return str((await http.get(f"{url}/model_info")).raise_for_status().json()["weight_version"])


async def test_an_engine_restarted_after_the_commits_observation_takes_no_version_and_the_commit_fails() -> None:
    engine = ReferenceEngineProcess(ReferenceEngineConfig(name="ref0", url="http://127.0.0.1:0", seed=0))
    await engine.astart()
    url = str(engine.url)
    segments: list[SharedSegment] = []
    config = NodeConfig.model_validate({"engines": [{"kind": "reference", "name": "ref0", "url": url}],
                                        "timeouts": {"health_interval_s": 600, "default_s": 20}})
    try:
        async with Daemon(config) as daemon:
            handle = daemon.engines["ref0"]
            assert handle.can(Capability.VERSION_AT_END) and handle.can(Capability.OBSERVE_IN_ONE)
            session = await _open_and_send_everything(daemon, segments)
            observe = handle.adapter.observe

            async def observe_then_restart() -> Observation:
                seen = await observe()
                if daemon.busy_with == "commit_weights":  # the commit's observation: the engine restarts after it
                    nonlocal engine
                    assert engine.pid is not None
                    os.kill(engine.pid, signal.SIGKILL)
                    await engine.aclose()
                    # Ready once it serves (its start-up over), so its answer is about the session, not the start.
                    engine = ReferenceEngineProcess(ReferenceEngineConfig(name="ref0", url=url, seed=0))
                    await engine.astart()
                return seen

            handle.adapter.observe = observe_then_restart  # type: ignore[method-assign]
            with pytest.raises(Exception, match="no weight-update session is open"):
                await daemon.sessions.commit(session.id, 1)
            handle.adapter.observe = observe  # type: ignore[method-assign]
            assert await _served_version(url) == "default"  # the new process never took v1
            assert handle.state.weight_version != "v1"
            assert handle.state.weights is not WeightsState.CLEAN
    finally:
        await engine.aclose()
        _unlink(segments)


async def test_a_commit_sets_the_version_as_the_engine_ends_the_session_in_one_call() -> None:
    engine = ReferenceEngineProcess(ReferenceEngineConfig(name="ref0", url="http://127.0.0.1:0", seed=0),
                                    ready_path="/model_info")
    segments: list[SharedSegment] = []
    async with engine:
        url = str(engine.url)
        config = NodeConfig.model_validate({"engines": [{"kind": "reference", "name": "ref0", "url": url}],
                                            "timeouts": {"health_interval_s": 600, "default_s": 20}})
        async with Daemon(config) as daemon:
            session = await _open_and_send_everything(daemon, segments)
            reply: dict[str, Any] = await daemon.sessions.commit(session.id, 1)
            names = [s["name"] for s in reply["trace"]["spans"]]
            assert "end_weight_update" in names and "set_weight_version" not in names
            assert await _served_version(url) == "v1"
            assert daemon.engines["ref0"].state.weight_version == "v1"
    _unlink(segments)


def _unlink(segments: list[SharedSegment]) -> None:
    for seg in segments:
        seg.close()
        seg.unlink()
