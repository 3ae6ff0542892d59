"""Engines a previous daemon launched: what it recorded about each, and whether that process is still there.

    record = LaunchRecord.of("ref0", pid, url="http://127.0.0.1:31000", log="/var/log/ref0.log")
    journal.record_launch(record)                # daemon/journal.py: durable before the engine is waited for
    ...                                          # the daemon is SIGKILLed; a new one starts on the same journal
    if record.alive():                           # same pid *and* same start time: not a reused pid
        process = AdoptedProcess(record, label="reference engine")   # watched and stopped like a child

A launch record names one process colocd started: its pid, the kernel's start time of that pid
(``/proc/<pid>/stat`` field 22, clock ticks since boot; a pid the kernel reused has another one),
the URL it listens on, its process group (each engine leads its own: pgid == pid) and its log. A
restarted daemon adopts a recorded engine that is still alive and answers on its URL, and stops
(its whole process group) one that is alive but does not answer, before it launches another: one
engine per config entry, and the port free for the new one.

An adopted engine is not this process's child, so its exit status is unknown; it is watched
through a pidfd (which also works for a process we did not fork) and stopped through its group.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from .supervisor import POLL_S, group_alive, signal_group, wait_pidfd

__all__ = ["AdoptedProcess", "LaunchRecord", "process_start_time", "stop_group"]

log = logging.getLogger("colocd.supervisor")

_GROUP_GONE_S = 10.0  # after SIGKILL: how long the group's members may take to go


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if no such process (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses; it ends at the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class LaunchRecord:
    """One engine process a daemon launched, as its journal keeps it."""

    engine: str
    pid: int
    start_time: int
    url: str
    pgid: int
    log: str | None = None
    incarnation: str | None = None  # the engine's own (server_info's startup_time), once observed

    @classmethod
    def of(cls, engine: str, pid: int, *, url: str, log: str | None) -> LaunchRecord | None:
        """The record of a process just started; None if it is already gone (nothing to adopt)."""
        start = process_start_time(pid)
        return None if start is None else cls(engine, pid, start, url, pid, log)

    @property
    def port(self) -> int | None:
        return urlsplit(self.url).port

    def alive(self) -> bool:
        """The recorded process still runs: its pid exists with the recorded start time."""
        return process_start_time(self.pid) == self.start_time

    def leftovers(self) -> bool:
        """The leader is gone but members of its process group remain (an engine's own children).

        A pid stays reserved while it names a live process group, so the group is ours; a live
        process under the recorded pid with another start time means the group went long ago.
        """
        return process_start_time(self.pid) is None and group_alive(self.pgid)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchRecord:
        return cls(engine=str(data["engine"]), pid=int(data["pid"]), start_time=int(data["start_time"]),
                   url=str(data["url"]), pgid=int(data["pgid"]), log=data.get("log"),
                   incarnation=data.get("incarnation"))


async def stop_group(pgid: int, grace_s: float, *, leader: LaunchRecord | None = None) -> None:
    """SIGTERM the group, wait ``grace_s`` for the leader (when it is still ``leader``), SIGKILL, wait until empty."""
    if leader is None or leader.alive():
        signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                while leader is not None and leader.alive():  # noqa: ASYNC110 - not our child: no exit event
                    await asyncio.sleep(POLL_S)
    signal_group(pgid, signal.SIGKILL)
    try:
        async with asyncio.timeout(_GROUP_GONE_S):
            while group_alive(pgid):  # noqa: ASYNC110 - the kernel offers no event for a group
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        log.warning("process group %d still has members %gs after SIGKILL", pgid, _GROUP_GONE_S)


class AdoptedProcess:
    """A recorded engine process this daemon did not start: the subset of ``ManagedProcess`` supervision uses."""

    def __init__(self, record: LaunchRecord, *, label: str = "engine") -> None:
        self.record = record
        self.name = record.engine
        self.label = label
        self.pid: int | None = record.pid
        self.log_path: Path | None = Path(record.log) if record.log else None
        self.returncode: int | None = None  # not our child: its exit status never reaches us

    @property
    def running(self) -> bool:
        return self.record.alive()

    async def wait_exit(self) -> int | None:
        """Return once the process is gone; its exit status is unknown (None)."""
        try:
            pidfd = os.pidfd_open(self.record.pid)
        except ProcessLookupError:
            return None
        except (AttributeError, OSError):  # no pidfd (old kernel): poll
            while self.record.alive():  # noqa: ASYNC110 - no exit event to await without a pidfd
                await asyncio.sleep(POLL_S)
            return None
        try:
            if not self.record.alive():  # the pid was reused before the pidfd pinned it
                return None
            await wait_pidfd(pidfd)
        finally:
            os.close(pidfd)
        return None

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM its group, SIGKILL after ``grace_s``, return once the group is gone; idempotent."""
        try:
            await stop_group(self.record.pgid, grace_s, leader=self.record)
        except BaseException:
            signal_group(self.record.pgid, signal.SIGKILL)
            raise
        return None
