"""The reference engine as a real server process on loopback, driven over HTTP like SGLang 0.5.23.

One engine serves the whole module (tests/support.py's pool: started once, reset after every test);
the legacy-protocol and launcher-failure tests start their own.
"""

from __future__ import annotations

import asyncio
import base64
import os
import pickle
import time
import types
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from reference_runner import StaticBuffers, generate_greedy
from support import EnginePool, engine_tags, reference_engine, served_checksums, weights_checksum

from colocd.engines.reference import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, QwenLikeForCausalLM, build_model
from colocd.engines.reference.runner import ModelRunner
from colocd.engines.reference.tokenizer import EOS_ID, CharTokenizer
from colocd.errors import EngineLaunchError
from colocd.trainer.producer import Producer

CFG = QwenLikeConfig()
TOK = CharTokenizer()
DEADLINE_S = 30.0
GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


def named_params(model: QwenLikeForCausalLM) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


SEED0 = named_params(build_model(CFG, 0))
SEED0_SUM = weights_checksum(SEED0)


def in_process_greedy(model: QwenLikeForCausalLM, text: str, max_new_tokens: int) -> list[int]:
    """What the engine must answer: the same runner code path, in this process."""
    runner = ModelRunner(model, StaticBuffers.allocate(model, max_batch=1, max_seq=CFG.max_position))
    return generate_greedy(runner, TOK.encode(text), max_new_tokens, eos_id=EOS_ID)


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    """Poll ``check`` until true or the deadline (never a fixed sleep standing in for a condition)."""
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.02)


# --- the shared engine ---------------------------------------------------------------------------


@pytest.fixture
def engine(engine_pool: EnginePool) -> Iterator[ReferenceEngineProcess]:
    """The module's engine (tests/support.py's pool: started at first use, reset after each test)."""
    proc = engine_pool.borrow("ref-it", launch={"ready_timeout_s": 60})
    yield proc
    engine_pool.give_back(proc)


@pytest.fixture
async def client(engine: ReferenceEngineProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine.url or "", timeout=DEADLINE_S) as c:
        yield c


async def state(c: httpx.AsyncClient) -> dict[str, Any]:
    return (await c.get("/server_info")).json()["internal_states"][0]  # type: ignore[no-any-return]


def bucket_entry(named: list[tuple[str, torch.Tensor]]) -> str:
    """A ``flattened_bucket`` entry, plain-pickled as the trainer's inline transport sends it."""
    return str(Producer("inline").export(named).handle["payload_b64"])


async def push(
    c: httpx.AsyncClient,
    named: list[tuple[str, torch.Tensor]],
    *,
    chunks: int = 1,
    version: str | None = None,
) -> dict[str, Any]:
    """begin → one update per chunk → end, as the daemon drives it; returns the last update's body."""
    assert (await c.post("/begin_weight_update", json={})).json()["success"]
    size = -(-len(named) // chunks)
    body: dict[str, Any] = {}
    for k in range(0, len(named), size):
        last = k + size >= len(named)
        r = await c.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [bucket_entry(named[k : k + size])],
                "load_format": "flattened_bucket",
                "flush_cache": last,
                "weight_version": version if last else None,
            },
        )
        body = r.json()
        assert r.status_code == (200 if body["success"] else 400)
        if not body["success"]:
            break
    assert (await c.post("/end_weight_update", json={})).json()["success"]
    return body


async def generate(c: httpx.AsyncClient, **body: Any) -> Any:
    r = await c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


# --- info and generation -------------------------------------------------------------------------


async def test_health_ready_and_info_routes_speak_sglang_0_5_23(client: httpx.AsyncClient) -> None:
    assert (await client.get("/health")).status_code == 200
    assert (await client.get("/health_generate")).status_code == 200
    assert (await client.get("/ready")).status_code == 200
    info = (await client.get("/model_info")).json()
    assert info["weight_version"] == "default" and info["is_generation"] is True
    assert {
        "model_path",
        "served_model_name",
        "tokenizer_path",
        "preferred_sampling_params",
        "load_format",
        "architectures",
    } <= set(info)
    server = (await client.get("/server_info")).json()
    assert server["version"] == "0.5.23" and server["tp_size"] == 1
    assert (await client.get("/get_server_info")).json()["version"] == "0.5.23"  # deprecated alias
    assert (await client.get("/get_weight_version")).status_code == 404  # gone in 0.5.23


