"""The verified commit (issue 25 item 4): before a session commits, every engine's digests of what it holds are
compared with the digests the trainer computed at export (policy ``sync.verify``).

Real reference engine processes and an in-process daemon on loopback; the trainer is ``WeightPusher``. A tampered
engine is a reference engine started with its test-only hook (``COLOCD_REFERENCE_TEST_CORRUPT``): after every load
that wrote the named tensor it flips one bit of it, as a buggy loader would.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import daemon_node, reference_engine

from colocd.api.client import ColocdHTTPError
from colocd.daemon.verify import sample_names
from colocd.engines.chunks import tensor_checksum
from colocd.engines.digest import tensor_digests
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.producer import ShmProducer
from colocd.trainer.push import WeightPusher

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]

CORRUPTED = "model.layers.1.mlp.down_proj.weight"


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in build_model(QwenLikeConfig(), seed=seed).named_parameters()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[dict[str, str]]:
    """Two reference engines for the module: ``clean``, and ``tampered`` whose hook corrupts CORRUPTED after every
    load that writes it. Each test drives them through a daemon of its own (a complete push each time)."""
    async with AsyncExitStack() as stack:
        urls = {}
        for name, corrupt in (("clean", None), ("tampered", CORRUPTED)):
            with pytest.MonkeyPatch.context() as env:
                if corrupt is None:
                    env.delenv("COLOCD_REFERENCE_TEST_CORRUPT", raising=False)
                else:
                    env.setenv("COLOCD_REFERENCE_TEST_CORRUPT", corrupt)
                # The child copies the environment as it starts.
                proc = await stack.enter_async_context(reference_engine(name))
            urls[name] = str(proc.url)
        yield urls


def _verify(tmp_path: Any, mode: str) -> str:
    """A policy file whose sync.verify is ``mode``."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"apiVersion: colocd/v1\nsync:\n  verify: {mode}\n")
    return str(policy)


async def test_a_correct_push_is_verified_on_every_engine_before_it_commits(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=7)
    clean = {"ref0": engines["clean"]}
    async with daemon_node(clean, synced_at=1) as node, WeightPusher(node.client, transport="shm") as pusher:
        client = node.client
        report = await pusher.push(named, version="v1", step=1)
        verification = report.commit["verification"]
        assert verification["mode"] == "full"
        assert verification["engines"] == {"ref0": {"status": "verified", "checked": len(named)}}
        await client.phase("rollout", 1)
        assert await node.engine_checksum() == tensor_checksum(named)


async def test_an_engine_holding_other_bytes_fails_the_session_naming_engine_and_tensor_and_stays_paused(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=8)
    both = {"ref0": engines["clean"], "ref1": engines["tampered"]}
    async with daemon_node(both, synced_at=1) as node, WeightPusher(node.client, transport="shm") as pusher:
        client = node.client
        with pytest.raises(ColocdHTTPError) as err:
            await pusher.push(named, version="v1", step=1)
        assert err.value.status == 502
        assert err.value.body["error"] == "WeightsMismatch"
        assert (err.value.body["engine"], err.value.body["tensor"]) == ("ref1", CORRUPTED)
        assert "ref1" in err.value.body["message"] and CORRUPTED in err.value.body["message"]
        engines = (await client.status())["engines"]
        assert engines["ref1"]["generation"] == "paused"
        assert engines["ref1"]["weights"] == "stale"
        with pytest.raises(ColocdHTTPError) as refused:
            await client.phase("rollout", 1)
        assert refused.value.status == 409


async def test_sample_checks_a_deterministic_subset_and_catches_a_sampled_tensor(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=9)
    names = [n for n, _ in named]
    version = next(v for v in (f"v{i}" for i in range(1000)) if CORRUPTED in sample_names(names, v))
    missed = next(v for v in (f"v{i}" for i in range(1000)) if CORRUPTED not in sample_names(names, v))
    picked = sample_names(names, version)
    assert 0 < len(picked) < len(names) and picked == sample_names(list(reversed(names)), version)
    tampered = {"ref1": engines["tampered"]}
    async with daemon_node(tampered, policy_file=_verify(tmp_path, "sample"), synced_at=1) as node, \
            WeightPusher(node.client, transport="shm") as pusher:
        client = node.client
        report = await pusher.push(named, version=missed, step=1)  # the corrupted tensor is outside this sample
        assert report.commit["verification"]["engines"]["ref1"] == {"status": "verified",
                                                                    "checked": len(sample_names(names, missed))}
        await client.phase("rollout", 1)
        await client.phase("train", 2)
        await client.phase("sync", 2)
        with pytest.raises(ColocdHTTPError) as err:
            await pusher.push(named, version=version, step=2)
        assert (err.value.body["engine"], err.value.body["tensor"]) == ("ref1", CORRUPTED)


async def test_off_skips_the_check_and_commits_what_the_engines_hold(tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=10)
    async with daemon_node({"ref1": engines["tampered"]}, policy_file=_verify(tmp_path, "off"), synced_at=1) as node, \
            WeightPusher(node.client, transport="shm") as pusher:
        client = node.client
        report = await pusher.push(named, version="v1", step=1)
        assert report.commit["verification"]["mode"] == "off"
        assert report.commit["verification"]["engines"] == {"ref1": {"status": "skipped", "checked": 0}}
        await client.phase("rollout", 1)


async def test_a_trainer_that_sends_no_digests_commits_and_the_reply_says_nothing_was_verified(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=11)
    producer = ShmProducer(reclaim=False)
    async with daemon_node({"ref0": engines["clean"]}, synced_at=1) as node:
        client = node.client
        session = await client.open_session("v1", step=1, ranks=1)
        chunk = producer.export(named)  # exported without digests, as a trainer that does not compute them
        try:
            await client.send_chunk(session["session_id"], seq=0, rank=0, chunk=chunk)
        finally:
            chunk.release()
        commit = await client.commit(session["session_id"], 1)
        reason = "the trainer sent no digests with its chunks"
        assert commit["verification"]["engines"] == {"ref0": {"status": "unverified", "checked": 0, "reason": reason}}


async def test_a_session_some_of_whose_chunks_carry_no_digests_is_not_called_verified(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=12)
    half = len(named) // 2
    producer = ShmProducer(reclaim=False)
    async with daemon_node({"ref0": engines["clean"]}, synced_at=1) as node:
        client = node.client
        session = await client.open_session("v1", step=1, ranks=1)
        with_digests, without = producer.export(named[:half]), producer.export(named[half:])
        with_digests.digests = tensor_digests(named[:half])
        try:
            for seq, chunk in enumerate((with_digests, without)):
                await client.send_chunk(session["session_id"], seq=seq, rank=0, chunk=chunk)
        finally:
            with_digests.release()
            without.release()
        commit = await client.commit(session["session_id"], 2)
        verdict = commit["verification"]["engines"]["ref0"]
        assert (verdict["status"], verdict["checked"]) == ("unverified", half)
        assert f"no digests for {len(named) - half} of the tensors it loaded" in verdict["reason"]
        assert repr(min(n for n, _ in named[half:])) in verdict["reason"]
        await client.phase("rollout", 1)
