"""A chunk's handle is parsed into its transport's model at the API (engines/handles.py): a malformed field is a
422 naming it before any engine sees the chunk; nothing changes on
the session or the engine; the OpenAPI schema shows each transport's model.

The module's reference engine (reset between tests) and a daemon per test, in the test's event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from support import daemon_node, engine_tags, served_checksums

from colocd.engines.reference.launcher import ReferenceEngineProcess

pytestmark = pytest.mark.asyncio(loop_scope="module")

DEADLINE_S = 60
LAYOUT = [{"name": "w", "dtype": "float32", "shape": [2], "offset": 0}]

# Per transport, a handle wrong in the form of one field only, and that field: the API's models are the only check
# of a field's form (``Handle.inspect`` checks on the node only what the node can tell), and a field that makes no
# sense for the transport would have failed the session in the engine (colocd's loaders refuse it).
MALFORMED = [
    ("shm", {"shm_name": "colocd-1-ab", "nbytes": 8, "layout": LAYOUT, "device_uuid": "GPU-0"}, "handle.device_uuid"),
    ("shm", {"shm_name": "colocd-1-ab", "nbytes": "8", "layout": LAYOUT}, "handle.nbytes"),
    ("shm", {"shm_name": "colocd-1-ab", "nbytes": True, "layout": LAYOUT}, "handle.nbytes"),
    ("shm", {"shm_name": "colocd-1-ab", "layout": LAYOUT}, "handle.nbytes"),
    ("disk", {"path": "/etc/hostname", "layout": LAYOUT, "device_uuid": "GPU-0"}, "handle.device_uuid"),
    ("disk", {"path": "/etc/hostname", "layout": LAYOUT, "nbytes": 8}, "handle.nbytes"),
    ("inline", {"layout": LAYOUT}, "handle.payload_b64"),
    ("inline", {"payload_b64": "AAAA", "layout": LAYOUT, "shm_name": "colocd-1-ab"}, "handle.shm_name"),
    ("cuda_ipc", {"payload_b64": "AAAA", "load_format": 5, "layout": LAYOUT}, "handle.load_format"),
    ("cuda_ipc", {"payload_b64": "AAAA", "layout": LAYOUT, "path": "/etc/hostname"}, "handle.path"),
    ("cuda_ipc", {"layout": LAYOUT}, "handle.payload_b64"),
    # Another program's /dev/shm file, or a path out of it: refused by name, whether or not it exists.
    ("shm", {"shm_name": "nccl-abc123", "nbytes": 8, "layout": LAYOUT}, "handle.shm_name"),
    ("shm", {"shm_name": ".hidden", "nbytes": 8, "layout": LAYOUT}, "handle.shm_name"),
    ("disk", {"path": 5, "layout": LAYOUT}, "handle.path"),
]
IDS = [f"{t}-{f.removeprefix('handle.')}" for t, _, f in MALFORMED]


@asynccontextmanager
async def _open_session(engine: ReferenceEngineProcess) -> AsyncIterator[tuple[httpx.AsyncClient, dict[str, Any]]]:
    """A daemon over ``engine`` in sync with one session open; the client and the open reply."""
    async with daemon_node({"ref0": str(engine.url)}) as node, \
            httpx.AsyncClient(base_url=node.url, timeout=DEADLINE_S, trust_env=False) as http:
        await node.client.phase("train", 1)
        await node.client.phase("sync", 1)
        opened = (await http.post("/v1/weights/sessions", json={"version": "v1", "ranks": 1})).json()
        yield http, opened
        await http.post(f"/v1/weights/sessions/{opened['session_id']}/abort")


async def _engine_view(engine: ReferenceEngineProcess) -> tuple[list[str], dict[str, Any]]:
    """The engine's weights checksums and memory tags: what a chunk that reached it would change."""
    async with httpx.AsyncClient(base_url=str(engine.url), trust_env=False, timeout=DEADLINE_S) as http:
        return await served_checksums(str(engine.url)), engine_tags((await http.get("/server_info")).json())


async def _session_view(http: httpx.AsyncClient, session_id: str) -> dict[str, Any]:
    view = dict((await http.get(f"/v1/weights/sessions/{session_id}")).json())
    view.pop("idle_for_s", None)
    return view


def _chunk(transport: str, handle: dict[str, Any]) -> dict[str, Any]:
    return {"seq": 0, "rank": 0, "transport": transport, "nbytes": 8, "handle": handle}


@pytest.mark.parametrize("transport, handle, field", MALFORMED, ids=IDS)
async def test_a_malformed_handle_posted_is_422_naming_its_field_and_nothing_changes(
        pooled_engine: ReferenceEngineProcess, transport: str, handle: dict[str, Any], field: str) -> None:
    async with _open_session(pooled_engine) as (http, opened):
        sid = opened["session_id"]
        engine_before, session_before = await _engine_view(pooled_engine), await _session_view(http, sid)
        r = await http.post(f"/v1/weights/sessions/{sid}/chunks", json=_chunk(transport, handle))
        assert r.status_code == 422, r.text
        assert r.json()["field"] == field, r.json()
        assert await _session_view(http, sid) == session_before
        assert await _engine_view(pooled_engine) == engine_before


@pytest.mark.parametrize("retired", ["ipc_ring", "zero_copy"])
async def test_a_chunk_of_a_transport_no_engine_loads_is_422_naming_the_transport(
        pooled_engine: ReferenceEngineProcess, retired: str) -> None:
    async with _open_session(pooled_engine) as (http, opened):
        sid = opened["session_id"]
        session_before = await _session_view(http, sid)
        r = await http.post(f"/v1/weights/sessions/{sid}/chunks",
                            json=_chunk(retired, {"ring": "r", "slot": 0, "layout": LAYOUT}))
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "transport", r.json()
        assert await _session_view(http, sid) == session_before


async def test_a_one_shot_update_names_the_chunk_and_the_field_and_leaves_the_engine_as_it_was(
        pooled_engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}) as node, \
            httpx.AsyncClient(base_url=node.url, timeout=DEADLINE_S, trust_env=False) as http:
        await node.client.phase("train", 1)
        await node.client.phase("sync", 1)
        before = await _engine_view(pooled_engine)
        good = {"shm_name": "colocd-1-ab", "nbytes": 8, "layout": LAYOUT}
        r = await http.post("/v1/update_weights", json={"version": "v2", "chunks": [
            _chunk("shm", good), {**_chunk("shm", {**good, "shm_name": "../etc/passwd"}), "seq": 1}]})
        assert r.status_code == 422, r.text
        assert r.json()["field"] == "chunks.1.handle.shm_name", r.json()
        assert await _engine_view(pooled_engine) == before


async def test_openapi_shows_each_transports_handle_model(pooled_engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, ready=False) as node, \
            httpx.AsyncClient(base_url=node.url, timeout=DEADLINE_S, trust_env=False) as http:
        schemas = (await http.get("/openapi.json")).json()["components"]["schemas"]
    variants = {ref["$ref"].rsplit("/", 1)[-1]
                for ref in schemas["ChunkDescriptor"]["properties"]["handle"]["anyOf"]}
    assert variants == {"ShmHandle", "DiskHandle", "InlineHandle", "CudaIpcHandle"}
    assert {"shm_name", "nbytes"} <= set(schemas["ShmHandle"]["required"])
