"""Append-only JSON-lines journal of finished transitions, so a restarted daemon knows where it was."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["Journal"]


class Journal:
    """One line per finished transition: node phase/step and every engine's recorded state.

    The daemon re-verifies what it reads here against the engines before acting on it.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        line = json.dumps({"ts": time.time(), **record}, sort_keys=True)
        # O_APPEND writes of one line are atomic enough for a single writer; fsync makes them durable.
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, (line + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def last(self) -> dict[str, Any] | None:
        """The last complete record; a torn final line (crash mid-write) is skipped."""
        if not self.path.exists():
            return None
        last = None
        for raw in self.path.read_text().splitlines():
            try:
                last = json.loads(raw)
            except json.JSONDecodeError:
                continue
        return last