async def test_greedy_generation_is_deterministic_and_equals_the_same_model_in_process(
    client: httpx.AsyncClient,
) -> None:
    a = await generate(client, text="the cat sat", sampling_params=GREEDY)
    b = await generate(client, text="the cat sat", sampling_params=GREEDY)
    assert a["output_ids"] == b["output_ids"] and a["text"] == b["text"]
    assert a["output_ids"] == in_process_greedy(build_model(CFG, 0), "the cat sat", 12)
    meta = a["meta_info"]
    assert meta["prompt_tokens"] == len(TOK.encode("the cat sat"))
    assert meta["completion_tokens"] == len(a["output_ids"]) and meta["weight_version"] == "default"
    assert meta["finish_reason"]["type"] in ("length", "stop") and isinstance(meta["id"], str)
    assert a["text"] == TOK.decode(a["output_ids"])


async def test_a_batch_returns_a_list_with_the_same_answers_as_single_requests(
    client: httpx.AsyncClient,
) -> None:
    texts = ["hello", "a b c", "zz top"]
    batch = await generate(client, text=texts, sampling_params=GREEDY, rid=["r0", "r1", "r2"])
    assert isinstance(batch, list) and [o["meta_info"]["id"] for o in batch] == ["r0", "r1", "r2"]
    singles = [await generate(client, text=t, sampling_params=GREEDY) for t in texts]
    assert [o["output_ids"] for o in batch] == [o["output_ids"] for o in singles]
    by_ids = await generate(client, input_ids=[TOK.encode(t) for t in texts], sampling_params=GREEDY)
    assert [o["output_ids"] for o in by_ids] == [o["output_ids"] for o in singles]


async def test_seeded_sampling_repeats_and_logprobs_come_in_sglang_triples(client: httpx.AsyncClient) -> None:
    params = {"temperature": 1.0, "max_new_tokens": 16, "sampling_seed": 7, "ignore_eos": True}
    a = await generate(client, text="seed", sampling_params=params, return_logprob=True)
    b = await generate(client, text="seed", sampling_params=params)
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 16
    others = [
        await generate(client, text="seed", sampling_params={**params, "sampling_seed": s}) for s in (8, 9)
    ]
    assert any(o["output_ids"] != a["output_ids"] for o in others)
    out_lp = a["meta_info"]["output_token_logprobs"]
    assert [t for _, t, _ in out_lp] == a["output_ids"] and all(lp <= 0 for lp, _, _ in out_lp)
    assert a["meta_info"]["input_token_logprobs"][0] == [None, TOK.bos_token_id, None]


async def test_bad_requests_get_400_json_without_tracebacks(client: httpx.AsyncClient) -> None:
    r = await client.post("/generate", json={"text": "hi!"})
    assert r.status_code == 400 and "'!'" in r.json()["error"]["message"]
    r = await client.post("/generate", json={"text": "hi", "sampling_params": {"temperature": -1}})
    assert r.status_code == 400 and "temperature" in r.json()["error"]["message"]
    r = await client.post("/pause_generation")  # 0.5.23 needs a JSON body
    assert r.status_code == 400 and r.json()["object"] == "error"
    r = await client.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and "Traceback" not in r.text


async def test_control_bodies_are_the_adapters_models_with_unknown_keys_ignored_as_sglang_ignores_them(
        client: httpx.AsyncClient) -> None:
    # SGLang's structs carry bookkeeping fields (rid, http_worker_ipc) that callers may send; the adapter's models
    # refuse unknown keys when they build a body, the engine ignores them when it reads one.
    r = await client.post("/update_weight_version", json={"new_version": "v9", "abort_all_requests": False,
                                                           "rid": "x", "http_worker_ipc": None})
    assert r.status_code == 200 and r.json()["new_version"] == "v9"
    r = await client.post("/update_weights_from_tensor", json={"serialized_named_tensors": ["not base64!"]})
    assert r.status_code == 400 and "serialized_named_tensors" in r.json()["message"]  # the adapter's own check
    await client.post("/update_weight_version", json={"new_version": "default", "abort_all_requests": False})


# --- pause ---------------------------------------------------------------------------------------


