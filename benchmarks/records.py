"""Benchmark records on disk: one JSON document per run (no torch, so ``benchmarks.control`` stays light)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["write_record"]


def write_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
