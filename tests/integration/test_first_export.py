"""A push's first chunk is exported while its session opens (``colocd.trainer.push.FirstExport``).

From a pusher's second push on, ``WeightPusher.open`` exports the first chunk on a thread beside the open, so
the open's round trip and the engines' begin hide one export. That chunk is made under the last join's terms; it
is sent only where this session's join says the same, and it is given back when the open fails. One reference
engine process for the module, an in-process daemon per test, inline chunks (the pusher's leases show what is still
exported).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from support import DaemonNode, daemon_node

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.chunks import tensor_checksum
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.exported import ExportedPart
from colocd.trainer.producer import InlineProducer
from colocd.trainer.push import PushReport, WeightPusher

Named = list[tuple[str, torch.Tensor]]
WAIT_S = 10


def _model(seed: int) -> Named:
    return list(build_model(QwenLikeConfig(), seed=seed).named_parameters())


def _verify(mode: str) -> str:
    return f"apiVersion: colocd/v1\nsync:\n  verify: {mode}\n"


async def _next_step(client: AsyncColocdClient, step: int) -> None:
    await client.phase("rollout", step - 1)
    await client.phase("train", step)
    await client.phase("sync", step)


async def _checksum(engine: ReferenceEngineProcess) -> str:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        r = await http.post(f"{engine.url}/weights_checker", json={"action": "checksum"})
        r.raise_for_status()
        return str(r.json()["colocd_checksum"])


async def _landed_verified(report: PushReport, named: Named, engine: ReferenceEngineProcess) -> None:
    """The push committed and was checked as far as the engine can be (the reference engine, like SGLang, reports no
    digests), and the engine holds ``named``."""
    assert report.commit["state"] == "committed"
    assert {e["status"] for e in report.commit["verification"]["engines"].values()} == {"unsupported"}
    assert await _checksum(engine) == tensor_checksum(named)


@asynccontextmanager
async def _pushed_once(engine: ReferenceEngineProcess, tmp_path: Any, *, verify: str = "full",
                       seed: int) -> AsyncIterator[tuple[DaemonNode, WeightPusher, PushReport]]:
    """A daemon over ``engine`` whose policy says ``sync.verify: verify``, an inline pusher, and its first push's report
    (at step 1; the node then in step 1's rollout unless the test moves on)."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(_verify(verify))
    async with daemon_node({"ref0": str(engine.url)}, policy_file=str(policy), synced_at=1) as node, \
            WeightPusher(node.client, transport="inline", bucket_mb=0.05, depth=2) as pusher:
        yield node, pusher, await pusher.push(_model(seed=seed), version="one", step=1)


class Exports:
    """Counts inline exports as they begin (on their threads); a thread can wait for the count to pass a mark."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count = 0
        self._changed = threading.Condition()
        export = InlineProducer.export

        def counted(producer: InlineProducer, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart:
            with self._changed:
                self.count += 1
                self._changed.notify_all()
            return export(producer, named)

        monkeypatch.setattr(InlineProducer, "export", counted)

    def wait_past(self, mark: int, timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(lambda: self.count > mark, timeout_s)


async def test_from_the_second_push_on_the_first_chunk_is_exported_while_the_open_is_answered(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    exports = Exports(monkeypatch)
    async with _pushed_once(pooled_engine, tmp_path, seed=31) as (node, pusher, first):
        assert first.chunks > 1 and exports.count == first.chunks
        await _next_step(node.client, 2)
        began: list[bool] = []

        open_session = node.client.open_session

        async def open_once_an_export_began(*args: Any, **kw: Any) -> dict[str, Any]:
            # The open goes out only once the push's first export has begun: a pusher that exported only after
            # the open's reply would leave this waiting out WAIT_S.
            began.append(await asyncio.to_thread(exports.wait_past, first.chunks, WAIT_S))
            return await open_session(*args, **kw)

        monkeypatch.setattr(node.client, "open_session", open_once_an_export_began)
        named = _model(seed=32)
        report = await pusher.push(named, version="two", step=2)
    assert began == [True]
    assert exports.count == first.chunks + report.chunks  # the early export is the stream's first chunk
    await _landed_verified(report, named, pooled_engine)


async def test_a_first_chunk_exported_without_digests_is_exported_again_once_the_join_asks_for_them(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    exports = Exports(monkeypatch)
    async with _pushed_once(pooled_engine, tmp_path, verify="off", seed=33) as (node, pusher, first):
        assert first.commit["verification"]["mode"] == "off"
        async with httpx.AsyncClient(base_url=node.url, trust_env=False, timeout=30) as http:
            staged = await http.put("/v1/policies", content=_verify("full").encode(),
                                    headers={"Content-Type": "application/yaml"})
            assert staged.status_code == 200, staged.text  # applies at the next boundary
        await _next_step(node.client, 2)
        named = _model(seed=34)
        report = await pusher.push(named, version="verified", step=2)
    # The export made under verify "off" was given back, and the stream exported its chunk again.
    assert exports.count == first.chunks + 1 + report.chunks
    assert report.commit["verification"]["mode"] == "full"
    await _landed_verified(report, named, pooled_engine)


async def test_an_open_the_daemon_refuses_gives_back_the_chunk_exported_meanwhile(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    exports = Exports(monkeypatch)
    async with _pushed_once(pooled_engine, tmp_path, seed=35) as (node, pusher, first):
        with pytest.raises(ColocdHTTPError) as refused:
            await pusher.push(_model(seed=36), version="wrong-step", step=7)  # the node is at step 1
        assert (refused.value.status, refused.value.body["field"]) == (422, "step")
        assert exports.count == first.chunks + 1  # the early export ran
        assert pusher.leases.report()["exported_bytes"] == 0
        await _next_step(node.client, 2)
        named = _model(seed=37)
        report = await pusher.push(named, version="two", step=2)
    await _landed_verified(report, named, pooled_engine)
