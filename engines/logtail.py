"""Read the end of a child process's log file: what launch errors show the operator."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["read_tail"]


def read_tail(path: str | os.PathLike[str], nbytes: int) -> str:
    """The last ``nbytes`` of the file, decoded leniently; a note instead of an error if unreadable."""
    try:
        with open(Path(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"
