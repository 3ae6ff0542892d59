"""The product's import path carries none of the lab: the benches, the benchmark sink and the timeline
renderer (``colocd.bench``) load only when a command that uses them runs."""

from __future__ import annotations

import subprocess
import sys


def test_the_daemon_the_api_and_the_cli_import_nothing_of_colocd_bench() -> None:
    code = ("import sys, colocd.daemon.node, colocd.api.app, colocd.cli, colocd.engines.reference.server; "
            "print(sorted(m for m in sys.modules if m.startswith('colocd.bench')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
