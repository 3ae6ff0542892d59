"""The chunk channel's private directory: a SIGKILLed daemon's is removed by the next one, a live daemon's never."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from colocd.api.channel_dir import PREFIX, ChannelDir, reclaim_dead_channel_dirs

_DAEMON = """
import sys, tempfile, time
tempfile.tempdir = sys.argv[1]
from colocd.api.channel_dir import ChannelDir
d = ChannelDir()
print(d.path, flush=True)
time.sleep(600)
"""


def test_the_directory_of_a_sigkilled_daemon_is_reclaimed_and_a_live_ones_is_kept(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    child = subprocess.Popen([sys.executable, "-c", _DAEMON, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    dead = Path(child.stdout.readline().strip())
    live = ChannelDir()
    try:
        assert reclaim_dead_channel_dirs(str(tmp_path)) == []  # both owners are alive
        os.kill(child.pid, signal.SIGKILL)  # no chance to remove its directory
        child.wait()
        assert dead.is_dir()
        assert reclaim_dead_channel_dirs(str(tmp_path)) == [dead]
        assert not dead.exists() and live.path.is_dir()
        assert {p.name.startswith(PREFIX) for p in tmp_path.iterdir()} == {True}
    finally:
        live.remove()
        child.kill()
    assert not live.path.exists()
