"""Run a command that dies with the process that started it: ``python -m colocd.engines.tether PPID -- CMD...``.

A Ray actor that is killed (``ray.kill``, its job ending, its node removed) gets no chance to stop its
children, and a daemon or engine left behind would keep GPU memory and ports. Linux can deliver a
signal to a child when its parent dies (``PR_SET_PDEATHSIG``); the flag survives ``exec``, so this
sets it and then becomes the command (same pid: the pid a supervisor reports is the command's own).

The flag names the parent only, so the tether is applied at every level: a supervisor whose environment has
``COLOCD_TETHER=1`` tethers every child it starts (``engines/processes.py``). The kernel signals when the *thread*
that forked the child exits; colocd spawns from its event-loop thread, which lives as long as the process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import sys

__all__ = ["TETHER_ENV", "tether_prefix"]

TETHER_ENV = "COLOCD_TETHER"  # "1": every child this process's supervisor starts is tethered to it

_PR_SET_PDEATHSIG = 1


def tether_prefix(parent_pid: int | None = None) -> list[str]:
    """The argv prefix that ties a child to ``parent_pid`` (default: this process)."""
    return [sys.executable, "-m", "colocd.engines.tether", str(parent_pid or os.getpid()), "--"]


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m colocd.engines.tether PARENT_PID -- COMMAND [ARGS...]", file=sys.stderr)
        return 2
    parent = int(argv[0])
    libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        print(f"tether: prctl failed: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    if os.getppid() != parent:  # the parent died before the flag was set: nothing would deliver it
        return 1
    os.execvp(argv[2], argv[2:])
    return 1  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