async def test_pause_abort_ends_in_flight_requests_and_blocks_new_ones_until_continue(
    client: httpx.AsyncClient,
) -> None:
    # Deterministic in-flight request: with the KV cache released it is queued but cannot step.
    assert (await client.post("/release_memory_occupation", json={"tags": ["kv_cache"]})).status_code == 200
    inflight = asyncio.create_task(generate(client, text="abc", sampling_params=GREEDY))
    await eventually(lambda: _has(client, num_waiting_reqs=1), "request queued in the scheduler")
    r = await client.post("/release_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 400 and "idle" in r.json()["error"]["message"]  # SGLang would crash here

    pause = await client.post("/pause_generation", json={"mode": "abort"})
    assert pause.json() == {"message": "Generation paused successfully.", "status": "ok"}
    aborted = await inflight
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort" and aborted["output_ids"] == []
    assert (await client.get("/ready")).status_code == 503
    assert (await client.get("/health")).status_code == 503  # no forward pass while paused

    assert (await client.post("/resume_memory_occupation", json={"tags": ["kv_cache"]})).status_code == 200
    blocked = asyncio.create_task(generate(client, text="abc", sampling_params=GREEDY))
    await eventually(lambda: _has(client, num_blocked_reqs=1), "request blocked at the pause gate")
    assert not blocked.done()
    cont = await client.post("/continue_generation", json={"torch_empty_cache": True})
    assert cont.json() == {"message": "Generation continued successfully.", "status": "ok"}
    done = await asyncio.wait_for(blocked, DEADLINE_S)
    assert done["meta_info"]["finish_reason"]["type"] != "abort"
    assert done["output_ids"] == in_process_greedy(build_model(CFG, 0), "abc", 12)


async def test_a_client_that_gives_up_while_blocked_is_dropped_from_the_queue(
    client: httpx.AsyncClient, engine: ReferenceEngineProcess
) -> None:
    await client.post("/pause_generation", json={"mode": "in_place"})
    async with httpx.AsyncClient(base_url=engine.url or "", timeout=DEADLINE_S) as impatient:
        waiting = asyncio.create_task(impatient.post("/generate", json={"text": "abc"}))
        await eventually(lambda: _has(client, num_blocked_reqs=1), "request blocked at the pause gate")
        waiting.cancel()  # httpx closes the connection: the server sees the client go away
        with pytest.raises(asyncio.CancelledError):
            await waiting
    await eventually(lambda: _has(client, num_blocked_reqs=0), "disconnected request dropped")


async def _has(c: httpx.AsyncClient, **expected: Any) -> bool:
    s = await state(c)
    return all(s[k] == v for k, v in expected.items())


# --- memory --------------------------------------------------------------------------------------


async def test_release_frees_every_tag_blocks_generation_and_resume_brings_it_back(
    client: httpx.AsyncClient,
) -> None:
    before = engine_tags((await client.get("/server_info")).json())
    assert all(resident and nbytes > 0 for resident, nbytes in before.values())

    r = await client.post("/release_memory_occupation", json={"tags": None})
    assert r.status_code == 200 and r.json() is None
    after = engine_tags((await client.get("/server_info")).json())
    assert after == {tag: (False, nbytes) for tag, (_, nbytes) in before.items()}  # SGLang's sizes stay as allocated
    assert (await client.get("/health")).status_code == 503  # never probes released memory

    waiting = asyncio.create_task(generate(client, text="abc", sampling_params=GREEDY))
    await eventually(lambda: _has(client, num_waiting_reqs=1), "request queued while released")
    assert not waiting.done()
    r = await client.post("/resume_memory_occupation", json={"tags": []})
    assert r.status_code == 200 and r.json() is None
    await asyncio.wait_for(waiting, DEADLINE_S)  # runs (on garbage weights, as in SGLang)
    assert engine_tags((await client.get("/server_info")).json()) == before


async def test_double_release_and_resume_of_a_resident_tag_are_400_naming_the_tag(
    client: httpx.AsyncClient,
) -> None:
    assert (await client.post("/release_memory_occupation", json={"tags": ["cuda_graph"]})).status_code == 200
    r = await client.post("/release_memory_occupation", json={"tags": ["cuda_graph"]})
    assert r.status_code == 400 and "'cuda_graph'" in r.json()["error"]["message"]
    assert "released" in r.json()["error"]["message"]
    r = await client.post("/resume_memory_occupation", json={"tags": ["weights"]})
    assert r.status_code == 400 and "'weights'" in r.json()["error"]["message"]
    assert "resident" in r.json()["error"]["message"]
    r = await client.post("/release_memory_occupation", json={"tags": ["gpu_lint"]})
    assert r.status_code == 400 and "'gpu_lint'" in r.json()["error"]["message"]


async def test_flush_cache_answers_text_like_sglang(client: httpx.AsyncClient) -> None:
    for method in ("GET", "POST"):
        r = await client.request(method, "/flush_cache")
        assert r.status_code == 200 and r.text.startswith("Cache flushed.")
        assert r.headers["content-type"].startswith("text/plain")


# --- weights -------------------------------------------------------------------------------------


async def test_an_update_changes_checksum_version_and_greedy_output_to_the_pushed_model(
    client: httpx.AsyncClient,
) -> None:
    pushed = build_model(CFG, 1)
    old = await generate(client, text="the cat sat", sampling_params=GREEDY)
    body = await push(client, named_params(pushed), chunks=3, version="step-1")
    assert body == {"success": True, "message": "Success"}
    check = (await client.post("/weights_checker", json={"action": "checksum"})).json()
    assert [r["per_gpu_checksum"] for r in check["ranks"]] == [weights_checksum(named_params(pushed))] != [SEED0_SUM]
    assert check["success"] and set(check["ranks"][0]["checksums"]) == {n for n, _ in SEED0}
    assert len(check["per_engine_checksum"]) == 64
    assert (await client.get("/model_info")).json()["weight_version"] == "step-1"
    new = await generate(client, text="the cat sat", sampling_params=GREEDY)
    assert new["output_ids"] == in_process_greedy(pushed, "the cat sat", 12) != old["output_ids"]
    assert new["meta_info"]["weight_version"] == "step-1"


async def test_tensor_updates_outside_a_session_fail_as_in_0_5_23(client: httpx.AsyncClient) -> None:
    r = await client.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [bucket_entry(SEED0[:1])], "load_format": "flattened_bucket"})
    assert r.status_code == 400 and r.json()["success"] is False
    assert "begin_weight_update" in r.json()["message"]
    assert (await client.post("/end_weight_update", json={})).status_code == 400
    assert (await client.post("/begin_weight_update", json={"selector": "all"})).status_code == 200
    r = await client.post("/begin_weight_update", json={})
    assert r.status_code == 400 and "already open" in r.json()["message"]


