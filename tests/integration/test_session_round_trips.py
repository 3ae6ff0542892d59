"""What a weight session's open and commit ask of the engine, and what they must catch. Both observe every engine
first, so an engine that is not what its record says (a restarted process) is reconciled and the open or commit is
decided on the corrected record: an engine process that restarted after the last chunk takes no version it does
not hold. The commit's version becomes the served one as the engine's session ends.

A reference engine runs as its own process on loopback; the daemon runs in the test's event loop.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from support import chunk_part, in_process_daemon, restartable_engine

from colocd.daemon.node import Daemon
from colocd.daemon.states import NodePhase, WeightsState
from colocd.daemon.weights import WeightSession
from colocd.engines.base import MemoryTag, Observation
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.errors import SessionGone
from colocd.trainer.producer import Producer
from colocd.trainer.push import manifest_of


async def _open_and_send_everything(daemon: Daemon) -> WeightSession:
    """Step 1's session, every tensor of the engine's model delivered in one inline chunk (not committed)."""
    await daemon.transitions.transition(NodePhase.TRAIN, 1)
    await daemon.transitions.transition(NodePhase.SYNC, 1)
    named = list(build_model(QwenLikeConfig(), seed=7).named_parameters())
    session = await daemon.sessions.open(step=1, version="v1", ranks=1, manifest=manifest_of(named))
    part = Producer("inline").export(named)
    await daemon.sessions.submit_chunk(session.id, 0, chunk_part(0, "inline", part.nbytes, part.handle))
    return session


async def _served_version(url: str) -> str:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        return str((await http.get(f"{url}/model_info")).raise_for_status().json()["weight_version"])


QUIET = {"health_interval_s": 600, "default_s": 20}  # no health pass: only the calls under test reach the engine


def _count_observations(daemon: Daemon, during: str) -> list[int]:
    """Counts the engine observations made while the node is busy with ``during`` (one counter, a list)."""
    handle = daemon.engines["ref0"]
    observe = handle.adapter.observe
    seen = [0]

    async def counted() -> Observation:
        if daemon.lock.busy_with == during:
            seen[0] += 1
        return await observe()

    handle.adapter.observe = counted  # type: ignore[method-assign]
    return seen


async def test_an_engine_restarted_before_the_commit_takes_no_version_and_the_commit_fails_at_its_end() -> None:
    async with restartable_engine() as engine, in_process_daemon(engines={"ref0": engine.url},
                                                                 timeouts=QUIET) as daemon:
        url = engine.url
        handle = daemon.engines["ref0"]
        session = await _open_and_send_everything(daemon)
        await engine.restart()  # every chunk delivered; the process holding them is gone
        with pytest.raises(SessionGone):
            await daemon.sessions.commit(session.id, 1)
        assert await _served_version(url) == "default"  # the new process never took v1
        assert handle.state.weight_version != "v1"
        assert handle.state.weights is not WeightsState.CLEAN


async def _observed_commit(url: str) -> tuple[list[int], dict[str, Any], str | None]:
    """A complete session committed: the engine observations the commit made, its reply, the version recorded."""
    async with in_process_daemon(engines={"ref0": url}, timeouts=QUIET) as daemon:
        handle = daemon.engines["ref0"]
        session = await _open_and_send_everything(daemon)
        observed = _count_observations(daemon, "commit_weights")
        reply: dict[str, Any] = await daemon.sessions.commit(session.id, 1)
        return observed, reply, handle.state.weight_version


async def test_a_commit_observes_every_engine_first_and_the_version_is_served_as_the_session_ends(
        pooled_engine: ReferenceEngineProcess) -> None:
    observed, reply, version = await _observed_commit(str(pooled_engine.url))
    assert observed == [1] and version == "v1"
    assert "end_weight_update" in [s["name"] for s in reply["trace"]["spans"]]
    assert await _served_version(str(pooled_engine.url)) == "v1"


async def test_an_open_observes_every_engine_first(pooled_engine: ReferenceEngineProcess) -> None:
    async with in_process_daemon(engines={"ref0": str(pooled_engine.url)}, timeouts=QUIET) as daemon:
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
        await daemon.transitions.transition(NodePhase.SYNC, 1)
        observed = _count_observations(daemon, "open_weights")
        session = await daemon.sessions.open(step=1, version="v1", ranks=1)
        assert observed == [1]
        assert daemon.engines["ref0"].state.weights is WeightsState.UPDATING
        await daemon.sessions.abort(session.id)


async def test_an_engine_restarted_before_the_open_is_reconciled_and_a_partial_update_is_refused() -> None:
    async with restartable_engine() as engine, in_process_daemon(engines={"ref0": engine.url},
                                                                 timeouts=QUIET) as daemon:
        url = engine.url
        session = await _open_and_send_everything(daemon)
        await daemon.sessions.commit(session.id, 1)
        await daemon.transitions.transition(NodePhase.ROLLOUT, 1)
        await daemon.transitions.sleep((MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH), None)  # weights kept
        record = daemon.engines["ref0"].state
        assert record.weights is WeightsState.CLEAN and record.weight_version == "v1"
        await engine.restart()  # behind the daemon's back: default weights, serving
        observed = _count_observations(daemon, "open_weights")
        with pytest.raises(Exception, match="a partial update needs intact weights"):
            await daemon.sessions.open(step=1, version="v1p", ranks=1, partial=True)
        assert observed == [1]  # the open looked first, then refused
        record = daemon.engines["ref0"].state
        assert record.incarnation != "" and record.weights is WeightsState.STALE
        assert (await _internal_state(url))["weight_update_session"] is None  # no begin was sent


async def test_an_engine_restarted_before_the_open_is_reconciled_and_a_complete_update_opens() -> None:
    async with restartable_engine() as engine, in_process_daemon(engines={"ref0": engine.url},
                                                                 timeouts=QUIET) as daemon:
        url = engine.url
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
        await daemon.transitions.transition(NodePhase.SYNC, 1)
        before = daemon.engines["ref0"].state.incarnation
        await engine.restart()
        session = await daemon.sessions.open(step=1, version="v1", ranks=1)
        record = daemon.engines["ref0"].state
        assert record.incarnation != before and record.weights is WeightsState.UPDATING
        assert [s.name for s in session.trace.spans].count("begin_weight_update") == 1
        state = await _internal_state(url)
        assert state["paused"] is not None and state["weight_update_session"] == "all"
        await daemon.sessions.abort(session.id)


async def _internal_state(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        return dict((await http.get(f"{url}/server_info")).raise_for_status().json()["internal_states"][0])
