"""Reclaiming the shared-memory segments of dead trainers: ``colocd-<pid>-*`` whose creator is gone.

A SIGKILLed trainer unlinks nothing, and its segments would hold host memory until the node reboots; the next
trainer's shm producer and the daemon run ``reclaim_dead_segments``. A segment is reclaimed only when its pid (in
the name) is not a live process here and nobody holds the creator's ``flock`` on it (which covers a creator in
another pid namespace sharing /dev/shm). The daemon also unlinks what an uncommitted weight session's chunks named
(``unlink_session_segments``).
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass

from .chunks import SHM_DIR, SHM_NAME_PATTERN
from .processes import process_start_time

__all__ = ["ReclaimedSegment", "pid_alive", "reclaim_dead_segments", "segment_creator", "unlink_session_segments"]


@dataclass(frozen=True, slots=True)
class ReclaimedSegment:
    """A segment that was unlinked: its name, the dead creator's pid and the bytes it held."""

    name: str
    pid: int
    nbytes: int


def segment_creator(name: str) -> int | None:
    """The creator's pid of a segment named ``colocd-<pid>-<hex>``; None for any other name."""
    match = SHM_NAME_PATTERN.match(name)
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
    return process_start_time(pid) is not None


def reclaim_dead_segments() -> list[ReclaimedSegment]:
    """Unlink every ``colocd-<pid>-*`` segment whose creator is dead; returns them. Safe from any process at any
    time (a reader that still maps an unlinked segment keeps its mapping)."""
    try:
        names = sorted(os.listdir(SHM_DIR))
    except FileNotFoundError:
        return []  # no /dev/shm on this platform: nothing to reclaim
    reclaimed = []
    for name in names:
        pid = segment_creator(name)
        if pid is None or pid == os.getpid() or pid_alive(pid):
            continue
        seg = _unlink(name, pid, require_unlocked=True)
        if seg is not None:
            reclaimed.append(seg)
    return reclaimed


def unlink_session_segments(names: Iterable[str], trainer_pids: Collection[int]) -> list[ReclaimedSegment]:
    """Unlink, of the segments an uncommitted session's chunks named, those provably its trainer's (colocd's naming,
    and a pid in ``trainer_pids`` or a dead and unlocked creator); returns them. A caller must not be able to delete
    another program's shared memory by naming it."""
    unlinked = []
    for name in sorted(set(names)):
        pid = segment_creator(name)
        if pid is None:
            continue  # not colocd's naming: never ours to remove
        if pid in trainer_pids:
            seg = _unlink(name, pid, require_unlocked=False)
        elif pid != os.getpid() and not pid_alive(pid):
            seg = _unlink(name, pid, require_unlocked=True)
        else:
            continue  # a live process the trainer did not prove to be: another colocd program's segment
        if seg is not None:
            unlinked.append(seg)
    return unlinked


def _unlink(name: str, pid: int, *, require_unlocked: bool) -> ReclaimedSegment | None:
    """Unlink one segment, a plain file only; with ``require_unlocked``, only if nobody holds its creator's lock."""
    path = os.path.join(SHM_DIR, name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None  # gone already, another user's, or not a plain file
    try:
        if require_unlocked:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # its creator lives on in another pid namespace
        nbytes = os.fstat(fd).st_size
        try:
            os.unlink(path)
        except OSError:
            return None  # gone meanwhile, or not ours to remove
        return ReclaimedSegment(name, pid, nbytes)
    finally:
        os.close(fd)
