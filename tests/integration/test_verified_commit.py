"""The verified commit: before a session commits, every engine's digests of what it holds are compared with the
digests the trainer computed at export (policy ``sync.verify``).

Real reference engine processes and an in-process daemon on loopback; the trainer is ``WeightPusher``. The reference
engine answers as SGLang does, which reports no digests a trainer's can be compared with: its verdict is
``unsupported``, naming why. An engine that holds other bytes than it was sent is caught through vLLM's worker
extension (tests/vllm/test_vllm_verify.py); the comparison itself is specified in tests/unit/test_verify.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import daemon_node, reference_engine, served_checksums, weights_checksum

from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.engines.sglang.adapter import UNSUPPORTED_DIGESTS
from colocd.trainer.producer import Producer
from colocd.trainer.push import WeightPusher

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(180)]



def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in build_model(QwenLikeConfig(), seed=seed).named_parameters()]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engines() -> AsyncIterator[dict[str, str]]:
    """A reference engine for the module; each test drives it through a daemon of its own (a complete push each
    time)."""
    async with reference_engine("clean") as proc:
        yield {"clean": str(proc.url)}


def _verify(tmp_path: Any, mode: str) -> str:
    """A policy file whose sync.verify is ``mode``."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(f"apiVersion: colocd/v1\nsync:\n  verify: {mode}\n")
    return str(policy)


async def test_an_engine_that_reports_no_digests_commits_and_the_reply_says_why_it_was_not_verified(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=7)
    async with daemon_node({"ref0": engines["clean"]}, synced_at=1) as node, \
            WeightPusher(node.client, transport="inline") as pusher:
        report = await pusher.push(named, version="v1", step=1)
        verification = report.commit["verification"]
        assert verification["mode"] == "full"
        assert verification["engines"] == {"ref0": {"status": "unsupported", "checked": 0,
                                                    "reason": UNSUPPORTED_DIGESTS}}
        await node.client.phase("rollout", 1)
        assert await served_checksums(node.engine_url) == [weights_checksum(named)]


async def test_off_skips_the_check_and_commits_what_the_engines_hold(tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=10)
    async with daemon_node({"ref1": engines["clean"]}, policy_file=_verify(tmp_path, "off"), synced_at=1) as node, \
            WeightPusher(node.client, transport="inline") as pusher:
        client = node.client
        report = await pusher.push(named, version="v1", step=1)
        assert report.commit["verification"]["mode"] == "off"
        assert report.commit["verification"]["engines"] == {"ref1": {"status": "skipped", "checked": 0}}
        await client.phase("rollout", 1)


async def test_a_trainer_that_sends_no_digests_commits_and_the_reply_says_nothing_was_verified(
        tmp_path: Any, engines: dict[str, str]) -> None:
    named = _named(seed=11)
    producer = Producer("inline")
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
        await client.phase("rollout", 1)