@pytest.mark.parametrize(
    ("mutate", "named_in_message"),
    [
        (lambda named: [*named, ("model.layers.7.mlp.up_proj.weight", torch.zeros(3))], "model.layers.7"),
        (lambda named: [*named[:-1], (named[-1][0], torch.zeros(2, 2))], "lm_head.weight"),
        (lambda named: [*named[:-1], (named[-1][0], named[-1][1].double())], "lm_head.weight"),
    ],
    ids=["unknown-name", "wrong-shape", "wrong-dtype"],
)
async def test_a_bad_chunk_is_refused_naming_the_tensor_and_applies_nothing(
    client: httpx.AsyncClient, mutate: Callable[[list[Any]], list[Any]], named_in_message: str
) -> None:
    body = await push(client, mutate(named_params(build_model(CFG, 1))))
    assert body["success"] is False and named_in_message in body["message"]
    assert await served_checksums(str(client.base_url)) == [SEED0_SUM]


async def test_a_wrong_entry_count_or_an_unknown_format_is_refused(client: httpx.AsyncClient) -> None:
    await client.post("/begin_weight_update", json={})
    for load_format in ("colocd_shm", "colocd_disk"):  # colocd's own chunk formats, which SGLang does not load
        r = await client.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": [bucket_entry(SEED0[:1])], "load_format": load_format})
        assert r.status_code == 400 and "load_format" in r.json()["message"]
    r = await client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": ["e30=", "e30="], "load_format": "flattened_bucket"},
    )
    assert r.status_code == 400 and "tp_size" in r.json()["message"]
    r = await client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": ["e30="], "load_format": "pickled_mystery"},
    )
    assert r.status_code == 400 and "load_format" in r.json()["message"]
    assert await served_checksums(str(client.base_url)) == [SEED0_SUM]


async def test_sglang_pickled_formats_load(client: httpx.AsyncClient) -> None:
    pushed = named_params(build_model(CFG, 4))
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in pushed[:5]])
    meta, start = [], 0
    for name, t in pushed[:5]:
        meta.append(
            types.SimpleNamespace(
                name=name,
                shape=t.shape,
                dtype=t.dtype,
                start_idx=start,
                end_idx=start + t.nbytes,
                numel=t.nbytes,
            )
        )
        start += t.nbytes
    entries = [
        ("flattened_bucket", pickle.dumps({"flattened_tensor": flat, "metadata": meta})),
        (None, pickle.dumps(pushed[5:])),
    ]
    await client.post("/begin_weight_update", json={})
    for fmt, raw in entries:
        r = await client.post(
            "/update_weights_from_tensor",
            json={
                "serialized_named_tensors": [base64.b64encode(raw).decode()],
                "load_format": fmt,
                "flush_cache": False,
            },
        )
        assert r.json() == {"success": True, "message": "Success"}, fmt
    await client.post("/end_weight_update", json={})
    assert await served_checksums(str(client.base_url)) == [weights_checksum(pushed)]


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


