"""A real vLLM server SIGKILLed and started again between steps, with the daemon watching (issue 9).

The daemon sees the new process (the colocd worker extension's boot id), puts it back to sleep as
``train`` wants, marks its weights stale, and the next step re-syncs it with no call made by hand.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import Any

import httpx
import pytest
from support import daemon_node
from vllm_live import VLLMHttp

from colocd.api.client import ColocdHTTPError
from colocd.engines.config import VLLMEngineConfig
from colocd.engines.vllm.launcher import launch_vllm
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.vllm

HEALTH_S = 0.5


async def _complete(url: str) -> str:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        r = await http.post(f"{url}/v1/completions", json={
            "model": "tiny", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "ignore_eos": True})
        r.raise_for_status()
        return str(r.json()["choices"][0]["text"])


async def test_vllm_restarted_during_train_is_put_back_to_sleep_and_resynced_by_the_next_push(
        vllm_launch_config: VLLMEngineConfig, new_weights: list[Any]) -> None:
    server = await launch_vllm(vllm_launch_config)
    url = server.url
    try:
        original = await _complete(url)
        engine = vllm_launch_config.model_copy(update={"url": url}).model_dump(mode="json", exclude={"launch"})
        async with daemon_node([engine], timeouts={"health_interval_s": HEALTH_S}) as node, \
                httpx.AsyncClient(trust_env=False, timeout=60) as http:
            daemon = node.client
            await daemon.phase("train", 1)
            await daemon.phase("sync", 1)
            await WeightPusher(daemon, bucket_mb=1).push(new_weights, version="step-1", step=1)
            await daemon.phase("rollout", 1)
            trained = await _complete(url)
            assert trained != original
            await daemon.phase("train", 2)

            before = (await daemon.status())["engines"]["tiny"]
            assert server.process.pid is not None
            os.killpg(server.process.pid, signal.SIGKILL)
            await server.process.stop()
            async with asyncio.timeout(30):  # the health loop's next tick finds it gone
                while (tiny := (await daemon.status())["engines"]["tiny"])["healthy"]:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)  # status poll cadence, bounded by the timeout
            # Dead: what it serves and holds is not known, whatever the record said (clean, paused, released).
            assert (tiny["weights"], tiny["generation"], set(tiny["tags"].values())) == \
                ("unknown", "unknown", {"unknown"}), tiny
            assert tiny["last_known"] == {k: before[k] for k in ("generation", "weights", "weight_version", "tags")}
            server = await launch_vllm(vllm_launch_config.model_copy(update={"url": url}))  # on the same port
            assert server.url == url

            t0 = time.monotonic()
            async with asyncio.timeout(30):
                while True:
                    last = (await daemon.status())["reconcile"]["last"].get("tiny") or {}
                    if last.get("restarted") and last.get("ok"):
                        break
                    await asyncio.sleep(0.1)  # status poll cadence, bounded by the timeout
            detected_s = time.monotonic() - t0
            assert last["actions"] == ["pause", "release"] and last["release"] == ["weights", "kv_cache"]
            assert (await http.get(f"{url}/is_sleeping")).json()["is_sleeping"] is True
            tiny = (await daemon.status())["engines"]["tiny"]
            assert (tiny["weights"], tiny["generation"], tiny["weight_version"], tiny["last_error"]) == \
                ("stale", "paused", "default", None)
            with pytest.raises(ColocdHTTPError):
                await daemon.phase("rollout", 2)  # not the legal next move, and the weights are stale

            await daemon.phase("sync", 2)
            await WeightPusher(daemon, bucket_mb=1).push(new_weights, version="step-2", step=2)
            await daemon.phase("rollout", 2)
            vllm = VLLMHttp(url, http)
            assert await vllm.received(new_weights)
            assert await vllm.weight_version() == "step-2"
            assert await _complete(url) == trained
            assert 'colocd_engine_restarts_total{engine="tiny"} 1.0' in await daemon.metrics()
            print(f"vLLM restart detected {detected_s:.2f}s after the new server answered /health")
    finally:
        await server.process.stop()
