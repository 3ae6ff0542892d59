"""Shared-memory segments of dead trainers are reclaimed; those of live ones are never touched.

The trainers are real processes that export chunks through the shm producer and are then SIGKILLed,
so they unlink nothing: exactly what an OOM kill or a crashed rank leaves in /dev/shm.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from support import daemon_node, shm_segments

from colocd.engines.segments import pid_alive, reclaim_dead_segments, segment_creator
from colocd.trainer.producer import Producer

DEADLINE_S = 30.0

# Every daemon's health loop and every new shm producer on the machine reclaims dead trainers' segments: under
# pytest -n, another worker's would unlink this module's before it looks (tests/conftest.py).
pytestmark = pytest.mark.exclusive

_TRAINER = """
import json, sys, time, torch
from colocd.trainer.producer import Producer

producer = Producer("shm")
chunks = [producer.export([("w", torch.full((256,), float(i)))]) for i in range(2)]  # never released
print(json.dumps({"segments": [c.handle["shm_name"] for c in chunks]}), flush=True)
time.sleep(3600)  # alive until the test kills it
"""


class Trainer:
    def __init__(self, proc: asyncio.subprocess.Process, segments: list[str]) -> None:
        self.proc, self.segments = proc, set(segments)

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()


@asynccontextmanager
async def trainer() -> AsyncIterator[Trainer]:
    """A trainer process holding two exported chunks; killed (if still alive) on the way out."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _TRAINER, stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(DEADLINE_S):
            line = await proc.stdout.readline()
        assert line, "the trainer exited before exporting its chunks"
        t = Trainer(proc, json.loads(line)["segments"])
        assert t.segments == shm_segments(t.pid)
        yield t
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGKILL)
        await proc.wait()
        reclaim_dead_segments()  # whatever the test left of it


async def test_a_killed_trainers_segments_are_reclaimed_and_a_live_trainers_are_kept() -> None:
    async with trainer() as dead, trainer() as live:
        await dead.kill()
        assert shm_segments(dead.pid) == dead.segments  # a SIGKILLed trainer unlinks nothing

        reclaimed = reclaim_dead_segments()

        assert dead.segments <= {r.name for r in reclaimed}
        assert all(r.pid == dead.pid and r.nbytes > 0 for r in reclaimed if r.name in dead.segments)
        assert not shm_segments(dead.pid)
        assert shm_segments(live.pid) == live.segments  # still in use: never touched
        assert not {r.name for r in reclaimed} & live.segments


async def test_the_next_trainer_on_the_node_reclaims_them_when_its_shm_producer_starts() -> None:
    async with trainer() as dead:
        await dead.kill()
        producer = Producer("shm")  # what WeightPusher.stream creates for transport "shm"
        try:
            assert not shm_segments(dead.pid)
        finally:
            producer.close()


def _reclaimed_total(metrics: str) -> float:
    for line in metrics.splitlines():
        if line.startswith("colocd_shm_segments_reclaimed_total "):
            return float(line.split()[1])
    return 0.0


async def test_the_daemons_health_loop_reclaims_a_killed_trainers_segments_and_counts_them() -> None:
    async with trainer() as dead, daemon_node([], timeouts={"health_interval_s": 0.1}, ready=False) as node:
        client = node.client
        await dead.kill()
        async with asyncio.timeout(DEADLINE_S):
            while True:  # polled: the health loop runs every 0.1 s
                if not shm_segments(dead.pid) and _reclaimed_total(await client.metrics()) >= len(dead.segments):
                    break
                await asyncio.sleep(0.05)
        assert "colocd_shm_reclaimed_bytes_total" in await client.metrics()


async def test_a_segment_whose_creator_still_holds_it_is_kept_though_its_pid_is_not_ours() -> None:
    # A trainer in another pid namespace (a container sharing /dev/shm) has a pid that means nothing here:
    # its segment is recognised as live by the lock its mapping holds, not by its pid.
    async with trainer() as gone, trainer() as elsewhere:
        await gone.kill()
        reclaim_dead_segments()
        assert not pid_alive(gone.pid)
        name = sorted(elsewhere.segments)[0]
        alias = f"colocd-{gone.pid}-{name.rsplit('-', 1)[1]}"
        os.rename(f"/dev/shm/{name}", f"/dev/shm/{alias}")
        assert segment_creator(alias) == gone.pid

        assert alias not in {r.name for r in reclaim_dead_segments()}
        assert Path(f"/dev/shm/{alias}").exists()  # noqa: ASYNC240 (a stat of tmpfs, not I/O that blocks)

        await elsewhere.kill()  # now its creator is gone for real: the lock went with it
        assert alias in {r.name for r in reclaim_dead_segments()}
        assert not Path(f"/dev/shm/{alias}").exists() and not shm_segments(elsewhere.pid)  # noqa: ASYNC240


def test_only_colocd_segment_names_carry_a_creator() -> None:
    assert segment_creator("colocd-123-0a1b2c3d4e5f") == 123
    for name in ("colocd-unit-123-0a1b", "colocd-0-ab", "colocd-12x-ab", "other-123-ab", "colocd-123-"):
        assert segment_creator(name) is None, name
