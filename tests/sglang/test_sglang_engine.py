"""colocd's SGLang adapter against a real SGLang (0.5.20 or 0.5.23) on CPU: every verb the daemon uses, as SGLang
answers it.

One server for the module (each start costs 40-100 s on CI's 2 cores); tests leave it serving its original
weights. What SGLang answers is recorded (conftest.Recorder) for the reference engine's contract test.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest
from sglang_live import (
    FLUSH_WHILE_RETRACTED,
    PROTOCOL_OF,
    LiveServer,
    Recorder,
    checksums,
    differing,
    greedy,
    load_from_disk,
    original_weights,
    save_model,
    step_weights,
)
from support import chunk_part

from colocd.engines.base import ChunkLoad, PauseMode
from colocd.engines.sglang.adapter import SGLangAdapter
from colocd.errors import EngineRejected
from colocd.policies import Transport
from colocd.trainer.producer import Producer

pytestmark = [pytest.mark.sglang, pytest.mark.timeout(900)]

DEADLINE_S = 120


def inline_load(named: list, seq: int = 0, version: str | None = None) -> ChunkLoad:
    chunk = Producer("inline").export(named)
    part = chunk_part(0, Transport.INLINE, chunk.nbytes, chunk.handle)
    return ChunkLoad(seq=seq, payloads=(part,), nbytes=chunk.nbytes, weight_version=version)


async def test_attach_reads_sglangs_server_info_and_observe_derives_a_stable_incarnation(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, recorder: Recorder) -> None:
    info = recorder.record("server_info", await client.get(f"{sglang.url}/server_info")).json()
    recorder.record("model_info", await client.get(f"{sglang.url}/model_info"))
    assert isinstance(info["startup_time"], dict)  # 0.5.20 and 0.5.23: phase durations, not a timestamp
    assert adapter._info is not None and adapter._info.version in PROTOCOL_OF  # a tested release
    assert adapter.protocol.name == PROTOCOL_OF[adapter._info.version]
    assert adapter.transports == {Transport.INLINE}  # on CPU only what it unpickles by value
    first, second = await adapter.observe(), await adapter.observe()
    assert first.incarnation is not None and first.incarnation == second.incarnation
    assert first.weight_version == "default"
    assert first.paused is None and first.update_session_open is None  # SGLang cannot tell: never guessed


async def test_every_pause_mode_closes_ready_and_continue_opens_it(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, recorder: Recorder) -> None:
    for mode in PauseMode:
        await adapter.pause_generation(mode)
        ready = recorder.record(f"ready_paused_{mode.value}", await client.get(f"{sglang.url}/ready"))
        assert ready.status_code == 503, mode
        # colocd's liveness is an observation (server and model info): no generation, so pauses pass.
        assert (await adapter.observe()).incarnation
        await adapter.continue_generation()
        assert (await client.get(f"{sglang.url}/ready")).status_code == 200


async def test_sglangs_own_health_fails_while_paused_and_marks_the_server_unready_until_it_passes(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, recorder: Recorder) -> None:
    # Why colocd never probes /health of a paused SGLang: its one-token generation cannot run, and after
    # HEALTH_CHECK_TIMEOUT it answers 503 and sets the server UnHealthy (http_server.py:786-799), so /ready
    # stays 503 after continue until a /health passes again.
    await adapter.pause_generation(PauseMode.ABORT)
    recorder.record("health_paused", await client.get(f"{sglang.url}/health"))
    await adapter.continue_generation()
    recorder.record("ready_after_failed_health", await client.get(f"{sglang.url}/ready"))
    assert (await client.get(f"{sglang.url}/health")).status_code == 200
    assert (await client.get(f"{sglang.url}/ready")).status_code == 200


async def test_flush_is_refused_while_a_request_decodes_and_done_after_a_retract_pause(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, recorder: Recorder) -> None:
    # Long enough to be caught decoding, short enough for a loaded 2-core machine (~5-25 tokens/s here).
    long = asyncio.create_task(client.post(f"{sglang.url}/generate", timeout=600, json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}}))
    deadline = time.monotonic() + DEADLINE_S
    while await adapter.flush_cache():  # flushed: the request is not decoding yet
        assert not long.done() and time.monotonic() < deadline, "the long request never started decoding"
        await asyncio.sleep(0.05)
    recorder.record("flush_while_decoding", await client.post(f"{sglang.url}/flush_cache"))
    await adapter.pause_generation(PauseMode.RETRACT)
    assert adapter._info is not None
    # Retracted: nothing decodes. 0.5.23 flushes then; 0.5.20 refuses while the request waits in the queue.
    assert await adapter.flush_cache() is FLUSH_WHILE_RETRACTED[adapter._info.version]
    await adapter.continue_generation()
    done = (await long).json()
    assert done["meta_info"]["completion_tokens"] == 400 and done["meta_info"]["num_retractions"] >= 1
    # The request is done: a flush succeeds (the scheduler frees the finished request a moment after its reply).
    async with asyncio.timeout(DEADLINE_S):
        flushed = await adapter.flush_cache()
        while not flushed:
            await asyncio.sleep(0.05)
            flushed = await adapter.flush_cache()


async def test_release_and_resume_by_tag_keep_the_served_output(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, recorder: Recorder) -> None:
    from colocd.engines.base import MemoryTag

    before = await greedy(client, sglang.url)
    await adapter.pause_generation(PauseMode.RETRACT)
    assert await adapter.flush_cache()
    await adapter.release_memory((MemoryTag.KV_CACHE, MemoryTag.WEIGHTS))
    await adapter.resume_memory((MemoryTag.WEIGHTS,))
    await adapter.resume_memory((MemoryTag.KV_CACHE,))
    await adapter.continue_generation()
    assert await greedy(client, sglang.url) == before


async def test_weight_update_sessions_refuse_a_second_begin_a_second_end_and_an_update_outside_one(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, model_dir: Path,
        recorder: Recorder) -> None:
    url = sglang.url
    update = {"serialized_named_tensors": [inline_load(original_weights(model_dir)[:1]).payloads[0].handle.wire[
        "payload_b64"]], "load_format": "flattened_bucket", "flush_cache": False, "abort_all_requests": False}
    if not adapter.protocol.weight_update_session:  # 0.5.20: no session routes, and an update needs none
        assert (await client.post(f"{url}/begin_weight_update", json={"selector": "all"})).status_code == 404
        outside = await client.post(f"{url}/update_weights_from_tensor", json=update)
        assert outside.status_code == 200 and outside.json()["success"] is True
        await adapter.begin_weight_update()
        await adapter.begin_weight_update()  # nothing opened, so nothing refused
        await adapter.end_weight_update()
        return
    recorder.record("update_outside_session", await client.post(f"{url}/update_weights_from_tensor", json=update),
                    request={"load_format": "flattened_bucket", "serialized_named_tensors": ["(inline payload)"]})
    await adapter.pause_generation(PauseMode.RETRACT)
    recorder.record("begin_weight_update", await client.post(f"{url}/begin_weight_update", json={"selector": "all"}),
                    request={"selector": "all"})
    with pytest.raises(EngineRejected) as second:
        await adapter.begin_weight_update()
    assert second.value.status == 400 and "already open" in second.value.detail
    again = await client.post(f"{url}/begin_weight_update", json={"selector": "all"})
    recorder.record("begin_weight_update_again", again, request={"selector": "all"})
    end = f"{url}/end_weight_update"
    recorder.record("end_weight_update", await client.post(end, json={}), request={})
    recorder.record("end_weight_update_again", await client.post(end, json={}), request={})
    with pytest.raises(EngineRejected):
        await adapter.end_weight_update()
    await adapter.continue_generation()
    assert (await client.get(f"{url}/health")).status_code == 200  # refused, and SGLang lives


async def test_an_inline_update_serves_what_sglang_loading_the_checkpoint_itself_serves(
        sglang: LiveServer, adapter: SGLangAdapter, client: httpx.AsyncClient, model_dir: Path,
        tmp_path: Path, recorder: Recorder) -> None:
    url = sglang.url
    original = await checksums(client, url)
    assert original and len(original) >= 10
    before = await greedy(client, url)
    named = step_weights(model_dir, 1)
    await adapter.pause_generation(PauseMode.RETRACT)
    await adapter.begin_weight_update()
    half = len(named) // 2
    await adapter.load_weights(inline_load(named[:half], 0))
    await adapter.load_weights(inline_load(named[half:], 1))
    await adapter.end_weight_update("step-1")
    # The radix cache still holds KV computed by the old weights: a prompt seen before would reuse it.
    assert await adapter.flush_cache()
    await adapter.continue_generation()
    pushed = await checksums(client, url)
    recorder.record("weights_checker", await client.post(f"{url}/weights_checker", json={"action": "checksum"}),
                    request={"action": "checksum"})
    assert pushed is not None and differing(original, pushed) == sorted(original)  # every parameter changed
    served = await greedy(client, url)
    assert served != before
    assert (await adapter.observe()).weight_version == "step-1"

    assert await load_from_disk(client, url, str(save_model(model_dir, named, tmp_path / "step-1")),
                                weight_version="disk-1")
    assert differing(pushed, await checksums(client, url)) == []  # SGLang's own loader agrees
    assert await greedy(client, url) == served
    assert (await adapter.observe()).weight_version == "disk-1"

    # A path that is not there: refused, the old weights stay.
    assert not await load_from_disk(client, url, str(tmp_path / "nowhere"))
    assert differing(pushed, await checksums(client, url)) == []

    assert await load_from_disk(client, url, str(model_dir), weight_version="default")
    assert differing(original, await checksums(client, url)) == []
    assert await greedy(client, url) == before
