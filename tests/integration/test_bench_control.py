"""``python3 -m benchmarks.control``, run from the checkout, goes end to end (real daemon, reference engine, reader
process) and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]


def test_bench_control_smoke_run_prints_the_table_and_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.control", "--samples", "10", "--warmup-cycles", "1",
         "--cycles", "2", "--blocks", "2", "--readers", "4", "--out", str(out)],
        capture_output=True, text=True, timeout=600, cwd=CHECKOUT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "/v1/status" in proc.stdout and "4 concurrent readers" in proc.stdout
    record = json.loads(out.read_text())
    assert {"/healthz", "/v1/status", "/metrics"} <= set(record["reads"])
    assert record["reads"]["/metrics"]["bytes"] > record["reads"]["/healthz"]["bytes"]
    assert record["transitions"]["idle"]["n"] == record["transitions"]["with_readers"]["n"] == 6
    assert record["readers"]["errors"] == 0 and record["readers"]["paths"]["/v1/status"]["n"] > 0
    assert set(record["ratios"]) == set(record["targets"]) == set(record["met"])
    assert record["command"].startswith("python3 -m benchmarks.control --samples 10 ")
