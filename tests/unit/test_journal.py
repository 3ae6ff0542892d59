"""The journal: a snapshot plus a tail, bounded whatever the run length, written off the caller's thread."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path
from typing import Any

import pytest
from support import in_process_daemon

from colocd.daemon import journal as journal_module
from colocd.daemon.journal import KEEP_COMPLETED, Journal
from colocd.daemon.states import NodePhase
from colocd.engines.base import EngineInfo, Observation, ReleaseReport
from colocd.engines.processes import LaunchRecord
from colocd.policies import Transport


def state(step: int) -> dict[str, object]:
    return {"event": "rollout", "node": {"phase": "rollout", "step": step}, "engines": {"e": {"step": step}}}


def adapter(version: int) -> dict[str, object]:
    return {"name": f"p@{version}", "folder": f"/adapters/p@{version}", "nbytes": 10, "engines": ["e"]}


async def test_a_long_run_keeps_the_file_bounded_and_a_reopened_journal_knows_everything(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path, compact_every=16)
    record = LaunchRecord("e", pid=123, start_time=456, url="http://127.0.0.1:9", pgid=123, log=None)
    journal.record_launch(record)
    for step in range(1, 201):
        journal.append(state(step))
        journal.record_completed(step, "rollout", {"duration_s": 0.1, "engines": {}})
        journal.record_adapters([adapter(step - 1), adapter(step)], [], [f"p@{step - 2}"] if step > 1 else [])
    await journal.drain()
    journal.close()
    assert len(path.read_text().splitlines()) <= 17
    again = Journal(path)
    assert again.last() == {"ts": again.last()["ts"], **state(200)}  # type: ignore[index]
    assert again.launches() == {"e": record}
    done = again.completed()
    assert len(done) == KEEP_COMPLETED and done[-1]["step"] == 200 and done[0]["step"] == 201 - KEEP_COMPLETED
    assert again.adapters() == {"loaded": [adapter(199), adapter(200)], "lingering": [],
                                "retired": [f"p@{step}" for step in range(199)]}  # each name once, oldest first


async def test_a_stopped_engine_leaves_nothing_to_adopt(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.record_launch(LaunchRecord("e", pid=1, start_time=2, url="http://127.0.0.1:9", pgid=1))
    journal.launch_ended("e")
    await journal.drain()
    assert Journal(path).launches() == {}


def test_a_torn_last_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "journal.jsonl"
    path.write_text(json.dumps({"kind": "state", **state(1)}) + "\n" + '{"kind": "state", "node": {"pha')
    assert Journal(path).last()["node"] == {"phase": "rollout", "step": 1}  # type: ignore[index]


async def test_append_returns_before_the_write_reaches_the_disk(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()
    real_fsync = journal_module.os.fsync

    def slow_fsync(fd: int) -> None:
        assert release.wait(10), "the test never released the fsync"
        real_fsync(fd)

    monkeypatch.setattr(journal_module.os, "fsync", slow_fsync)
    journal = Journal(tmp_path / "journal.jsonl")
    journal.append(state(1))  # would block here, on the caller's (event-loop) thread, if written inline
    assert journal.last() is not None  # what the daemon reads back is there at once
    release.set()
    await asyncio.wait_for(journal.drain(), 10)
    journal.close()
    assert "rollout" in (tmp_path / "journal.jsonl").read_text()


class _Engine:
    """The least an engine must answer for a daemon to run ``train``."""

    transports = frozenset({Transport.SHM})

    async def attach(self) -> EngineInfo:
        return EngineInfo("e0", "fake", "0", "fake", "v0")

    async def observe(self) -> Observation:
        return Observation(incarnation="one", weight_version="v0")

    async def pause_generation(self, mode: Any) -> None: ...
    async def flush_cache(self) -> bool:
        return True

    async def release_memory(self, tags: Any) -> ReleaseReport:
        return ReleaseReport(tags)

    async def memory_report(self) -> None:
        return None

    async def aclose(self) -> None: ...


async def test_a_finished_transition_repeated_after_a_daemon_restart_is_replayed(tmp_path: Path) -> None:
    journal = str(tmp_path / "journal.jsonl")
    async with in_process_daemon({"e0": _Engine()}, journal=journal) as first:
        done = await first.transitions.transition(NodePhase.TRAIN, 1)
    async with in_process_daemon({"e0": _Engine()}, journal=journal) as second:
        again = await second.transitions.transition(NodePhase.TRAIN, 1)
    assert again.replayed is True and (again.step, again.phase) == (1, "train")
    assert again.engines == done.engines and again.freed_bytes == done.freed_bytes
