"""The lab beside the product: benches run from a checkout, never installed, and nothing in colocd imports them.

    python3 -m benchmarks.weights --help     # one bench; docs/benchmarks.md lists them all and their results

Each bench prints a table, writes a JSON record (``records.write_record``) and measures the physical floor and the
baselines in the same run, so results are ratios. The benches import the product as ``colocd`` (an install of this
checkout, e.g. ``pip install -e .``) and each other relatively; ``offload`` and ``onload`` model a training rank's
state, which ``switch`` drives.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["CHECKOUT", "ShowDefaults"]

CHECKOUT = Path(__file__).resolve().parent.parent
"""The checkout holding ``benchmarks/``: a bench's own child processes start here, so ``-m benchmarks.X`` finds it."""


class ShowDefaults(argparse.HelpFormatter):
    """A bench's ``--help``: appends ``(default: X)`` unless the help already says what leaving it out means."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or action.nargs == 0 or action.default in (None, argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"
