"""A reply that reports a state change comes once that state is on disk: a daemon killed right after it restarts in
that state, and a journal that cannot be written is the caller's 507 naming the file, never a silent success."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from support import DEADLINE_S, daemon_node

from colocd.api.client import ColocdHTTPError
from colocd.daemon import journal as journal_module
from colocd.daemon.journal import Journal

HELD_S = 1.0  # how long a reply must stay unanswered while its record's write is held


def _recorded(path: Path) -> dict[str, Any] | None:
    last = Journal(path).last()
    return None if last is None else dict(last["node"])


async def test_a_daemon_killed_right_after_a_transitions_reply_restarts_in_that_transitions_state(
        pooled_engine: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    async with daemon_node({"ref0": str(pooled_engine.url)}, subprocess=True, workdir=tmp_path,
                           journal=str(journal)) as node:
        await node.client.phase("train", 1)
        assert _recorded(journal) == {"phase": "train", "step": 1}  # on disk when the reply arrives
        await node.kill()
        await node.restart()
        assert (await node.client.status())["node"] == {"phase": "train", "step": 1}


async def test_a_transitions_reply_waits_for_its_journal_record_to_be_written(
        pooled_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    journal = tmp_path / "journal.jsonl"
    release, held = threading.Event(), threading.Event()
    write = journal_module._append_line

    def slow_disk(path: Path, line: str) -> None:
        if '"event": "train"' in line:  # the train transition's state record: its write takes until released
            held.set()
            release.wait(DEADLINE_S)
        write(path, line)

    monkeypatch.setattr(journal_module, "_append_line", slow_disk)
    async with daemon_node({"ref0": str(pooled_engine.url)}, journal=str(journal)) as node:
        reply = asyncio.create_task(node.client.phase("train", 1))
        try:
            assert await asyncio.to_thread(held.wait, DEADLINE_S), "the transition never wrote its record"
            done, _ = await asyncio.wait({reply}, timeout=HELD_S)
            assert not done, "the transition answered before its journal record was on disk"
        finally:
            release.set()
        assert (await reply)["phase"] == "train"
        assert _recorded(journal) == {"phase": "train", "step": 1}


async def test_a_journal_that_cannot_be_written_fails_the_reply_naming_its_file_and_a_repeat_writes_it(
        pooled_engine: Any, tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    async with daemon_node({"ref0": str(pooled_engine.url)}, journal=str(journal)) as node:
        journal.unlink(missing_ok=True)
        journal.mkdir()  # the next record cannot be written: its file is a directory now
        with pytest.raises(ColocdHTTPError) as err:
            await node.client.phase("train", 1)
        assert err.value.status == 507, err.value.body
        assert (err.value.error, err.value.body["journal"]) == ("JournalFailed", str(journal))
        assert str(journal) in err.value.body["message"]

        journal.rmdir()  # the disk is fixed: the repeat writes the record, then replays the result
        assert (await node.client.phase("train", 1))["replayed"] is True
        assert _recorded(journal) == {"phase": "train", "step": 1}
