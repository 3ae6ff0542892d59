"""vLLM's refusals reach the daemon as EngineRejected naming the route, the status and vLLM's message."""

from __future__ import annotations

import httpx
import pytest
from vllm_live import SLEEP_LEVEL_CHECKED

from colocd.engines.config import VLLMEngineConfig
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.errors import EngineProtocolError, EngineRejected, EngineUnreachable

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(
    ("method", "path", "params", "body", "message"),
    [
        # /pause's own ValueError branch (rl/online/api_router.py:62-66): {"error": "<text>"}.
        ("POST", "/pause", {"mode": "retract"}, None, "mode"),
        ("POST", "/collective_rpc", None, {"args": []}, "Missing 'method' in request body"),
        ("POST", "/update_weight_version", None, {}, "new_version"),
    ],
)
async def test_vllm_400s_become_engine_rejected_with_vllms_message(
    adapter: VLLMAdapter, method: str, path: str, params: dict[str, str] | None, body: object, message: str
) -> None:
    with pytest.raises(EngineRejected) as exc:
        await adapter._call(method, path, params=params, json=body)
    assert exc.value.status == 400
    assert exc.value.engine == "tiny"
    assert f"{method} {path}: HTTP 400" in str(exc.value)
    assert message in str(exc.value)


async def test_an_out_of_range_sleep_level_is_a_400_where_vllm_checks_it(
    adapter: VLLMAdapter, vllm_version: str
) -> None:
    # 0.32: FastAPI validation (Query(ge=0, le=2)) through vLLM's validation handler. 0.29 parses the level with a
    # bare int() and takes any (serve/dev/sleep/api_router.py:21-27); the adapter only ever sends 0..2.
    if not SLEEP_LEVEL_CHECKED[vllm_version]:
        await adapter._call("POST", "/sleep", params={"level": "5"})
        await adapter._call("POST", "/wake_up")
        return
    with pytest.raises(EngineRejected, match=r"(?s)POST /sleep: HTTP 400: .*level") as exc:
        await adapter._call("POST", "/sleep", params={"level": "5"})
    assert exc.value.status == 400


async def test_weight_checker_is_a_400_without_a_baseline_or_a_clear_error_where_absent(
    adapter: VLLMAdapter, vllm_version: str
) -> None:
    if vllm_version == "0.29.0":  # no /weight_checker (research/engine-versions.md §A.1)
        with pytest.raises(EngineRejected, match="POST /weight_checker: HTTP 404"):
            await adapter._call("POST", "/weight_checker", json={"action": "compare"})
        return
    with pytest.raises(EngineRejected, match="requires a 'baseline' object") as exc:
        await adapter._call("POST", "/weight_checker", json={"action": "compare"})
    assert exc.value.status == 400


async def test_second_begin_is_rejected_naming_the_active_update(adapter: VLLMAdapter) -> None:
    await adapter.begin_weight_update()
    try:
        with pytest.raises(EngineRejected, match="already active") as exc:
            await adapter.begin_weight_update()
        assert exc.value.status == 500
        assert "POST /collective_rpc" in str(exc.value)
    finally:
        await adapter.end_weight_update()


async def test_end_without_begin_is_rejected(adapter: VLLMAdapter) -> None:
    with pytest.raises(EngineRejected, match="no colocd weight update is active"):
        await adapter.end_weight_update()


async def test_unknown_worker_method_is_rejected_with_the_workers_error(adapter: VLLMAdapter) -> None:
    with pytest.raises(EngineRejected, match="no attribute 'colocd_no_such_method'"):
        await adapter._rpc("colocd_no_such_method")


async def test_dead_port_is_engine_unreachable(vllm_config: VLLMEngineConfig, client: httpx.AsyncClient) -> None:
    dead = vllm_config.model_copy(update={"url": "http://127.0.0.1:9"})
    with pytest.raises(EngineUnreachable, match="GET /version"):
        await VLLMAdapter(dead, client).attach()


async def test_tp_size_mismatch_is_refused_at_attach(
    vllm_config: VLLMEngineConfig, client: httpx.AsyncClient
) -> None:
    wrong = vllm_config.model_copy(update={"tp_size": 2})
    with pytest.raises(EngineProtocolError, match="tp_size=2"):
        await VLLMAdapter(wrong, client).attach()


async def test_server_without_the_worker_extension_is_named_before_any_update() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError(f"no call expected, got {request.url.path}")

    config = VLLMEngineConfig(name="v", url="http://vllm.test")
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(EngineProtocolError, match="--worker-extension-cls"):
            await VLLMAdapter(config, client).begin_weight_update()
