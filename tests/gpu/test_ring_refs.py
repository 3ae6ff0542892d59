"""ipc_ring by reference on a real GPU (issue 12 item 5): the second push of the same buckets sends refs only.

This process is the trainer; a reference engine on the same GPU holds ``tiny`` sink tensors; an in-process
daemon forwards. Every push is checked by device checksums of what the engine received, and what the trainer
put on the wire is read from the chunks its producer exported. An engine restarted between pushes holds no
ring mapping: the daemon must inline the layouts and handles for it again.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from support import serve_app

from colocd.api.app import create_app
from colocd.api.client import AsyncColocdClient
from colocd.daemon.config import NodeConfig
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.sink import device_checksum
from colocd.trainer.exported import ExportedPart
from colocd.trainer.push import WeightPusher
from colocd.trainer.ring import IpcRingProducer

pytestmark = [pytest.mark.gpu]



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _engine_config(port: int) -> ReferenceEngineConfig:
    return ReferenceEngineConfig.model_validate({
        "name": "ref0", "url": f"http://127.0.0.1:{port}", "device": "cuda",
        "launch": {"args": ["--sink-shapes", "tiny"], "ready_timeout_s": 300}})


@pytest.fixture
def wire(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Every descriptor the ring producer exports, in order (what the trainer sends unless refused)."""
    sent: list[dict[str, Any]] = []
    export = IpcRingProducer.export

    def recording(self: IpcRingProducer, named: Any) -> ExportedPart:
        chunk = export(self, named)
        sent.append(chunk.handle)
        return chunk

    monkeypatch.setattr(IpcRingProducer, "export", recording)
    return sent


async def _push(client: AsyncColocdClient, pusher: WeightPusher, named: list[tuple[str, torch.Tensor]],
                version: str) -> list[list[int]]:
    for _, t in named:
        t.normal_()
    await pusher.push(named, version=version)
    return device_checksum(t for _, t in named)


async def _sink(url: str) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        return (await http.get(f"{url}/colocd/sink")).raise_for_status().json()  # type: ignore[no-any-return]


@asynccontextmanager
async def _daemon(engine_url: str) -> AsyncIterator[AsyncColocdClient]:
    config = NodeConfig.model_validate({"engines": [{"kind": "reference", "name": "ref0", "url": engine_url}],
                                        "timeouts": {"chunk_s": 60}})
    async with serve_app(create_app(config)) as url, AsyncColocdClient(url) as client:
        await client.wait_ready(60)
        await client.phase("train", 1)
        await client.phase("sync", 1)
        yield client


@pytest.mark.parametrize("transport", ["ipc_ring", "zero_copy"])
async def test_a_second_push_sends_refs_only_and_delivers_the_same_bytes(
        named: list[tuple[str, torch.Tensor]], wire: list[dict[str, Any]], transport: str) -> None:
    async with ReferenceEngineProcess(_engine_config(_free_port())) as engine:
        async with _daemon(str(engine.url)) as client:
            async with WeightPusher(client, transport=transport, bucket_mb=1, depth=2) as pusher:
                await _push(client, pusher, named, "v1")
                first, first_sink = len(wire), await _sink(str(engine.url))
                assert any("layout" in h for h in wire) and any("open" in h for h in wire)
                expected = await _push(client, pusher, named, "v2")
            second = wire[first:]
            assert second and all(set(h) <= {"ring", "device_uuid", "slot", "layout_ref"} for h in second)
            sink = await _sink(str(engine.url))
            assert [sink["checksums"][n] for n, _ in named] == expected
            assert sink["rings_opened"] == first_sink["rings_opened"]  # nothing opened again


@pytest.mark.parametrize("transport", ["ipc_ring", "zero_copy"])
async def test_an_engine_restarted_between_pushes_gets_layouts_and_handles_inline_again(
        named: list[tuple[str, torch.Tensor]], wire: list[dict[str, Any]], transport: str) -> None:
    port = _free_port()
    engine = ReferenceEngineProcess(_engine_config(port))
    await engine.astart()
    try:
        async with _daemon(str(engine.url)) as client:
            async with WeightPusher(client, transport=transport, bucket_mb=1, depth=2) as pusher:
                await _push(client, pusher, named, "v1")
                first = len(wire)
                await client.phase("rollout", 1)
                await engine.aclose()
                # The same address, a new process: it holds no mapping of the trainer's ring.
                # Started as the first one was: ready only once it serves (a pause sent to an engine still
                # starting is a 503, which the daemon passes on: the trainer would retry).
                engine = ReferenceEngineProcess(_engine_config(port))
                await engine.astart()
                await client.phase("train", 2)
                await client.phase("sync", 2)
                expected = await _push(client, pusher, named, "v2")
            assert all("layout" not in h and "open" not in h for h in wire[first:])  # the trainer sent refs
            sink = await _sink(str(engine.url))
            assert [sink["checksums"][n] for n, _ in named] == expected
            assert sink["rings_opened"] > 0  # the daemon inlined the handles for the new process
    finally:
        await engine.aclose()
