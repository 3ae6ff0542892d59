"""IPC leases on CPU: an engine SIGKILLed mid-push leaves none of the trainer's shared-memory segments, and the
daemon's ``colocd_ipc_*`` series say what the trainer holds.

Real processes: a reference engine (its own process, killed outright) that loads shm chunks as vLLM's colocd
worker extension does (``LoadsShm``), the daemon in this process, and the trainer's pusher beside it.
The GPU twin of this spec (torch's CUDA IPC limbo) is tests/gpu/test_ipc_leases.py.
"""

from __future__ import annotations

import asyncio
import gc
import os
import re
import signal
import time
from typing import Any

import pytest
from support import daemon_node, reference_engine, shm_segments

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher

BACK_WITHIN_S = 5.0


def gauge(metrics: str, name: str, rank: int = 0) -> float | None:
    match = re.search(rf'^{name}{{rank="{rank}"}} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else None


async def test_an_engine_killed_mid_push_leaves_no_trainer_segment_within_5s_and_the_metrics_say_so() -> None:
    # Its own engine: it is killed.
    async with asyncio.timeout(120), reference_engine(device="cpu") as engine:
        async with daemon_node({"ref0": str(engine.url)}, loads_shm=True, timeouts={"chunk_s": 20}) as daemon:
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


async def test_a_push_that_is_its_clients_last_call_reports_its_leases_before_the_client_closes(
        pooled_engine: Any) -> None:
    loop = asyncio.get_running_loop()
    unhandled: list[dict[str, Any]] = []  # "Task exception was never retrieved", and the like
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: unhandled.append(context))
    try:
        async with daemon_node({"ref0": str(pooled_engine.url)}, loads_shm=True) as daemon:
            async with AsyncColocdClient(daemon.url) as client:
                await client.phase("train", 1)
                await client.phase("sync", 1)
                named = list(build_model(QwenLikeConfig(), seed=1).named_parameters())
                await WeightPusher(client, transport="shm", bucket_mb=0.05).push(named, version="v1", step=1)
            left = [t for t in asyncio.all_tasks() if "_send_lease_reports" in repr(t.get_coro())]
            assert not left, f"the push's tasks outlive its client: {left}"
            assert gauge(await daemon.client.metrics(), "colocd_ipc_exported_bytes") == 0.0
            gc.collect()  # a task that failed unobserved is reported when it is collected
            await asyncio.sleep(0)  # the loop runs the handler of what the collection found
    finally:
        loop.set_exception_handler(previous)
    assert not unhandled, unhandled
