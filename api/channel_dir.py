"""The chunk channel's private directory (``$TMPDIR/colocd-chunks-*``), and reclaiming those of dead daemons.

A daemon that exits removes its directory; one that is SIGKILLed cannot. So each directory holds an
``owner.lock`` that its daemon keeps ``flock``ed while it runs (the kernel drops the lock when the
process dies, however it dies), and the next daemon to start removes every such directory of this
user whose lock it can take. A directory without the lock file is left alone unless it is older than
``UNLOCKED_GRACE_S`` (a daemon between ``mkdtemp`` and taking its lock is not dead).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

__all__ = ["PREFIX", "ChannelDir", "reclaim_dead_channel_dirs"]

log = logging.getLogger("colocd.api")

PREFIX = "colocd-chunks-"
LOCK_NAME = "owner.lock"
UNLOCKED_GRACE_S = 60.0


class ChannelDir:
    """A fresh private (0700) directory, locked as this process's for as long as it is open."""

    def __init__(self) -> None:
        self.path = Path(tempfile.mkdtemp(prefix=PREFIX))
        self._fd: int | None = os.open(self.path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def reclaim_dead_channel_dirs(root: str | None = None) -> list[Path]:
    """Remove this user's channel directories whose daemon is gone; returns them."""
    root_path = Path(root or tempfile.gettempdir())
    removed = []
    for entry in root_path.glob(f"{PREFIX}*"):
        with contextlib.suppress(OSError):
            if not entry.is_dir() or entry.is_symlink() or entry.stat().st_uid != os.getuid():
                continue
            if _owner_dead(entry):
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(entry)
                log.info("removed chunk-channel directory %s of a daemon that is gone", entry)
    return removed


def _owner_dead(entry: Path) -> bool:
    try:
        fd = os.open(entry / LOCK_NAME, os.O_RDWR)
    except FileNotFoundError:
        return time.time() - entry.stat().st_mtime > UNLOCKED_GRACE_S
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False  # its daemon holds it: alive
    finally:
        os.close(fd)  # closing drops the lock we may have taken
    return True
