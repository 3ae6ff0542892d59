"""``colocd top`` at a standard terminal's 80 columns (or piped): every value whole, whole columns left out
and named when they do not fit, the GPU lines kept; at 160 columns everything is shown."""

from __future__ import annotations

import io
from typing import Any

import pytest
from rich.console import Console

from colocd.api.top import Snapshot

GIB = 2**30


def _snapshot() -> Snapshot:
    engines = {
        "sglang-qwen3-8b-0": {"healthy": True, "generation": "serving", "weights": "current",
                              "weight_version": "step-1234567", "protocol": "sglang-0.5.23", "last_error": None,
                              "tags": {"weights": "resident", "kv_cache": "resident", "cuda_graph": "released"}},
        "vllm1": {"healthy": False, "generation": "paused", "weights": "stale", "weight_version": "step-1234566",
                  "protocol": "vllm-0.32.0", "tags": {"weights": "released"},
                  "last_error": "engine vllm1: GET /health: connection refused after 30 s"},
    }
    status = {"node": {"phase": "rollout", "step": 1234567}, "lifecycle": "running", "busy_with": None,
              "policy": {"process_groups": "destroy", "pipeline": "overlap2", "cleanup": "full", "version": 3},
              "engines": engines}
    steps = [{"step": 1234567 - i, "result": "failed" if i == 0 else "ok", "switch_s": 322.5, "bytes": 16_384_000_000,
              "chunks": 1830, "breakdown": {"sleep": 0.1234, "load_weights_memory": 12.345, "update": 308.25,
                                            "wake": 0.5, "cleanup": 1.25, "groups": 0.0312}} for i in range(3)]
    gpus = {"0": {"used": 75.5 * GIB, "free": 64.0 * GIB, "total": 139.5 * GIB},
            "1": {"used": 1.5 * GIB, "free": 138.0 * GIB, "total": 139.5 * GIB}}
    return Snapshot(url="http://127.0.0.1:7000", status=status, steps=steps, gpus=gpus,
                    restarts={"vllm1": 3.0}, taken_at=0.0)


def _frame(width: int, snap: Any = None) -> str:
    out = io.StringIO()
    Console(file=out, width=width, force_terminal=False, color_system=None).print(snap or _snapshot())
    return out.getvalue()


@pytest.mark.parametrize("width", [80, 100, 160])
def test_no_line_is_wider_than_the_terminal_and_nothing_is_cut(width: int) -> None:
    frame = _frame(width)
    assert max(len(line) for line in frame.splitlines()) <= width
    assert "…" not in frame


def test_at_80_columns_every_shown_value_is_whole() -> None:
    frame = _frame(80)
    for value in ("1234567", "1234566", "step-1234567", "sglang-qwen3-8b-0", "322.5s", "308.2s", "12.3s",
                  "123ms", "500ms", "15.3 GiB", "failed"):
        assert value in frame, value
    # The GPU lines survive, each number whole.
    assert any(all(v in line for v in ("75.5 GiB", "64.0 GiB", "139.5 GiB")) for line in frame.splitlines())
    assert any(all(v in line for v in ("1.5 GiB", "138.0 GiB")) for line in frame.splitlines())


def test_at_80_columns_the_columns_left_out_are_named() -> None:
    frame = _frame(80)
    assert "too narrow for:" in frame
    assert "restarts" in frame.split("last steps")[0]  # a crash-looping engine stays visible at 80 columns
    assert "vllm1 last error: engine vllm1: GET /health:" in frame.replace("\n│ ", " ")


def test_at_160_columns_every_column_is_shown() -> None:
    frame = _frame(160)
    assert "too narrow" not in frame
    for header in ("memory tags", "protocol", "restarts", "cleanup", "groups", "chunks", "bytes"):
        assert header in frame, header
    assert "cuda_graph:- kv_cache:R weights:R" in frame and "1250ms" in frame and "1830" in frame
