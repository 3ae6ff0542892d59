"""A reference engine with tp_size 2 on CPU, as a real server process: one weight copy and one payload per
TP rank (SGLang's ``serialized_named_tensors``, one entry per rank), checksums per rank, and a daemon that
refuses to attach an engine whose tp_size is not the declared one.

One TP=2 engine serves the module (put back to seed-0 weights, all memory resident, after every test);
the attach-mismatch test starts its own TP=1 engine.
"""

from __future__ import annotations

import asyncio
import base64
import pickle
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import httpx
import pytest
import torch
from reference_runner import StaticBuffers, generate_greedy
from support import EnginePool, daemon_node, engine_tags, reference_engine, served_checksums, weights_checksum

from colocd.api.client import ColocdHTTPError
from colocd.engines.config import LaunchConfig, ReferenceEngineConfig
from colocd.engines.reference import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, QwenLikeForCausalLM, build_model
from colocd.engines.reference.runner import ModelRunner
from colocd.engines.reference.tokenizer import EOS_ID, CharTokenizer
from colocd.trainer.producer import Producer
from colocd.trainer.push import WeightPusher, manifest_of

CFG = QwenLikeConfig()
DEADLINE_S = 60.0
Named = list[tuple[str, torch.Tensor]]


def named_params(model: QwenLikeForCausalLM) -> Named:
    return [(n, p.detach()) for n, p in model.named_parameters()]


SEED0_SUM = weights_checksum(named_params(build_model(CFG, 0)))


def greedy_in_process(model: QwenLikeForCausalLM, text: str, n: int) -> list[int]:
    runner = ModelRunner(model, StaticBuffers.allocate(model, max_batch=1, max_seq=CFG.max_position))
    return generate_greedy(runner, CharTokenizer().encode(text), n, eos_id=EOS_ID)


@pytest.fixture
def engine(engine_pool: EnginePool) -> Iterator[ReferenceEngineProcess]:
    """The module's TP=2 engine (tests/support.py's pool: started at first use, reset after each test)."""
    proc = engine_pool.borrow("ref-tp2", launch={"ready_timeout_s": DEADLINE_S}, tp_size=2)
    yield proc
    engine_pool.give_back(proc)


@pytest.fixture
async def c(engine: ReferenceEngineProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=engine.url or "", timeout=DEADLINE_S, trust_env=False) as client:
        yield client
        await restore(client)


async def restore(c: httpx.AsyncClient) -> None:
    """Back to serving seed-0 weights on both ranks with everything resident, whatever the test did."""
    await c.post("/continue_generation", json={})
    released = [t for t, (resident, _) in engine_tags((await c.get("/server_info")).json()).items() if not resident]
    if released:
        assert (await c.post("/resume_memory_occupation", json={"tags": released})).status_code == 200
    if (await c.get("/server_info")).json()["internal_states"][0]["weight_update_session"] is not None:
        await c.post("/end_weight_update", json={})
    if await served_checksums(str(c.base_url)) != [SEED0_SUM, SEED0_SUM]:
        seed0 = named_params(build_model(CFG, 0))
        assert (await push_inline(c, [seed0, seed0])).json()["success"]
    await c.post("/update_weight_version", json={"new_version": "default"})


def bucket_entry(named: Named) -> str:
    """One TP rank's ``flattened_bucket`` entry, plain-pickled as each trainer rank's inline transport sends it."""
    return str(Producer("inline").export(named).handle["payload_b64"])


async def update(c: httpx.AsyncClient, entries: list[str], load_format: str | None) -> httpx.Response:
    """One chunk inside its own begin/end session, as the daemon drives it."""
    assert (await c.post("/begin_weight_update", json={})).json()["success"]
    try:
        return await c.post("/update_weights_from_tensor", json={
            "serialized_named_tensors": entries, "load_format": load_format, "flush_cache": True})
    finally:
        assert (await c.post("/end_weight_update", json={})).json()["success"]


async def push_inline(c: httpx.AsyncClient, per_rank: list[Named]) -> httpx.Response:
    return await update(c, [bucket_entry(named) for named in per_rank], "flattened_bucket")


async def greedy(c: httpx.AsyncClient, text: str, n: int) -> list[int]:
    r = await c.post("/generate", json={"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": n}})
    assert r.status_code == 200, r.text
    return list(r.json()["output_ids"])


# --- the engine on its own ----------------------------------------------------------------------------


async def test_a_tp2_engine_reports_its_ranks_and_loads_each_rank_from_its_own_entry(c: httpx.AsyncClient) -> None:
    trained = build_model(CFG, 21)
    assert (await c.get("/server_info")).json()["tp_size"] == 2
    check = (await c.post("/weights_checker", json={"action": "checksum"})).json()
    assert [r["parallelism_info"][0]["tp_rank"] for r in check["ranks"]] == [0, 1]
    assert [r["parallelism_info"][0]["tp_size"] for r in check["ranks"]] == [2, 2]
    assert await served_checksums(str(c.base_url)) == [SEED0_SUM, SEED0_SUM]

    r = await push_inline(c, [named_params(trained), named_params(trained)])
    assert r.json() == {"success": True, "message": "Success"}

    assert await served_checksums(str(c.base_url)) == [weights_checksum(named_params(trained))] * 2
    assert await greedy(c, "tp", 10) == greedy_in_process(trained, "tp", 10)


