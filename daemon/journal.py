"""The daemon's journal: a snapshot plus a tail of JSON lines, so a restarted daemon knows where it was.

Each line is a record of one ``kind`` (state, launch, launch_ended, completed, adapters) folded into one
``JournalState``; a ``snapshot`` line is a whole state. Every ``COMPACT_EVERY`` records the file is replaced
(write, fsync, rename) by one snapshot line, so its size stays bounded. Applying a record twice gives the same
state, so a crash between any two steps of the compaction loses nothing.

Writes and fsyncs run in order on one worker thread; the in-memory state is updated at once. Each write returns
a future done once the record is on disk: a reply that reports a state change awaits it (``written``), so a
daemon SIGKILLed after the reply restarts on that state; a record nobody was told about yet (a health-loop
reconcile) may be lost, as if the daemon had died a moment earlier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engines.processes import LaunchRecord
from ..errors import JournalFailed

__all__ = ["COMPACT_EVERY", "KEEP_RETIRED_ADAPTERS", "Journal", "JournalState", "NodeJournal"]

log = logging.getLogger("colocd.daemon")

COMPACT_EVERY = 128  # records appended after a snapshot before the file is compacted into a new one
KEEP_COMPLETED = 64  # finished transition results kept (a trainer repeats the last one or two)
KEEP_RETIRED_ADAPTERS = 4096  # retired adapter names remembered for a 410 (older ones answer 404)


@dataclass
class JournalState:
    """Everything the journal says, folded from its records."""

    state: dict[str, Any] | None = None  # the last "state" record: {event, node, engines}
    launched: dict[str, dict[str, Any]] = field(default_factory=dict)  # engine name -> LaunchRecord json
    completed: list[dict[str, Any]] = field(default_factory=list)  # {step, phase, result}, oldest first
    # {loaded: [version json], lingering: [version json], retired: [name]}: each record carries the versions whole
    # (a few) and only the names it retired (thousands over a run), deduplicated so a replay changes nothing.
    adapters: dict[str, list[Any]] = field(default_factory=dict)

    def apply(self, record: dict[str, Any]) -> None:
        kind = record.get("kind", "state")  # a line without a kind is a state record (older journals)
        if kind == "snapshot":
            self.state = record.get("state")
            self.launched = dict(record.get("launched") or {})
            self.completed = list(record.get("completed") or [])
            self.adapters = dict(record.get("adapters") or {})
        elif kind == "state":
            self.state = {k: v for k, v in record.items() if k != "kind"}
        elif kind == "launch":
            self.launched[str(record["record"]["engine"])] = record["record"]
        elif kind == "launch_ended":
            self.launched.pop(str(record["engine"]), None)
        elif kind == "completed":
            key = (record["step"], record["phase"])
            self.completed = [c for c in self.completed if (c["step"], c["phase"]) != key]
            self.completed.append({"step": record["step"], "phase": record["phase"], "result": record["result"]})
            del self.completed[:-KEEP_COMPLETED]
        elif kind == "adapters":
            retired = self.adapters.get("retired", [])
            known = set(retired)
            retired = [*retired, *(n for n in record["retired"] if n not in known)][-KEEP_RETIRED_ADAPTERS:]
            self.adapters = {"loaded": record["loaded"], "lingering": record["lingering"], "retired": retired}

    def snapshot(self) -> dict[str, Any]:
        return {"kind": "snapshot", "ts": time.time(), "state": self.state, "launched": self.launched,
                "completed": self.completed, "adapters": self.adapters}


class Journal:
    """One writer (this daemon); the file is re-read only when a daemon starts. Without a file (``path`` None) it
    folds its records in memory, writes nothing and replays nothing."""

    def __init__(self, path: str | Path | None, *, compact_every: int = COMPACT_EVERY) -> None:
        self.path = Path(path) if path is not None else None
        self._compact_every = compact_every
        self._folded = JournalState()
        self._since_snapshot = 0
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            for record in _read_records(self.path):
                self._folded.apply(record)
                self._since_snapshot += 1
        self._writer: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future[None] | None = None

    def last(self) -> dict[str, Any] | None:
        return self._folded.state

    def launches(self) -> dict[str, LaunchRecord]:
        return {name: LaunchRecord.from_json(r) for name, r in self._folded.launched.items()}

    def completed(self) -> list[dict[str, Any]]:
        """Finished transitions, oldest first: ``{step, phase, result}``."""
        return list(self._folded.completed)

    def adapters(self) -> dict[str, list[Any]]:
        """The adapter versions loaded and lingering (``AdapterVersion`` json), the names retired, oldest first."""
        return dict(self._folded.adapters)

    def append(self, record: dict[str, Any]) -> concurrent.futures.Future[None]:
        """Record node/engine state; the returned future is done once it is on disk."""
        return self._write({"kind": "state", **record})

    def record_completed(self, step: int, phase: str, result: dict[str, Any]) -> concurrent.futures.Future[None]:
        return self._write({"kind": "completed", "step": step, "phase": phase, "result": result})

    def record_launch(self, record: LaunchRecord) -> concurrent.futures.Future[None]:
        return self._write({"kind": "launch", "record": record.to_json()})

    def record_adapters(self, loaded: list[dict[str, Any]], lingering: list[dict[str, Any]],
                        retired: list[str]) -> concurrent.futures.Future[None]:
        """``retired``: the names retired since the last such record."""
        return self._write({"kind": "adapters", "loaded": loaded, "lingering": lingering, "retired": retired})

    def launch_ended(self, engine: str) -> concurrent.futures.Future[None]:
        return self._write({"kind": "launch_ended", "engine": engine})

    async def written(self, future: concurrent.futures.Future[None]) -> None:
        """Return once ``future``'s record (and so every one before it) is on disk; ``JournalFailed``, naming
        this journal's file, if it cannot be. A cancelled caller leaves the write queued: later records follow it."""
        try:
            await asyncio.shield(asyncio.wrap_future(future))
        except OSError as exc:
            raise JournalFailed(f"journal {self.path}: the record was not written ({exc}); the state change it "
                                "records happened but a restarted daemon would not know it", path=str(self.path)) \
                from exc

    async def drain(self) -> None:
        """Return once every record written so far is on disk or failed (logged; ``written`` raises it)."""
        if (pending := self._pending) is not None:
            with contextlib.suppress(OSError):
                await asyncio.shield(asyncio.wrap_future(pending))

    def close(self) -> None:
        """Wait for the queued writes and stop the writer thread (a later write starts another)."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.shutdown(wait=True)

    def _write(self, record: dict[str, Any]) -> concurrent.futures.Future[None]:
        record = {"ts": time.time(), **record}
        self._folded.apply(record)
        self._since_snapshot += 1
        if (path := self.path) is None:
            done: concurrent.futures.Future[None] = concurrent.futures.Future()
            done.set_result(None)
            return done
        job: Callable[[Path, str], None]
        if self._since_snapshot > self._compact_every:
            # The snapshot is taken here, in order with the state it follows; the thread only writes it.
            text, job = json.dumps(self._folded.snapshot(), sort_keys=True, default=str), _replace
            self._since_snapshot = 1
        else:
            text, job = json.dumps(record, sort_keys=True, default=str), _append_line
        if self._writer is None:
            self._writer = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="colocd-journal")
        future = self._writer.submit(job, path, text)
        future.add_done_callback(_log_failure)
        self._pending = future
        return future


class NodeJournal:
    """What the daemon journals of the node: ``state()`` (``{"node", "engines"}``) and its finished transitions."""

    def __init__(self, journal: Journal, state: Callable[[], dict[str, Any]]) -> None:
        self.file, self._state = journal, state

    def append(self, what: str) -> None:
        """Queue the node's state (written in order, off the loop): for a change no reply reports (a reconcile)."""
        self.file.append({"event": what, **self._state()})

    async def written(self, what: str) -> None:
        """Record the node's state; return once it is on disk (``JournalFailed`` naming the file if it cannot be)."""
        await self.file.written(self.file.append({"event": what, **self._state()}))

    async def completed(self, step: int, phase: str, result: dict[str, Any]) -> None:
        """A finished transition, on disk: a restarted daemon replays it on a repeat."""
        await self.file.written(self.file.record_completed(step, phase, result))


def _write_synced(path: Path, text: str, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | mode, 0o600)
    try:
        os.write(fd, (text + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _append_line(path: Path, line: str) -> None:
    _write_synced(path, line, os.O_APPEND)  # one writer, one line: each durable before the next


def _replace(path: Path, snapshot: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    _write_synced(tmp, snapshot, os.O_TRUNC)
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself is durable
    finally:
        os.close(dir_fd)


def _log_failure(future: concurrent.futures.Future[None]) -> None:
    if not future.cancelled() and (exc := future.exception()) is not None:
        log.error("journal write failed: %s", exc)


def _read_records(path: Path) -> Iterable[dict[str, Any]]:
    """The file's complete records (compaction keeps it small); a torn line (crash mid-write) is skipped."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return []
    records = []
    for raw in data.split(b"\n"):
        try:
            record = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records
