"""The reference engine answers as real SGLang 0.5.23 did, wherever the daemon depends on the answer.

The fixture (fixtures/sglang_live_0_5_23.json) is what a live SGLang on CPU answered, recorded by the live
tier (tests/sglang, COLOCD_SGLANG_RECORD=1). Each recorded request is made to the reference engine and must
get the same status and a body of the same shape, parsed by the wire model the adapter reads it with.
Where the reference engine deliberately differs, ``DIFFERENCES`` says why and the test checks that instead.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sglang_replies as replies

from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.sglang import wire

FIXTURE = Path(__file__).parent / "fixtures" / "sglang_live_0_5_23.json"
LIVE: dict[str, dict[str, Any]] = json.loads(FIXTURE.read_text())["responses"]
DEADLINE_S = 30

# Recorded name -> the wire model the adapter parses that body with.
MODELS: dict[str, type[wire.BaseModel]] = {
    "server_info": wire.ServerInfo, "model_info": wire.ModelInfo, "weights_checker": replies.CheckWeightsResult,
    "begin_weight_update": replies.ControlResult, "begin_weight_update_again": replies.ControlResult,
    "end_weight_update": replies.ControlResult, "end_weight_update_again": replies.ControlResult,
    "update_outside_session": replies.ControlResult,
}

# Deliberate differences: name -> (the reference engine's status, why).
DIFFERENCES: dict[str, tuple[int, str]] = {
    "ready_after_failed_health": (200, "SGLang marks itself UnHealthy after a /health that timed out while "
                                       "paused, so /ready stays 503 until a /health passes; colocd never probes "
                                       "/health of a paused engine (its liveness reads model info), so the "
                                       "reference engine keeps no such mark"),
}


@pytest.fixture
def ref(pooled_engine: ReferenceEngineProcess) -> str:
    """The module's reference engine (reset between tests, tests/support.py)."""
    return str(pooled_engine.url).rstrip("/")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=60, trust_env=False) as c:
        yield c


def shape(body: Any) -> Any:
    """A JSON body's shape: its keys (recursively) and value types, not its values."""
    if isinstance(body, dict):
        return {k: shape(v) for k, v in body.items()}
    if isinstance(body, list):
        return [shape(body[0])] if body else []
    return type(body).__name__


def check(name: str, response: httpx.Response) -> None:
    live = LIVE[name]
    expected = DIFFERENCES[name][0] if name in DIFFERENCES else live["status"]
    assert response.status_code == expected, f"{name}: reference {response.status_code}, SGLang {live['status']}"
    if name in MODELS:
        model = MODELS[name]
        ours, theirs = model.model_validate(response.json()), model.model_validate(live["body"])
        assert type(ours).model_fields.keys() == type(theirs).model_fields.keys()
        if isinstance(ours, replies.ControlResult):
            assert ours.success == theirs.success


async def test_server_info_has_sglangs_shape_startup_time_a_dict_of_phases(
        ref: str, client: httpx.AsyncClient) -> None:
    r = await client.get(f"{ref}/server_info")
    check("server_info", r)
    ours, theirs = r.json(), LIVE["server_info"]["body"]
    assert isinstance(ours["startup_time"], dict) and isinstance(theirs["startup_time"], dict)
    assert set(theirs["startup_time"]) <= set(ours["startup_time"])
    for key in ("version", "tp_size", "device"):
        assert type(ours[key]) is type(theirs[key]), key
    assert wire.ServerInfo.model_validate(ours).incarnation() is not None


async def test_model_info_carries_the_weight_version_where_sglang_does(ref: str, client: httpx.AsyncClient) -> None:
    r = await client.get(f"{ref}/model_info")
    check("model_info", r)
    assert set(LIVE["model_info"]["body"]) >= {"model_path", "tokenizer_path", "weight_version"}
    assert {"model_path", "tokenizer_path", "weight_version"} <= set(r.json())


async def test_ready_is_503_in_every_pause_mode_and_health_503_while_paused(
        ref: str, client: httpx.AsyncClient) -> None:
    for mode in ("abort", "retract", "in_place"):
        await client.post(f"{ref}/pause_generation", json={"mode": mode})
        check(f"ready_paused_{mode}", await client.get(f"{ref}/ready"))
        if mode == "abort":
            check("health_paused", await client.get(f"{ref}/health"))
        await client.post(f"{ref}/continue_generation", json={})
    check("ready_after_failed_health", await client.get(f"{ref}/ready"))


async def test_flush_is_400_with_sglangs_words_while_a_request_decodes(ref: str, client: httpx.AsyncClient) -> None:
    long = asyncio.create_task(client.post(f"{ref}/generate", json={
        "text": "Hello", "sampling_params": {"max_new_tokens": 4000, "temperature": 0, "ignore_eos": True}}))
    deadline = time.monotonic() + DEADLINE_S
    while (r := await client.post(f"{ref}/flush_cache")).status_code == 200:
        assert not long.done() and time.monotonic() < deadline, "the long request never started decoding"
        await asyncio.sleep(0.01)  # polling a condition with a deadline
    check("flush_while_decoding", r)
    assert r.text.strip() == LIVE["flush_while_decoding"]["body"].strip()
    await client.post(f"{ref}/pause_generation", json={"mode": "abort"})
    await long
    await client.post(f"{ref}/continue_generation", json={})


async def test_session_errors_and_an_update_outside_a_session_are_sglangs(
        ref: str, client: httpx.AsyncClient) -> None:
    update = {"serialized_named_tensors": ["e30="], "load_format": "flattened_bucket", "flush_cache": False}
    check("update_outside_session", await client.post(f"{ref}/update_weights_from_tensor", json=update))
    await client.post(f"{ref}/pause_generation", json={"mode": "retract"})
    check("begin_weight_update", await client.post(f"{ref}/begin_weight_update", json={"selector": "all"}))
    check("begin_weight_update_again", await client.post(f"{ref}/begin_weight_update", json={"selector": "all"}))
    check("end_weight_update", await client.post(f"{ref}/end_weight_update", json={}))
    check("end_weight_update_again", await client.post(f"{ref}/end_weight_update", json={}))
    await client.post(f"{ref}/continue_generation", json={})


async def test_weights_checker_answers_a_checksum_in_sglangs_shape(ref: str, client: httpx.AsyncClient) -> None:
    r = await client.post(f"{ref}/weights_checker", json={"action": "checksum"})
    check("weights_checker", r)
    live = replies.CheckWeightsResult.model_validate(LIVE["weights_checker"]["body"])
    assert live.checksum() and replies.CheckWeightsResult.model_validate(r.json()).checksum()


async def test_resume_of_a_resident_tag_is_a_4xx_where_sglang_dies(ref: str, client: httpx.AsyncClient) -> None:
    # Deliberate: SGLang 0.5.23's scheduler raises KeyError (weight_updater.py:390) and the server exits; the
    # daemon never sends it (it knows residency), and the reference engine refuses instead of dying.
    r = await client.post(f"{ref}/resume_memory_occupation", json={"tags": ["kv_cache"]})
    assert 400 <= r.status_code < 500
    assert (await client.get(f"{ref}/model_info")).status_code == 200