async def test_sglang_pickled_entries_one_serialisation_per_rank_land_on_every_rank(c: httpx.AsyncClient) -> None:
    trained = named_params(build_model(CFG, 22))
    # SGLang serialises each rank's entry separately even when the data is the same (engine.py:1743).
    entries = [base64.b64encode(pickle.dumps(trained)).decode() for _ in range(2)]
    r = await update(c, entries, None)
    assert r.json()["success"], r.text
    assert await served_checksums(str(c.base_url)) == [weights_checksum(trained)] * 2


async def test_a_chunk_whose_rank_entries_disagree_or_miss_a_rank_is_refused_and_applies_nothing(
        c: httpx.AsyncClient) -> None:
    ours, other = named_params(build_model(CFG, 23)), named_params(build_model(CFG, 24))
    one = await push_inline(c, [ours])
    assert one.status_code == 400
    assert "1 entries but this engine has tp_size 2" in one.json()["message"]

    # Rank 1 holding another model, or other tensors than rank 0 (disjoint halves): refused, naming it.
    differing = await push_inline(c, [ours, other])
    assert differing.status_code == 400
    message = differing.json()["message"]
    assert "nothing applied" in message and "TP rank 1" in message and "differ" in message
    half = len(ours) // 2
    disjoint = await push_inline(c, [ours[:half], ours[half:]])
    assert disjoint.status_code == 400 and "other tensors than rank 0's" in disjoint.json()["message"]

    assert await served_checksums(str(c.base_url)) == [SEED0_SUM, SEED0_SUM]  # neither rank applied any of them


async def test_release_and_resume_move_every_ranks_memory_together(c: httpx.AsyncClient) -> None:
    weights = engine_tags((await c.get("/server_info")).json())["weights"]
    assert weights[0] and weights[1] > 0

    await c.post("/pause_generation", json={"mode": "abort"})
    assert (await c.post("/release_memory_occupation", json={"tags": ["weights"]})).status_code == 200
    assert engine_tags((await c.get("/server_info")).json())["weights"] == (False, weights[1])
    assert (await c.post("/weights_checker", json={"action": "checksum"})).json()["success"] is False  # no rank holds

    assert (await c.post("/resume_memory_occupation", json={"tags": ["weights"]})).status_code == 200
    assert engine_tags((await c.get("/server_info")).json())["weights"] == weights


def test_device_ids_must_name_every_tp_rank_once() -> None:
    with pytest.raises(ValueError, match="device_ids has 1 entries for tp_size 2"):
        ReferenceEngineConfig(name="e", url="http://127.0.0.1:1", tp_size=2, device_ids=["cpu:0"])
    with pytest.raises(ValueError, match="distinct"):
        ReferenceEngineConfig(name="e", url="http://127.0.0.1:1", tp_size=2, device_ids=["a", "a"])
    with pytest.raises(ValueError, match="names one GPU"):
        ReferenceEngineProcess(ReferenceEngineConfig(
            name="e", launch=LaunchConfig(), device="cuda:1", tp_size=2))


# --- through the daemon -------------------------------------------------------------------------------


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for: {what}")
        await asyncio.sleep(0.05)  # poll cadence


async def test_the_daemon_refuses_to_attach_an_engine_whose_tp_size_is_not_the_declared_one() -> None:
    async with reference_engine("ref-tp1", launch={"ready_timeout_s": DEADLINE_S}) as tp1, daemon_node(
            [{"kind": "reference", "name": "ref-declared-tp2", "url": tp1.url, "tp_size": 2}], ready=False) as node:
        client = node.client

        async def reported() -> bool:
            return bool((await client.status())["engines"]["ref-declared-tp2"].get("last_error"))

        await eventually(reported, "the daemon reports the engine's attach failure")
        record = (await client.status())["engines"]["ref-declared-tp2"]
        assert record["healthy"] is False
        assert "reports tp_size 1" in record["last_error"] and "declares tp_size 2" in record["last_error"]
        assert "ref-declared-tp2" in record["last_error"]
        assert not await client.ready()

        with pytest.raises(ColocdHTTPError) as refused:
            await client.phase("train", 1)
        assert refused.value.status == 503 and "tp_size 1" in refused.value.body["message"]
        assert (await client.status())["node"] == {"phase": "rollout", "step": 0}  # the daemon keeps serving


async def test_two_trainer_ranks_feed_a_tp2_engine_through_the_daemon(
        engine: ReferenceEngineProcess, c: httpx.AsyncClient) -> None:
    trained = build_model(CFG, 25)
    named = named_params(trained)
    async with daemon_node([{"kind": "reference", "name": "ref-tp2", "url": engine.url, "tp_size": 2,
                             "device_ids": ["cpu:4", "cpu:5"]}], synced_at=1) as node:
        client = node.client
        session = await client.open_session("v1", step=1, ranks=2, depth=2, manifest=manifest_of(named))
        sid = session["session_id"]
        # Every rank sends the same chunk plan: the full tensors, bucketed the same way. The engine's TP ranks
        # run on cpu:4 and cpu:5; each trainer rank declares one of them and feeds that TP rank.
        pushers = [WeightPusher(client, bucket_mb=0.05, rank=r, device_id=f"cpu:{4 + r}") for r in range(2)]
        results = await asyncio.gather(*(p.stream(sid, named) for p in pushers))
        assert results[0] == results[1]
        assert [p.last_join["feeds"] for p in pushers if p.last_join] == [
            [{"engine": "ref-tp2", "tp_rank": 0}], [{"engine": "ref-tp2", "tp_rank": 1}]]
        await client.commit(sid, results[0][0])
        await client.phase("rollout", 1)

        assert await served_checksums(str(c.base_url)) == [weights_checksum(named)] * 2
        assert await greedy(c, "ok", 8) == greedy_in_process(trained, "ok", 8)
