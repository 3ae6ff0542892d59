"""IPC leases on CPU: an engine SIGKILLed mid-push leaves none of the trainer's shared-memory segments, and the
daemon's ``colocd_ipc_*`` series say what the trainer holds.

Real processes: a reference engine (its own process, killed outright), the daemon in this process, and the
trainer's pusher beside it. The GPU twin of this spec (torch's CUDA IPC limbo) is tests/gpu/test_ipc_leases.py.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import pytest
from support import daemon_node, reference_engine, shm_segments

from colocd.api.client import ColocdHTTPError
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

BACK_WITHIN_S = 5.0


def gauge(metrics: str, name: str, rank: int = 0) -> float | None:
    match = re.search(rf'^{name}{{rank="{rank}"}} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else None


async def test_an_engine_killed_mid_push_leaves_no_trainer_segment_within_5s_and_the_metrics_say_so() -> None:
    # Its own engine: it is killed.
    async with asyncio.timeout(120), reference_engine(device="cpu") as engine:
        async with daemon_node({"ref0": str(engine.url)}, timeouts={"chunk_s": 20}) as daemon:
            client = daemon.client
            await client.phase("train", 1)
            await client.phase("sync", 1)
            named = list(build_model(QwenLikeConfig(), seed=1).named_parameters())
            pusher = WeightPusher(client, transport="shm", bucket_mb=0.005, depth=3)  # a chunk per tensor
            push = asyncio.create_task(pusher.push(named, version="v1", step=1))
            while not shm_segments() and not push.done():  # noqa: ASYNC110 (the push's first export, bounded)
                await asyncio.sleep(0.001)
            assert not push.done(), "the push ended before its first segment was seen"
            assert engine.pid is not None
            os.kill(engine.pid, signal.SIGKILL)  # the engine's crash, with the trainer's segments in flight
            killed_at = time.monotonic()
            with pytest.raises(ColocdHTTPError):
                await push

            while True:
                metrics = await client.metrics()
                reported = (gauge(metrics, "colocd_ipc_exported_bytes"), gauge(metrics, "colocd_ipc_retained_bytes"))
                if not shm_segments() and reported == (0.0, 0.0):
                    break
                assert time.monotonic() - killed_at < BACK_WITHIN_S, (
                    f"{BACK_WITHIN_S}s after the kill: segments {sorted(shm_segments())}, (exported, retained) "
                    f"reported {reported}")
                await asyncio.sleep(0.02)  # polling the trainer's cleanup and its report, bounded above
            await pusher.aclose()
