"""The reference engine's extensions are capabilities negotiated at attach from what the engine answers: live
SGLang 0.5.23's server_info (tests/contract/fixtures) has none, so the adapter never asks a /colocd/ route of
it; the reference engine's has them all, and its replies reach the daemon as typed reports."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from colocd.engines.base import Capability, MemoryReport, MemoryTag, ParameterSpec, TagMemory
from colocd.engines.config import ReferenceEngineConfig, SGLangEngineConfig
from colocd.engines.sglang.adapter import UNSUPPORTED_DIGESTS, SGLangAdapter

LIVE = json.loads((Path(__file__).parent.parent / "contract" / "fixtures" / "sglang_live_0_5_23.json")
                  .read_text())["responses"]
REFERENCE_SERVER_INFO = {**LIVE["server_info"]["body"], "colocd_reference": True}
MEMORY = {"tags": {"weights": {"resident": True, "nbytes": 100, "resident_nbytes": 100},
                   "kv_cache": {"resident": False, "nbytes": 40, "resident_nbytes": 0},
                   "cuda_graph": {"resident": True, "nbytes": 0, "resident_nbytes": 0}},
          "rss_bytes": 12345, "ranks": []}
PARAMETERS = {"parameters": [{"name": "w", "dtype": "bfloat16", "shape": [2, 3]}]}


def _server(server_info: dict[str, Any], asked: list[str]) -> Callable[[httpx.Request], httpx.Response]:
    replies = {"/server_info": server_info, "/model_info": LIVE["model_info"]["body"],
               "/colocd/memory": MEMORY, "/colocd/parameters": PARAMETERS,
               "/colocd/digests": {"ranks": [{"w": "d1"}]}}

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        body = replies.get(request.url.path)
        return httpx.Response(404) if body is None else httpx.Response(200, json=body)
    return handle


def _drive(config: SGLangEngineConfig | ReferenceEngineConfig, server_info: dict[str, Any],
           use: Callable[[SGLangAdapter], Any]) -> tuple[Any, list[str]]:
    asked: list[str] = []

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_server(server_info, asked))) as client:
            adapter = SGLangAdapter(config, client)
            return await use(adapter)
    return asyncio.run(run()), asked


async def _everything(adapter: SGLangAdapter) -> tuple[Any, ...]:
    info = await adapter.attach()
    return (info, await adapter.memory_report(), await adapter.parameter_manifest(),
            await adapter.weight_digests(["w"]), (await adapter.observe()).resident)


def test_live_sglang_answers_no_extension_and_is_never_asked_for_one() -> None:
    config = SGLangEngineConfig(name="s", url="http://sglang.test")
    (info, memory, params, digests, resident), asked = _drive(config, LIVE["server_info"]["body"], _everything)
    assert info.capabilities == frozenset()
    assert (memory, params, resident) == (None, None, None)
    assert digests.ranks is None and digests.unsupported == UNSUPPORTED_DIGESTS
    assert not [p for p in asked if p.startswith("/colocd/")]


def test_the_reference_engine_negotiates_its_extensions_and_they_arrive_typed() -> None:
    config = ReferenceEngineConfig(name="r", url="http://reference.test")
    (info, memory, params, digests, resident), _ = _drive(config, REFERENCE_SERVER_INFO, _everything)
    assert {Capability.MEMORY_REPORT, Capability.PARAMETER_MANIFEST} <= info.capabilities
    assert memory == MemoryReport({MemoryTag.WEIGHTS: TagMemory(True, 100, 100),
                                   MemoryTag.KV_CACHE: TagMemory(False, 40, 0),
                                   MemoryTag.CUDA_GRAPH: TagMemory(True, 0, 0)})
    assert memory.resident_bytes == 100 and memory.nbytes((MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)) == 140
    assert params == (ParameterSpec("w", "bfloat16", (2, 3)),)
    assert digests.ranks == ({"w": "d1"},)
    assert resident == {MemoryTag.WEIGHTS: True, MemoryTag.KV_CACHE: False, MemoryTag.CUDA_GRAPH: True}
