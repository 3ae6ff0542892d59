"""A weight session's fixed costs (issue 29): the trace that times each stage, and the engine round trips the
daemon no longer repeats. In-process daemon over a fake engine: what is counted is the daemon's own behaviour."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import InMemoryEngine, in_process_daemon

from benchmarks.session_breakdown import STAGES, breakdown
from colocd.daemon.errors import RequestInvalid
from colocd.daemon.node import Daemon
from colocd.daemon.states import NodePhase
from colocd.engines.base import (
    Capability,
    ChunkPart,
    EngineInfo,
    ParameterSpec,
)
from colocd.engines.chunks import ChunkLayout
from colocd.trainer.push import manifest_of

NAMED = [(f"layers.{i}.weight", torch.zeros(4, 4)) for i in range(12)]


class ListedEngine(InMemoryEngine):
    """A fake engine that lists its parameters (counting each time it is asked) and can be 'restarted'."""

    incarnation = "proc-0"

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.manifest_calls = 0

    async def attach(self) -> EngineInfo:
        return EngineInfo(self.name, "fake", "0", "fake", self.version,
                          capabilities=frozenset({Capability.PARAMETER_MANIFEST}))

    async def parameter_manifest(self) -> tuple[ParameterSpec, ...] | None:
        self.manifest_calls += 1
        return tuple(ParameterSpec(m["name"], m["dtype"], tuple(m["shape"])) for m in manifest_of(NAMED))


async def _commit_one(daemon: Daemon, step: int, version: str) -> dict[str, Any]:
    session = await daemon.sessions.open(step=step, version=version, ranks=1, manifest=manifest_of(NAMED))
    handle = {"payload_b64": "", "layout": ChunkLayout.for_tensors(NAMED).to_json()}
    await daemon.sessions.submit_chunk(session.id, 0, ChunkPart(0, "cuda_ipc", 8, handle))
    return await daemon.sessions.commit(session.id, 1)


async def _push(daemon: Daemon, step: int, version: str) -> dict[str, Any]:
    await daemon.transitions.transition(NodePhase.TRAIN, step)
    await daemon.transitions.transition(NodePhase.SYNC, step)
    commit = await _commit_one(daemon, step, version)
    await daemon.transitions.transition(NodePhase.ROLLOUT, step)
    return commit


async def test_the_commit_trace_times_every_stage_of_the_session_open_to_commit(tmp_path: Any) -> None:
    async with in_process_daemon({"e0": ListedEngine("e0")}, journal=str(tmp_path / "journal.jsonl")) as daemon:
        commit = await _push(daemon, 1, "v1")
    names = [s["name"] for s in commit["trace"]["spans"]]
    assert names.count("node_lock") == 2  # the open's and the commit's
    for name in ("open_checks", "parameter_manifest", "manifest_check", "begin_weight_update", "load_chunk", "drain",
                 "check_complete", "verify", "end_weight_update", "commit_bookkeeping",
                 "journal"):
        assert name in names, name
    stages = breakdown(open_s=1.0, stream_s=1.0, commit_s=1.0, wall_s=3.0, trace=commit["trace"])
    assert set(stages) == {k for k, _ in STAGES}
    assert 0 < stages["open.daemon"] <= 1.0 and 0 < stages["commit.daemon"] <= 1.0
    assert stages["open.lock"] + stages["open.begin"] <= stages["open.daemon"]
    assert stages["commit.lock"] + stages["commit.verify"] + stages["commit.end"] <= stages["commit.daemon"]


async def test_an_engine_lists_its_parameters_once_per_incarnation_and_they_still_bind_every_open(
        tmp_path: Any) -> None:
    engine = ListedEngine("e0")
    async with in_process_daemon({"e0": engine}, journal=str(tmp_path / "journal.jsonl")) as daemon:
        await _push(daemon, 1, "v1")
        second = await _push(daemon, 2, "v2")
        assert engine.manifest_calls == 1
        assert "parameter_manifest" not in [s["name"] for s in second["trace"]["spans"]]

        await daemon.transitions.transition(NodePhase.TRAIN, 3)
        await daemon.transitions.transition(NodePhase.SYNC, 3)
        with pytest.raises(RequestInvalid, match="manifest does not fit engine 'e0'") as refused:
            await daemon.sessions.open(step=3, version="v3", ranks=1, manifest=manifest_of(NAMED[:5]))
        assert refused.value.field == "manifest"  # the remembered set still says what complete means

        engine.incarnation = "proc-1"  # the engine restarted: the next open asks the new process
        await _commit_one(daemon, 3, "v3")
        assert engine.manifest_calls == 2
