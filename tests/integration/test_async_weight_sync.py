"""Asynchronous weight sync and the weight version of every rollout (issue 15), against real processes.

The module's reference engine process (reset between tests) and a daemon per test, in the test's event loop;
the trainer is this process: a real model of the engine's architecture, trained with real optimizer steps,
pushed through ``AsyncWeightSync`` over ``WeightPusher`` (shared memory). Every push is checked on the engine
(``/weights_checker`` checksum and greedy output), and every rollout's versions are read back from the trace,
``/v1/status`` and ``/metrics``.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from typing import Any

import httpx
import pytest
import torch
from support import DaemonNode, daemon_node, served_checksums, weights_checksum

from colocd.api.client import ColocdHTTPError
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.agent import TrainerAgent
from colocd.trainer.async_push import AsyncWeightSync
from colocd.trainer.push import WeightPusher, manifest_of

DEADLINE_S = 60
GREEDY_TOKENS = 8


async def _policy(node: DaemonNode, sync: str) -> None:
    async with httpx.AsyncClient(base_url=node.url, trust_env=False, timeout=120) as http:
        r = await http.put("/v1/policies", content=f"apiVersion: colocd/v1\nsync: {sync}\n".encode(),
                           headers={"Content-Type": "application/yaml"})
        r.raise_for_status()


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int,
           until: threading.Event | None = None) -> tuple[float, float]:
    """Real optimizer steps on the model (next-token loss on random ids), ``steps`` of them and then on until
    ``until`` is set, if given; returns wall-clock (start, end)."""
    start = time.time()
    gen = torch.Generator().manual_seed(seed)
    done = 0
    while done < steps or (until is not None and not until.is_set()):
        done += 1
        ids = torch.randint(3, 30, (4, 24), generator=gen)
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return start, time.time()


def _greedy_local(model: torch.nn.Module, n: int = GREEDY_TOKENS) -> list[int]:
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, 1:].tolist()


async def _generate(engine_url: str, n: int = GREEDY_TOKENS) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        r = await http.post(f"{engine_url}/generate", json={
            "input_ids": [1], "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return dict(r.json())


def _sample(metrics: str, name: str, **labels: str) -> float | None:
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith(f"{name}{{{want}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return None


def _model_and_optimizer() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(QwenLikeConfig(), seed=0, device="cpu")  # the engine starts from seed 0 too
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


async def _trained_to_sync(node: DaemonNode, sync_policy: str) -> tuple[torch.nn.Module, torch.optim.Optimizer,
                                                                   AsyncWeightSync, TrainerAgent]:
    """The sync policy in force, a model trained for two steps at step 1, and the node moved to ``sync``."""
    await _policy(node, sync_policy)
    model, optimizer = _model_and_optimizer()
    sync = AsyncWeightSync(WeightPusher(node.client, transport="inline", bucket_mb=0.05, depth=2))
    agent = TrainerAgent(node.client, weight_sync=sync)
    await agent.train(1)
    await asyncio.to_thread(_train, model, optimizer, 2, 1)
    await agent.sync(1)
    return model, optimizer, sync, agent


async def test_async_push_overlaps_training_and_the_rollout_serves_exactly_the_snapshot(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, journal=str(tmp_path / "journal.jsonl")) as node:
        model, optimizer, sync, agent = await _trained_to_sync(node, "{mode: async}")
        assert sync.mode == "async"  # from the policy's directive in the replies
        pushed_sum = [weights_checksum(model.named_parameters())]
        pushed_greedy = _greedy_local(copy.deepcopy(model))

        await sync.start(model.named_parameters(), version="1", step=1)
        assert sync.last_push is None and sync.report()["buffer"] == "device"  # pushing from the snapshot
        # Training goes on while the push runs (until it has committed, however the two are scheduled on a
        # loaded machine): the live weights move away from the snapshot.
        pushed = threading.Event()
        training = asyncio.ensure_future(asyncio.to_thread(_train, model, optimizer, 20, 2, pushed))
        try:
            await asyncio.wait_for(sync.join(), 120)  # the push itself; the engines serve it once rolled out
        finally:
            pushed.set()
        train_start, train_end = await training
        await agent.rollout(1)  # joins the push, then the engines serve it

        assert sync.last_push is not None
        trace = sync.last_push.commit["trace"]
        opened, committed = trace["started_at"], trace["started_at"] + trace["duration_s"]
        assert opened < train_end and committed > train_start, (opened, committed, train_start, train_end)
        assert await served_checksums(node.engine_url) == pushed_sum != [weights_checksum(model.named_parameters())]
        answer = await _generate(node.engine_url)
        assert answer["output_ids"] == pushed_greedy
        assert answer["meta_info"]["weight_version"] == "1"
        assert answer["meta_info"]["weight_versions"] == [{"version": "1", "start": 0, "end": GREEDY_TOKENS}]

        report = agent.last_reports["weights"]
        assert report["requested"] == report["mode"] == "async" and report["buffer"] == "device"
        assert report["fallback_reason"] is None and report["push_s"] > 0
        rollout = (await node.client.trace(1))["rollout"]
        assert rollout["attrs"]["rollout_versions"] == {"ref0": "1"}
        assert rollout["attrs"]["staleness_versions"] == {"ref0": 0}
        span = next(s for s in rollout["spans"] if s["name"] == "trainer.weight_sync")
        assert span["attrs"]["mode"] == "async"
        versions = (await node.client.status())["versions"]
        assert versions["latest_started"] == "1" and versions["mode"] == "async"
        assert versions["max_staleness_versions"] == 1
        assert versions["rollouts"][-1]["rollout_versions"] == {"ref0": "1"}
        metrics = await node.client.metrics()
        assert _sample(metrics, "colocd_rollout_weight_staleness_versions", engine="ref0") == 0.0
        assert _sample(metrics, "colocd_trainer_weight_syncs_total", requested="async", mode="async") == 1.0


async def test_async_falls_back_to_a_synchronous_push_when_the_second_buffer_does_not_fit(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, journal=str(tmp_path / "journal.jsonl")) as node:
        # A margin of 1 TiB: neither this host's memory nor any device holds a copy beside it.
        model, _, sync, agent = await _trained_to_sync(node, "{mode: async, buffer_margin_mb: 1048576}")
        await sync.start(model.named_parameters(), version="1", step=1)
        assert sync.last_push is not None  # pushed and committed before start() returned
        assert await served_checksums(node.engine_url) == [weights_checksum(model.named_parameters())]
        await agent.rollout(1)

        report = agent.last_reports["weights"]
        assert report["requested"] == "async" and report["mode"] == "sync" and report["buffer"] == "none"
        assert "no room for a second buffer" in report["fallback_reason"]
        span = next(s for s in (await node.client.trace(1))["rollout"]["spans"] if s["name"] == "trainer.weight_sync")
        assert "no room for a second buffer" in span["attrs"]["fallback_reason"]
        metrics = await node.client.metrics()
        assert _sample(metrics, "colocd_fallbacks_total", kind="weight_sync") == 1.0
        assert _sample(metrics, "colocd_trainer_weight_syncs_total", requested="async", mode="sync") == 1.0


async def test_a_rollout_beyond_the_staleness_bound_is_refused_until_the_push_lands(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, journal=str(tmp_path / "journal.jsonl")) as node:
        model, optimizer = _model_and_optimizer()
        pusher = WeightPusher(node.client, transport="inline", bucket_mb=0.05, depth=2)

        async def open_and_stream(version: str, step: int) -> tuple[str, int]:
            named = list(model.named_parameters())
            session = await node.client.open_session(version, step=step, ranks=1, manifest=manifest_of(named))
            chunks, _ = await pusher.stream(session["session_id"], named)
            return session["session_id"], chunks

        # Synchronous (bound 0): the push of version 1 is streamed but not committed.
        await node.client.phase("train", 1)
        await asyncio.to_thread(_train, model, optimizer, 1, 1)
        await node.client.phase("sync", 1)
        sid, chunks = await open_and_stream("1", 1)
        with pytest.raises(ColocdHTTPError) as refused:
            await node.client.phase("rollout", 1)
        assert refused.value.status == 409
        message = refused.value.body["message"]
        assert "engine 'ref0' serves version 'default'" in message and "the bound is 0" in message
        assert refused.value.body["state"]["stale"] == {"ref0": {"serves": "default", "behind": 1}}
        await node.client.commit(sid, chunks)
        await node.client.phase("rollout", 1)  # landed: allowed
        assert (await node.client.trace(1))["rollout"]["attrs"]["staleness_versions"] == {"ref0": 0}

        # Async (bound 1): the trainer runs a version ahead (it started 3 while 2 is being pushed).
        await _policy(node, "{mode: async}")
        await node.client.phase("train", 2)
        await asyncio.to_thread(_train, model, optimizer, 1, 2)
        await node.client.phase("sync", 2)
        sid, chunks = await open_and_stream("2", 2)
        ahead = {"weights": {"requested": "async", "mode": "async", "started_version": "3"}}
        with pytest.raises(ColocdHTTPError) as refused:
            await node.client.phase("rollout", 2, trainer=ahead)
        assert refused.value.status == 409
        assert "engine 'ref0' serves version '1', 2 version(s) behind" in refused.value.body["message"]
        assert "the bound is 1" in refused.value.body["message"]
        await node.client.commit(sid, chunks)
        await node.client.phase("rollout", 2, trainer=ahead)  # one version behind: within the bound
        assert await served_checksums(node.engine_url) == [weights_checksum(model.named_parameters())]
        rollout = (await node.client.trace(2))["rollout"]["attrs"]
        assert rollout["rollout_versions"] == {"ref0": "2"} and rollout["staleness_versions"] == {"ref0": 1}
        assert rollout["latest_version"] == "3"
        metrics = await node.client.metrics()
        assert _sample(metrics, "colocd_rollout_weight_staleness_versions", engine="ref0") == 1.0
        status = (await node.client.status())["versions"]
        assert [r["rollout_versions"] for r in status["rollouts"]] == [{"ref0": "1"}, {"ref0": "2"}]


async def test_an_abandoned_push_is_withdrawn_and_re_pushing_the_last_committed_version_lets_rollout_proceed(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, journal=str(tmp_path / "journal.jsonl")) as node:
        model, optimizer = _model_and_optimizer()
        pusher = WeightPusher(node.client, transport="inline", bucket_mb=0.05, depth=2)
        await node.client.phase("train", 1)
        await asyncio.to_thread(_train, model, optimizer, 1, 1)
        await node.client.phase("sync", 1)
        await pusher.push(model.named_parameters(), version="1", step=1)
        await node.client.phase("rollout", 1)
        checkpoint = copy.deepcopy(model)  # what a restart resumes from

        # Version 2's push lands part of its tensors, then the trainer gives up on it.
        await node.client.phase("train", 2)
        await asyncio.to_thread(_train, model, optimizer, 1, 2)
        await node.client.phase("sync", 2)
        named = list(model.named_parameters())
        sid = (await node.client.open_session("2", step=2, ranks=1, manifest=manifest_of(named)))["session_id"]
        await pusher.stream(sid, named[:2])
        with pytest.raises(ColocdHTTPError) as refused:
            await node.client.phase("rollout", 2)
        message = refused.value.body["message"]
        assert refused.value.status == 409 and f"newer: '2' (session {sid} open)" in message, message
        assert "abort it, which withdraws its version" in message
        await node.client.abort(sid)
        assert (await node.client.status())["versions"]["latest_started"] == "1"

        # A restart from the checkpoint re-pushes version 1: it commits, and rollout goes ahead.
        await pusher.push(checkpoint.named_parameters(), version="1", step=2)
        await node.client.phase("rollout", 2)
        assert await served_checksums(node.engine_url) == [weights_checksum(checkpoint.named_parameters())]
        assert (await node.client.trace(2))["rollout"]["attrs"]["staleness_versions"] == {"ref0": 0}
