"""A weight session's fixed costs (issue 29): the trace that times each stage, and the engine round trips the
daemon no longer repeats. In-process daemon over a fake engine: what is counted is the daemon's own behaviour."""

from __future__ import annotations

from typing import Any

import torch
from support import InMemoryEngine, chunk_part, in_process_daemon

from benchmarks.session_breakdown import STAGES, breakdown
from colocd.daemon.node import Daemon
from colocd.daemon.states import NodePhase
from colocd.engines.chunks import ChunkLayout
from colocd.trainer.push import manifest_of

NAMED = [(f"layers.{i}.weight", torch.zeros(4, 4)) for i in range(12)]


async def _commit_one(daemon: Daemon, step: int, version: str) -> dict[str, Any]:
    session = await daemon.sessions.open(step=step, version=version, ranks=1, manifest=manifest_of(NAMED))
    handle = {"payload_b64": "", "layout": ChunkLayout.for_tensors(NAMED).to_json()}
    await daemon.sessions.submit_chunk(session.id, 0, chunk_part(0, "cuda_ipc", 8, handle))
    return await daemon.sessions.commit(session.id, 1)


async def _push(daemon: Daemon, step: int, version: str) -> dict[str, Any]:
    await daemon.transitions.transition(NodePhase.TRAIN, step)
    await daemon.transitions.transition(NodePhase.SYNC, step)
    commit = await _commit_one(daemon, step, version)
    await daemon.transitions.transition(NodePhase.ROLLOUT, step)
    return commit


async def test_the_commit_trace_times_every_stage_of_the_session_open_to_commit(tmp_path: Any) -> None:
    async with in_process_daemon({"e0": InMemoryEngine("e0")}, journal=str(tmp_path / "journal.jsonl")) as daemon:
        commit = await _push(daemon, 1, "v1")
    names = [s["name"] for s in commit["trace"]["spans"]]
    assert names.count("node_lock") == 2  # the open's and the commit's
    for name in ("open_checks", "manifest_check", "begin_weight_update", "load_chunk", "drain",
                 "check_complete", "verify", "end_weight_update", "commit_bookkeeping",
                 "journal"):
        assert name in names, name
    stages = breakdown(open_s=1.0, stream_s=1.0, commit_s=1.0, wall_s=3.0, trace=commit["trace"])
    assert set(stages) == {k for k, _ in STAGES}
    assert 0 < stages["open.daemon"] <= 1.0 and 0 < stages["commit.daemon"] <= 1.0
    assert stages["open.lock"] + stages["open.begin"] <= stages["open.daemon"]
    assert stages["commit.lock"] + stages["commit.verify"] + stages["commit.end"] <= stages["commit.daemon"]
