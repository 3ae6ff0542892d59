"""Reclaiming the shared-memory segments of dead trainers: ``colocd-<pid>-*`` whose creator is gone.

A trainer unlinks its segments once the daemon acked them, but a SIGKILLed (or OOM-killed) trainer
unlinks nothing, and its segments would hold host memory until the node reboots. Any process on the
node may run ``reclaim_dead_segments``: the next trainer does when its shm producer starts
(``trainer/producer.py``), and the daemon can on its health loop.

A segment is reclaimed only when both say its creator is gone:
- its pid (in the name) is not a live process here (``kill(pid, 0)``; a zombie counts as dead), and
- nobody holds the creator's ``flock`` on it (``SharedSegment.create`` takes one that lives as long as
  the mapping; the kernel drops it when the process dies).
The lock covers a creator in another pid namespace sharing /dev/shm (a container with ``hostIPC``),
whose pid means nothing here. Segments of other users are left alone (we could not unlink them).
"""

from __future__ import annotations

import fcntl
import os
import re
from dataclasses import dataclass

from .chunks import SEGMENT_PREFIX, SHM_DIR

__all__ = ["ReclaimedSegment", "pid_alive", "reclaim_dead_segments", "segment_creator"]


@dataclass(frozen=True, slots=True)
class ReclaimedSegment:
    """A segment that was unlinked: its name, the dead creator's pid and the bytes it held."""

    name: str
    pid: int
    nbytes: int


def segment_creator(name: str, prefix: str = SEGMENT_PREFIX) -> int | None:
    """The creator's pid of a segment named ``<prefix>-<pid>-<hex>``; None for any other name."""
    match = re.fullmatch(rf"{re.escape(prefix)}-([1-9][0-9]{{0,9}})-[0-9a-f]+", name)
    return int(match.group(1)) if match else None


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` is a live process in this pid namespace (one of another user counts as live)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A killed process whose parent has not reaped it yet still answers kill(0): a zombie maps nothing.
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rpartition(b")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state not in (b"Z", b"X")


def reclaim_dead_segments(directory: str = SHM_DIR, prefix: str = SEGMENT_PREFIX) -> list[ReclaimedSegment]:
    """Unlink every ``<prefix>-<pid>-*`` segment in ``directory`` whose creator is dead; returns them.

    Safe to run from any process at any time: a segment of a live creator, one still locked by its
    creator, one of another user, or one that vanished meanwhile is skipped. A reader that still maps
    an unlinked segment keeps its mapping (unlink only removes the name).
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []  # no /dev/shm on this platform: nothing to reclaim
    reclaimed = []
    for name in names:
        pid = segment_creator(name, prefix)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue  # gone already, another user's, or not a plain file
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its creator lives on in another pid namespace
            nbytes = os.fstat(fd).st_size
            try:
                os.unlink(path)
            except (FileNotFoundError, PermissionError):
                continue
            reclaimed.append(ReclaimedSegment(name, pid, nbytes))
        finally:
            os.close(fd)
    return reclaimed
