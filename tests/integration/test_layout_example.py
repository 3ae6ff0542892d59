"""deploy/examples/layouts.py, the runnable CPU example of docs/client.md's layouts guide, runs as documented."""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "layouts.py"
DEADLINE_S = 240


async def test_the_two_ranks_one_tp2_engine_example_runs_and_every_engine_rank_holds_the_trainers_weights() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(EXAMPLE), "--layout", "2x1tp2", "--steps", "2",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        async with asyncio.timeout(DEADLINE_S):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode()
    assert proc.returncode == 0, text[-4000:]
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert lines[0] == {"layout": "2x1tp2", "ranks": 2, "engines": {"e0": ["cpu:0", "cpu:1"]}}
    steps = lines[1:]
    assert [s["step"] for s in steps] == [1, 2] and all(s["ok"] for s in steps), steps
    assert all(s["sources"] == {"e0": [0, 1]} and s["feeds"] == {"0": ["e0/tp0"], "1": ["e0/tp1"]} for s in steps)
    assert all(s["engine_rank_checksums_match"] == {"e0": [True, True]} for s in steps)
