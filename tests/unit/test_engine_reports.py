"""The SGLang adapter reads what SGLang itself reports, the same way for real SGLang and the reference engine: each
tag's bytes from server_info's ``memory_usage`` (SGLang 0.5.23, scheduler_components/memory_usage.py), and no
digests, since SGLang has none a trainer's can be compared with. It asks no route SGLang lacks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from colocd.engines.base import MemoryReport, MemoryTag
from colocd.engines.config import ReferenceEngineConfig, SGLangEngineConfig
from colocd.engines.sglang.adapter import UNSUPPORTED_DIGESTS, SGLangAdapter

LIVE = json.loads((Path(__file__).parent.parent / "contract" / "fixtures" / "sglang_live_0_5_23.json")
                  .read_text())["responses"]
GIB = 1 << 30
# One scheduler's state as SGLang 0.5.23 builds it (build_memory_usage): GB per region, graph memory per phase.
MEMORY_USAGE = {"weight": 15.258, "kvcache": 60.0, "startup_available": 78.5, "token_capacity": 400000,
                "token_capacity_swa": None, "graph": {"decode": 0.5, "prefill": 0.25}}


def _server(server_info: dict[str, Any], asked: list[str]) -> Callable[[httpx.Request], httpx.Response]:
    replies = {"/server_info": server_info, "/model_info": LIVE["model_info"]["body"]}

    def handle(request: httpx.Request) -> httpx.Response:
        asked.append(request.url.path)
        body = replies.get(request.url.path)
        return httpx.Response(404) if body is None else httpx.Response(200, json=body)
    return handle


def _drive(config: SGLangEngineConfig | ReferenceEngineConfig,
           server_info: dict[str, Any]) -> tuple[tuple[Any, ...], list[str]]:
    asked: list[str] = []

    async def run() -> tuple[Any, ...]:
        async with httpx.AsyncClient(transport=httpx.MockTransport(_server(server_info, asked))) as client:
            adapter = SGLangAdapter(config, client)
            await adapter.attach()
            observed = await adapter.observe()
            return await adapter.memory_report(), await adapter.weight_digests(["w"]), observed.resident
    return asyncio.run(run()), asked


def test_a_server_info_without_memory_usage_gives_no_report_and_no_digests_and_no_route_beyond_sglangs() -> None:
    # The recorded live reply elides internal_states, as an SGLang that reports no scheduler state.
    (memory, digests, resident), asked = _drive(SGLangEngineConfig(name="s", url="http://sglang.test"),
                                                LIVE["server_info"]["body"])
    assert (memory, resident) == (None, None)
    assert digests.ranks is None and digests.unsupported == UNSUPPORTED_DIGESTS
    assert set(asked) <= {"/server_info", "/model_info", "/openapi.json"}


def test_memory_usage_becomes_each_tags_bytes_summed_over_the_tp_ranks_for_either_engine() -> None:
    info = {**LIVE["server_info"]["body"], "tp_size": 2, "internal_states": [{"memory_usage": MEMORY_USAGE}]}
    expected = MemoryReport({MemoryTag.WEIGHTS: 2 * round(15.258 * GIB), MemoryTag.KV_CACHE: 2 * 60 * GIB,
                             MemoryTag.CUDA_GRAPH: 2 * round(0.75 * GIB)})
    for config in (SGLangEngineConfig(name="s", url="http://sglang.test", tp_size=2),
                   ReferenceEngineConfig(name="r", url="http://reference.test", tp_size=2)):
        (memory, digests, resident), _ = _drive(config, info)
        assert memory == expected
        assert memory.nbytes((MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)) == expected.tags[MemoryTag.WEIGHTS] + 120 * GIB
        assert digests.unsupported == UNSUPPORTED_DIGESTS and resident is None


def test_a_region_sglang_measured_below_zero_is_no_claim_rather_than_a_negative_one() -> None:
    # SGLang measures a region as free memory before minus after; on a CPU other processes move that number.
    usage = {**MEMORY_USAGE, "weight": -0.0123, "graph": {}}
    info = {**LIVE["server_info"]["body"], "internal_states": [{"memory_usage": usage}]}
    (memory, _, _), _ = _drive(SGLangEngineConfig(name="s", url="http://sglang.test"), info)
    assert memory == MemoryReport({MemoryTag.KV_CACHE: 60 * GIB})
