"""``colocd demo --engine KIND`` as the live tiers run it: the README's command, on the tier's own engine install."""

from __future__ import annotations

import os
import re
import subprocess
import sys

CLOSING = re.compile(r"^reward (\d\.\d{3}) → (\d\.\d{3}) \(mean of first/last 3 steps\) on (\w+); every sync verified")


def run_demo(kind: str, steps: int) -> tuple[list[str], float, float]:
    """Run the demo for ``steps`` on the engine this tier installed (COLOCD_<KIND>_PYTHON/_MODEL); return the step
    lines and the closing line's rewards. Fails with the demo's output unless it exits 0."""
    proc = subprocess.run([sys.executable, "-m", "colocd.cli", "demo", "--engine", kind, "--steps", str(steps)],
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    lines = proc.stdout.strip().splitlines()
    closing = CLOSING.match(lines[-1])
    assert closing is not None and closing[3] == kind, lines[-1]
    step_lines = [line for line in lines if re.match(r"^\s+\d+\s", line)]
    return step_lines, float(closing[1]), float(closing[2])
