"""Separated-GPU weight updates through the daemon, for real on CPU: the trainer in this process is rank 0 of
a gloo weight-update group, and a reference engine process joins it through the daemon's HTTP API.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from support import daemon_node, reference_engine, served_checksums, weights_checksum

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.engines.weight_group import WeightGroup, master_store, off_loop
from colocd.trainer.async_push import AsyncWeightSync
from colocd.trainer.broadcast import DistributedWeightSender

DEADLINE_S = 60  # every test body runs under this


@asynccontextmanager
async def node(**config: Any) -> AsyncIterator[tuple[ReferenceEngineProcess, AsyncColocdClient]]:
    """A reference engine process and an in-process daemon driving it, both on loopback."""
    # A fresh engine per test: the weight-update groups it joined are state its API does not show, so a reset
    # could not prove them gone.
    async with reference_engine() as engine, daemon_node({"ref0": str(engine.url)}, **config) as daemon:
        yield engine, daemon.client


def sender(client: AsyncColocdClient, **kw: Any) -> DistributedWeightSender:
    return DistributedWeightSender(client, backend="gloo", master_address="127.0.0.1", timeout_s=30, **kw)


async def engine_greedy(engine: ReferenceEngineProcess, n: int = 8) -> list[int]:
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        r = await http.post(f"{engine.url}/generate", json={
            "input_ids": [1], "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return list(r.json()["output_ids"])


def local_greedy(model: torch.nn.Module, n: int = 8) -> list[int]:
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, 1:].tolist()


def descriptor(seq: int, named: list[tuple[str, torch.Tensor]], **extra: Any) -> dict[str, Any]:
    return {"seq": seq, "names": [n for n, _ in named], "shapes": [list(t.shape) for _, t in named],
            "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in named], **extra}


@pytest.mark.parametrize("flattened", [False, True], ids=["per_tensor", "flattened_bucket"])
async def test_full_step_over_a_weight_update_group_serves_exactly_the_trainers_weights(flattened: bool) -> None:
    trained = build_model(QwenLikeConfig(), seed=123)  # the engine started from seed 0
    nbytes = sum(p.numel() * p.element_size() for p in trained.parameters())
    async with asyncio.timeout(DEADLINE_S), node(timeouts={"chunk_s": 20}) as (engine, client):
        before = await engine_greedy(engine)
        async with sender(client, bucket_mb=0.05, flattened=flattened) as trainer:
            opened = await trainer.open_group()
            assert (opened["state"], opened["world_size"], opened["rank_offsets"]) == ("ready", 2, {"ref0": 1})
            await client.phase("train", 1)
            await client.phase("sync", 1)
            report = await trainer.push(trained.named_parameters(), version="v1", step=1)
            await client.phase("rollout", 1)

        assert await served_checksums(engine.url) == [weights_checksum(trained.named_parameters())]
        after = await engine_greedy(engine)
        assert after == local_greedy(trained) and after != before
        assert report.chunks > 1 and report.nbytes == nbytes
        assert report.commit["broadcasts"] == {"broadcasts": report.chunks, "nbytes": nbytes}
        spans = [s["name"] for s in report.commit["trace"]["spans"]]
        assert spans.count("update_weights_from_distributed#0") == 1 and "end_weight_update" in spans
        status = await client.status()
        assert status["engines"]["ref0"]["weight_version"] == "v1"
        assert status["engines"]["ref0"]["generation"] == "serving"
        assert (await client.weight_groups())["groups"] == {}  # closed with the sender
        metrics = await client.metrics()
        line = next(ln for ln in metrics.splitlines() if ln.startswith('colocd_weight_bytes_total{engine="ref0",'
                                                                      'transport="gloo"}'))
        assert float(line.split()[-1]) == nbytes


async def test_abort_between_broadcasts_keeps_the_old_version_paused_and_the_group_usable() -> None:
    trained = build_model(QwenLikeConfig(), seed=7)
    named = list(trained.named_parameters())
    async with asyncio.timeout(DEADLINE_S), node(timeouts={"chunk_s": 20}) as (engine, client), \
            sender(client, bucket_mb=0.05) as trainer:
        await trainer.open_group()
        await client.phase("train", 1)
        await client.phase("sync", 1)
        session = (await client.open_session("v1", step=1, ranks=1))["session_id"]
        await trainer.broadcast(session, 0, named[:3])
        await trainer.broadcast(session, 1, named[3:5])
        await client.abort(session)

        state = (await client.status())["engines"]["ref0"]
        assert (state["weight_version"], state["weights"], state["generation"]) == ("default", "stale", "paused")
        with pytest.raises(ColocdHTTPError) as err:
            await client.phase("rollout", 1)
        assert err.value.status == 409 and "stale" in err.value.body["message"]
        # Refused before anything reaches an engine, so no collective is left waiting.
        with pytest.raises(ColocdHTTPError) as err:
            await client.send_broadcast(session, descriptor(2, named[5:6]))
        assert err.value.status == 410 and "aborted" in err.value.body["message"]
        with pytest.raises(ColocdHTTPError) as err:
            await client.send_broadcast(session, descriptor(0, [("a", torch.zeros(3, dtype=torch.int8)),
                                                                ("b", torch.zeros(2))], load_format="flattened_bucket"))
        assert err.value.status == 422
        assert "'b'" in err.value.body["message"] and "itemsize 4" in err.value.body["message"]

        # The group survived the abort: the next session goes through it.
        assert (await client.weight_groups())["groups"]["weight_update_group"]["state"] == "ready"
        await trainer.push(named, version="v1", step=1)
        assert (await client.phase("rollout", 1))["engines"]["ref0"]["generation"] == "serving"
        assert await served_checksums(engine.url) == [weights_checksum(named)]


async def test_trainer_that_never_broadcasts_gets_504_naming_the_engine_and_the_group_can_be_reopened() -> None:
    trained = build_model(QwenLikeConfig(), seed=11)
    named = list(trained.named_parameters())
    async with asyncio.timeout(DEADLINE_S), node(timeouts={"chunk_s": 1.0}) as (engine, client), \
            sender(client, bucket_mb=1) as trainer:
        await trainer.open_group()
        await client.phase("train", 1)
        await client.phase("sync", 1)
        session = (await client.open_session("v1", step=1, ranks=1))["session_id"]
        # The descriptor goes out but this trainer never runs its broadcast.
        with pytest.raises(ColocdHTTPError) as err:
            await client.send_broadcast(session, descriptor(0, named[:2]))
        body = err.value.body
        assert err.value.status == 504, body
        assert (body["engine"], body["stage"], body["budget_s"]) == ("ref0", "update_weights_from_distributed#0", 1.0)
        assert "'ref0'" in body["message"] and "1.0s budget" in body["message"] and "open it again" in body["message"]

        status = await client.status()  # the daemon keeps serving
        assert status["weight_session"]["state"] == "failed"
        state = status["engines"]["ref0"]
        assert (state["weights"], state["generation"], state["weight_version"]) == ("stale", "paused", "default")
        assert (await client.weight_groups())["groups"] == {}

        # Re-initialisable: leave the old group, open a fresh one under the same name, finish the step.
        assert await trainer.close_group() is None  # the daemon had destroyed it already
        await trainer.open_group()
        await trainer.push(named, version="v1", step=1)
        await client.phase("rollout", 1)
        assert await served_checksums(engine.url) == [weights_checksum(named)]
        assert await engine_greedy(engine) == local_greedy(trained)


_SGLANG_SIDE = """
import sys, datetime, torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
port, timeout = int(sys.argv[1]), datetime.timedelta(seconds=20)
# sglang utils/common.py init_custom_process_group, as of 0.5.23
store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
pg, _ = _new_process_group_helper(world_size, rank, [], Backend("gloo"), PrefixStore("weight_update_group", store),
                                  group_name="weight_update_group", timeout=timeout)
