"""What colocd's vLLM worker extension answers through /collective_rpc arrives typed (wire.ExtensionInfo,
wire.ReceivedDigests), parsed once where it arrives; a reply of another shape is an EngineProtocolError naming
the method and the field, never a KeyError deep in the adapter (a fake vLLM; the real server is tests/vllm)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from colocd.engines.config import VLLMEngineConfig
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.engines.vllm.protocol import OPTIONAL_ROUTES, REQUIRED_ROUTES
from colocd.errors import EngineProtocolError
from colocd.policies import Transport

INFO = {"extension_version": 1, "device": "cpu", "tp_rank": 0, "digests": True,
        "update_active": False, "boot_id": "123-00000000000000ab"}
CONFIG = VLLMEngineConfig(name="v", url="http://vllm.test")
ROUTES = {"/version": {"version": "0.32.0"}, "/is_paused": {"is_paused": False},
          "/get_world_size": {"world_size": 1}, "/weight_info": {"weight_version": "default"},
          "/is_sleeping": {"is_sleeping": False},
          "/openapi.json": {"paths": {route: {} for route in (*REQUIRED_ROUTES, *OPTIONAL_ROUTES)}}}


def _drive(rpc: dict[str, object], use: Callable[[VLLMAdapter], Awaitable[Any]]) -> Any:
    """``use`` on an adapter whose vLLM answers each /collective_rpc method with ``rpc[method]`` from its one
    worker, and the attach routes as vLLM 0.32 does."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc":
            return httpx.Response(200, json={"results": [rpc[json.loads(request.content)["method"]]]})
        return httpx.Response(200, json=ROUTES[request.url.path])

    async def run() -> Any:
        async with httpx.AsyncClient(transport=httpx.MockTransport(handle)) as client:
            return await use(VLLMAdapter(CONFIG, client))
    return asyncio.run(run())


async def _attach_and_observe(adapter: VLLMAdapter) -> Any:
    return await adapter.attach(), adapter.transports, await adapter.observe()


def test_the_extensions_colocd_info_is_what_attach_and_observe_read() -> None:
    info, transports, observed = _drive({"colocd_info": INFO}, _attach_and_observe)
    assert info.extra["extension"] == INFO
    assert transports == frozenset({Transport.SHM, Transport.DISK})  # a CPU worker: no cuda_ipc
    assert observed.incarnation == INFO["boot_id"]
    assert observed.update_session_open is False  # the extension's update_active


@pytest.mark.parametrize(("reply", "named"), [
    ({**INFO, "device": 0}, "ExtensionInfo.device"),
    ({k: v for k, v in INFO.items() if k != "boot_id"}, "ExtensionInfo.boot_id"),
    ({**INFO, "update_active": "no"}, "ExtensionInfo.update_active"),
    ("<ColocdWorkerExtension object>", "ExtensionInfo.(the reply)"),
])
def test_a_colocd_info_reply_of_another_shape_is_a_protocol_error_naming_the_field(reply: object,
                                                                                   named: str) -> None:
    with pytest.raises(EngineProtocolError) as exc:
        _drive({"colocd_info": reply}, VLLMAdapter.attach)
    assert "/collective_rpc colocd_info (worker 0)" in str(exc.value)
    assert named in str(exc.value)


def test_received_digests_arrive_as_one_name_to_digest_map_per_worker() -> None:
    async def digests(adapter: VLLMAdapter) -> Any:
        await adapter.attach()
        return await adapter.weight_digests(["w"])

    assert _drive({"colocd_info": INFO, "colocd_received_digests": {"w": "d1"}}, digests).ranks == ({"w": "d1"},)


def test_a_received_digest_that_is_not_a_string_is_a_protocol_error_naming_the_tensor() -> None:
    async def digests(adapter: VLLMAdapter) -> Any:
        await adapter.attach()
        return await adapter.weight_digests(["w"])

    with pytest.raises(EngineProtocolError, match=r"colocd_received_digests \(worker 0\): ReceivedDigests\.w:"):
        _drive({"colocd_info": INFO, "colocd_received_digests": {"w": None}}, digests)