async def test_a_malicious_pickle_is_refused_with_400_naming_the_global(
    client: httpx.AsyncClient, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    await client.post("/begin_weight_update", json={})
    r = await client.post(
        "/update_weights_from_tensor",
        json={"serialized_named_tensors": [base64.b64encode(pickle.dumps([("x", _Evil(marker))])).decode()]},
    )
    assert r.status_code == 400 and r.json()["success"] is False
    assert "system" in r.json()["message"] and "Blocked unsafe global" in r.json()["message"]
    assert not marker.exists()


async def test_weight_version_update_and_weights_checker_answers_checksum_only(client: httpx.AsyncClient) -> None:
    r = await client.post("/update_weight_version", json={"new_version": "v7", "abort_all_requests": False})
    assert r.json() == {"success": True, "message": "Weight version updated to v7", "new_version": "v7"}
    assert (await client.get("/model_info")).json()["weight_version"] == "v7"
    for action in ("snapshot", "explode"):  # SGLang's other actions are no part of what colocd sends
        r = await client.post("/weights_checker", json={"action": action})
        assert r.status_code == 400 and "Unsupported" in r.json()["message"]


async def test_updates_need_resident_weights(client: httpx.AsyncClient) -> None:
    await client.post("/release_memory_occupation", json={"tags": ["weights"]})
    body = await push(client, SEED0)
    assert body["success"] is False and "'weights' is released" in body["message"]
    assert (await client.post("/weights_checker", json={"action": "checksum"})).status_code == 400


# --- other processes: legacy protocol, API key, launcher failures -----------------------------------


async def test_legacy_protocol_engine_with_api_key() -> None:
    async with reference_engine("ref-legacy", protocol="legacy", api_key="k3y", seed=5,
                                launch={"ready_timeout_s": 60}) as proc:
        auth = {"Authorization": "Bearer k3y"}
        async with (
            httpx.AsyncClient(base_url=proc.url or "", timeout=DEADLINE_S) as open_c,
            httpx.AsyncClient(base_url=proc.url or "", timeout=DEADLINE_S, headers=auth) as c,
        ):
            assert (await open_c.get("/health")).status_code == 200  # health stays open
            r = await open_c.get("/get_model_info")
            assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
            assert (
                await open_c.get("/get_model_info", headers={"Authorization": "Bearer nope"})
            ).status_code == 401

            assert (await c.get("/get_server_info")).json()["version"] == "0.5.4"
            assert (await c.get("/get_model_info")).json()["weight_version"] == "default"
            assert (await c.get("/get_weight_version")).json() == {"weight_version": "default"}
            for path in ("/server_info", "/model_info", "/ready"):
                assert (await c.get(path)).status_code == 404, path
            assert (await c.post("/begin_weight_update", json={})).status_code == 404
            assert (await c.post("/pause_generation")).json()["status"] == "ok"  # no body in ≈0.5.4
            assert (await c.post("/continue_generation")).json()["status"] == "ok"

            pushed = build_model(CFG, 6)
            r = await c.post("/update_weights_from_tensor", json={  # standalone: no session
                "serialized_named_tensors": [bucket_entry(named_params(pushed))], "load_format": "flattened_bucket",
                "weight_version": "w1"})
            assert r.json() == {"success": True, "message": "Success Weight version updated to w1."}
            assert (await c.get("/get_weight_version")).json() == {"weight_version": "w1"}
            out = (await c.post("/generate", json={"text": "legacy", "sampling_params": GREEDY})).json()
            assert out["output_ids"] == in_process_greedy(pushed, "legacy", 12)
        pid = proc.pid
    assert proc.returncode == 0
    assert pid is not None and proc.url is not None


async def test_a_child_that_dies_fails_the_launch_at_once_with_its_log_tail(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(EngineLaunchError, match="bogus_knob") as err:
        async with reference_engine("ref-broken", model={"bogus_knob": 1}, launch={"ready_timeout_s": 60},
                                    log_path=tmp_path / "engine.log"):
            pass
    assert time.monotonic() - started < 30  # the death was noticed, not the deadline
    assert "exited with code 2" in str(err.value) and err.value.log_path == tmp_path / "engine.log"