_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
t = torch.zeros(4)
dist.broadcast(t, src=0, group=pg)
print(t.tolist())
"""


async def test_the_trainers_group_joins_one_built_the_way_sglang_builds_it() -> None:
    """Store keys must match SGLang's exactly or both sides hang until timeout (research §6.4 #8)."""
    async with asyncio.timeout(DEADLINE_S):
        store = master_store("127.0.0.1", 2, 20)
        peer = await asyncio.create_subprocess_exec(sys.executable, "-c", _SGLANG_SIDE, str(store.port),
                                                    stdout=asyncio.subprocess.PIPE)
        try:
            group = await off_loop(lambda: WeightGroup.join(
                master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2,
                group_name="weight_update_group", backend="gloo", timeout_s=20, store=store), name="test-join")
            await off_loop(lambda: group.broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0])), name="test-bcast")
            out, _ = await peer.communicate()
        finally:
            if peer.returncode is None:
                peer.kill()
                await peer.wait()
        assert out.decode().strip() == "[1.0, 2.0, 3.0, 4.0]"
        await off_loop(group.close, name="test-leave")


async def test_a_trainer_that_never_joins_gets_504_naming_the_engine_and_nothing_half_built_stays() -> None:
    async with asyncio.timeout(DEADLINE_S), node(timeouts={"default_s": 1.0}) as (_, client):
        store = master_store("127.0.0.1", 2, 20)  # served, but this trainer never joins the group
        with pytest.raises(ColocdHTTPError) as err:
            await client.open_weight_group(master_address="127.0.0.1", master_port=store.port, backend="gloo")
        body = err.value.body
        assert err.value.status == 504, body
        assert (body["engine"], body["stage"], body["budget_s"]) == ("ref0", "init_weights_update_group", 1.0)
        assert (await client.weight_groups())["groups"] == {}
        async with sender(client) as trainer:  # the same name opens cleanly afterwards
            assert (await trainer.open_group())["state"] == "ready"


async def test_an_async_sync_over_the_weight_update_group_serves_the_snapshot_not_later_training() -> None:
    """Separated engines, async (issue 15): the broadcast runs in the background out of a snapshot while the
    trainer keeps changing its weights; after the join the engine serves exactly the snapshot."""
    model = build_model(QwenLikeConfig(), seed=123)
    async with asyncio.timeout(DEADLINE_S), node(timeouts={"chunk_s": 20}) as (engine, client):
        async with sender(client, bucket_mb=0.05) as trainer:
            await trainer.open_group()
            sync = AsyncWeightSync(trainer, mode="async", margin_mb=0)
            await client.phase("train", 1)
            await client.phase("sync", 1)
            snapshot = [weights_checksum(model.named_parameters())]
            await sync.start(model.named_parameters(), version="v1", step=1)
            assert sync.last_push is None and sync.report()["mode"] == "async"  # the broadcast runs meanwhile ...
            with torch.no_grad():  # ... while training goes on and changes every weight
                for p in model.parameters():
                    p.add_(1.0)
            report = await sync.join()
            await client.phase("rollout", 1)
        assert report is not None and report.chunks > 1
        assert (sync.report() or {}).get("mode") == "async"
        assert await served_checksums(engine.url) == snapshot != [weights_checksum(model.named_parameters())]
        assert (await client.status())["engines"]["ref0"]["weight_version"] == "v1"
