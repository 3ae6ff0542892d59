"""A trainer declares its manifest once: the open replies a ``manifest_ref`` for it, and the next open of the same
manifest sends only that reference (daemon/manifests.py, api/client.py). Seen on the wire: the client talks to
a front (``WireFront``) that forwards every request to the daemon behind it, keeps each open's body as it went,
and may put another daemon behind it, as a restart does."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
import torch
from support import InMemoryEngine, Receive, Scope, Send, daemon_node, request_body, serve_app, serve_lifespan

from colocd.api.client import AsyncColocdClient, ColocdClient, ColocdHTTPError
from colocd.daemon.node import Daemon
from colocd.trainer.producer import Producer
from colocd.trainer.push import WeightPusher, manifest_of

_OPEN = "/v1/weights/sessions"
NAMED = [(f"layers.{i}.weight", torch.zeros(8, 8)) for i in range(4)]
MANIFEST = manifest_of(NAMED)


class WireFront:
    """The address the trainer's client talks to: every request is forwarded to the daemon at ``behind`` (which
    a test may replace), and each open's JSON body is kept in ``opens`` as it arrived. ``predates_refs`` plays a
    daemon from before manifest references: its open replies carry none, and it refuses the field as unknown."""

    def __init__(self) -> None:
        self.behind = ""
        self.url = ""  # where it is served
        self.opens: list[dict[str, Any]] = []
        self.predates_refs = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        body = await request_body(receive)
        is_open = scope["method"] == "POST" and scope["path"] == _OPEN
        if is_open:
            self.opens.append(json.loads(body))
        if is_open and self.predates_refs and "manifest_ref" in self.opens[-1]:
            await _answer(send, 422, {"error": "ValidationError", "message": "manifest_ref: Extra inputs are not "
                                      "permitted", "field": "manifest_ref", "fields": [
                                          {"field": "manifest_ref", "message": "Extra inputs are not permitted"}]})
            return
        query = f"?{scope['query_string'].decode()}" if scope["query_string"] else ""
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            reply = await http.request(scope["method"], self.behind + scope["path"] + query, content=body,
                                       headers={"content-type": "application/json"})
        if is_open and self.predates_refs and reply.status_code == 200:
            await _answer(send, 200, {k: v for k, v in reply.json().items() if k != "manifest_ref"})
            return
        await send({"type": "http.response.start", "status": reply.status_code,
                    "headers": [(b"content-type", reply.headers.get("content-type", "text/plain").encode())]})
        await send({"type": "http.response.body", "body": reply.content})


async def _answer(send: Send, status: int, body: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


@asynccontextmanager
async def _fronted() -> AsyncIterator[tuple[WireFront, AsyncColocdClient, Daemon]]:
    front = WireFront()
    async with daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as node:
        front.behind = node.url
        async with serve_app(front) as front.url, AsyncColocdClient(front.url) as client:
            yield front, client, node.daemon


async def _open_and_abort(client: AsyncColocdClient, manifest: list[dict[str, Any]] = MANIFEST) -> dict[str, Any]:
    opened = await client.open_session("v1", ranks=1, manifest=manifest)
    await client.abort(opened["session_id"])
    return opened


async def test_the_open_reply_names_the_declared_manifest_by_its_reference() -> None:
    async with _fronted() as (_, client, daemon):
        opened = await _open_and_abort(client)
        assert isinstance(opened["manifest_ref"], str) and opened["manifest_tensors"] == len(MANIFEST)
        assert opened["manifest_ref"] in daemon.sessions.manifests
        without = await client.open_session("v1", ranks=1)
        assert without["manifest_ref"] is None


async def test_the_second_open_of_the_same_manifest_sends_only_its_reference() -> None:
    async with _fronted() as (front, client, _):
        first = await _open_and_abort(client)
        second = await _open_and_abort(client)
        assert "manifest" in front.opens[0] and "manifest_ref" not in front.opens[0]
        assert front.opens[1]["manifest_ref"] == first["manifest_ref"] and "manifest" not in front.opens[1]
        assert second["manifest_ref"] == first["manifest_ref"] and second["manifest_tensors"] == len(MANIFEST)


async def test_another_manifest_is_sent_in_full() -> None:
    async with _fronted() as (front, client, _):
        await _open_and_abort(client)
        await _open_and_abort(client, MANIFEST[:2])
        assert front.opens[1]["manifest"] == MANIFEST[:2]


async def test_a_session_opened_by_reference_holds_the_manifest_the_first_open_parsed() -> None:
    async with _fronted() as (_, client, daemon):
        await client.open_session("v1", ranks=1, manifest=MANIFEST)
        assert daemon.sessions.current is not None
        parsed = daemon.sessions.current.manifest
        await client.abort(daemon.sessions.current.id)
        await client.open_session("v2", ranks=1, manifest=MANIFEST)
        assert daemon.sessions.current.manifest is parsed


async def test_a_session_opened_by_reference_refuses_a_chunk_outside_its_manifest() -> None:
    async with _fronted() as (front, client, _):
        await _open_and_abort(client)
        sid = (await client.open_session("v1", ranks=1, manifest=MANIFEST))["session_id"]
        assert "manifest" not in front.opens[-1]
        chunk = Producer("shm").export([("layers.9.weight", torch.zeros(8, 8))])
        try:
            with pytest.raises(ColocdHTTPError) as err:
                await client.send_chunk(sid, seq=0, rank=0, chunk=chunk)
        finally:
            chunk.release()
        assert err.value.status == 422 and "not in the session's manifest" in err.value.body["message"]


async def test_an_unknown_reference_is_409_naming_manifest_ref_and_changes_nothing() -> None:
    async with (daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as node,
                httpx.AsyncClient(base_url=node.url, trust_env=False) as http):
        before = (await http.get("/v1/status")).json()
        reply = await http.post(_OPEN, json={"version": "v1", "ranks": 1, "manifest_ref": "0" * 32})
        assert reply.status_code == 409, reply.text
        assert reply.json()["error"] == "ManifestRefUnknown" and reply.json()["field"] == "manifest_ref"
        assert "send the manifest" in reply.json()["message"]
        after = (await http.get("/v1/status")).json()
        assert after["weight_session"] == before["weight_session"] and after["engines"] == before["engines"]
        assert node.daemon.sessions.current is None and len(node.daemon.sessions.manifests) == 0


async def test_a_manifest_sent_with_a_reference_not_its_own_is_422_naming_manifest_ref() -> None:
    async with (daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as node,
                httpx.AsyncClient(base_url=node.url, trust_env=False) as http):
        reply = await http.post(_OPEN, json={"version": "v1", "ranks": 1, "manifest": MANIFEST,
                                             "manifest_ref": "0" * 32})
        assert reply.status_code == 422, reply.text
        assert reply.json()["field"] == "manifest_ref"
        assert node.daemon.sessions.current is None and len(node.daemon.sessions.manifests) == 0


async def test_a_manifest_sent_with_its_own_reference_opens() -> None:
    async with _fronted() as (front, client, _), httpx.AsyncClient(base_url=front.url, trust_env=False) as http:
        ref = (await _open_and_abort(client))["manifest_ref"]
        reply = await http.post(_OPEN, json={"version": "v1", "ranks": 1, "manifest": MANIFEST, "manifest_ref": ref})
        assert reply.status_code == 200, reply.text
        assert reply.json()["manifest_ref"] == ref


async def test_after_a_daemon_restart_the_client_sends_the_manifest_again_without_raising() -> None:
    front = WireFront()
    async with daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as node:
        front.behind = node.url
        async with serve_app(front) as front.url, AsyncColocdClient(front.url) as client:
            ref = (await _open_and_abort(client))["manifest_ref"]
            async with daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as restarted:
                front.behind = restarted.url  # the same address, a daemon that never saw the manifest
                reopened = await _open_and_abort(client)
                assert [("manifest" in o, o.get("manifest_ref")) for o in front.opens[1:]] == [
                    (False, ref), (True, None)]
                assert reopened["manifest_ref"] == ref and ref in restarted.daemon.sessions.manifests
                await _open_and_abort(client)
                assert front.opens[-1].get("manifest_ref") == ref and "manifest" not in front.opens[-1]


async def test_a_daemon_without_manifest_refs_is_sent_the_manifest_every_time() -> None:
    async with _fronted() as (front, client, _):
        front.predates_refs = True
        for _ in range(2):
            await _open_and_abort(client)
        assert all("manifest" in o and "manifest_ref" not in o for o in front.opens)


async def test_a_daemon_that_refuses_the_field_as_unknown_is_sent_the_manifest_instead() -> None:
    async with _fronted() as (front, client, _):
        await _open_and_abort(client)
        front.predates_refs = True  # downgraded under the same address
        opened = await _open_and_abort(client)
        assert "manifest_ref" in front.opens[1] and "manifest" in front.opens[2]
        assert opened["manifest_tensors"] == len(MANIFEST)


async def test_the_sync_client_sends_the_reference_on_its_second_open() -> None:
    async with _fronted() as (front, _, _):
        def two_opens() -> None:
            with ColocdClient(front.url) as sync:
                for _ in range(2):
                    sync.abort(sync.open_session("v1", ranks=1, manifest=MANIFEST)["session_id"])
        await asyncio.to_thread(two_opens)
        assert "manifest" in front.opens[0]
        assert "manifest_ref" in front.opens[1] and "manifest" not in front.opens[1]


async def test_a_pushers_second_push_over_http_declares_its_manifest_by_reference() -> None:
    async with (_fronted() as (front, client, _),
                WeightPusher(client, transport="inline", bucket_mb=0.02) as pusher):
        await pusher.push(NAMED, version="v1")
        await pusher.push(NAMED, version="v2")
        assert "manifest" in front.opens[0]
        assert "manifest_ref" in front.opens[1] and "manifest" not in front.opens[1]
        assert (await client.status())["engines"]["e0"]["weight_version"] == "v2"


async def test_the_openapi_document_describes_manifest_ref_in_the_open_request_and_reply() -> None:
    async with (daemon_node(adapters={"e0": InMemoryEngine("e0")}, synced_at=1) as node,
                httpx.AsyncClient(base_url=node.url, trust_env=False) as http):
        spec = (await http.get("/openapi.json")).json()
    schemas = spec["components"]["schemas"]
    requested = schemas["OpenSessionRequest"]["properties"]["manifest_ref"]
    assert any(alt.get("pattern") for alt in requested["anyOf"]) and "409" in requested["description"]
    assert "manifest_ref" in schemas["OpenSessionReply"]["properties"]
    assert "409" in spec["paths"][_OPEN]["post"]["responses"]
