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


_WITHOUT_BENCH = """
import importlib.abc, sys
class _NoBench(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "colocd.bench" or name.startswith("colocd.bench."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _NoBench())
from colocd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_an_install_without_colocd_bench_says_so_in_one_line_from_bench_and_trace() -> None:
    for argv in (["bench", "control"], ["trace", "1", "--url", "http://127.0.0.1:9"]):
        out = subprocess.run([sys.executable, "-c", _WITHOUT_BENCH, *argv], capture_output=True, text=True,
                             timeout=120)
        assert (out.returncode, out.stdout) == (2, ""), argv
        assert out.stderr.count("\n") == 1 and "this install has no colocd.bench" in out.stderr, argv
