"""The framed chunk channel (issue 12 item 6): the chunk calls of the HTTP API on one Unix-socket connection.

The module's reference engine process (reset between tests) and a daemon per test, in the test's event loop.
The channel must carry exactly the HTTP route's semantics: every chunk verified by the engine's checksum,
caller mistakes answered with the same error bodies (plus ``status``) while the connection and the daemon keep
serving, a wrong token refused, and a trainer that drops its connection mid-stream treated as one that went
quiet (the session's lease expires it and unlinks its segments).
"""

from __future__ import annotations

import asyncio
import json
import os
import stat
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import torch
from support import daemon_node, shm_segments

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.chunks import plan_chunks, tensor_checksum
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.channel import ChunkChannel
from colocd.trainer.producer import producer_for
from colocd.trainer.push import WeightPusher, manifest_of

Named = list[tuple[str, torch.Tensor]]
DEADLINE_S = 60
TOKEN = "channel-secret"


@dataclass
class Node:
    client: AsyncColocdClient
    url: str  # the daemon's
    engine_url: str


@asynccontextmanager
async def _node(engine: ReferenceEngineProcess, tmp_path: Any, *, token: str | None = TOKEN,
                listen: dict[str, Any] | None = None, **config: Any) -> AsyncIterator[Node]:
    """A daemon over ``engine`` in the test's event loop, left in ``sync`` at step 1 (weights stale)."""
    async with daemon_node({"ref0": str(engine.url)}, token=token, listen=listen or {}, **config) as daemon:
        await daemon.client.phase("train", 1)
        await daemon.client.phase("sync", 1)
        yield Node(daemon.client, daemon.url, str(engine.url))


def _model(seed: int) -> Named:
    return list(build_model(QwenLikeConfig(), seed=seed).named_parameters())


async def _checksum(engine_url: str) -> str:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        r = await http.post(f"{engine_url}/weights_checker", json={"action": "checksum"})
        r.raise_for_status()
        return str(r.json()["colocd_checksum"])


class RawConnection:
    """The channel as bytes on a socket: what a buggy or hostile trainer could send."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    @classmethod
    async def open(cls, address: str) -> RawConnection:
        return cls(*await asyncio.open_unix_connection(address.removeprefix("unix:")))

    async def send(self, frame: bytes | dict[str, Any]) -> dict[str, Any]:
        """One frame out, one reply in."""
        self.writer.write(frame if isinstance(frame, bytes) else json.dumps(frame).encode() + b"\n")
        async with asyncio.timeout(DEADLINE_S):
            line = await self.reader.readline()
        assert line, "the daemon closed the connection instead of answering"
        reply: dict[str, Any] = json.loads(line)
        return reply

    async def closed_by_daemon(self) -> bool:
        async with asyncio.timeout(DEADLINE_S):
            return await self.reader.read() == b""

    def close(self) -> None:
        self.writer.close()


async def _open(node: Node, version: str, named: Named) -> dict[str, Any]:
    return await node.client.open_session(version, step=1, ranks=1, depth=2, manifest=manifest_of(named))


async def _open_with_channel(node: Node, version: str, named: Named) -> tuple[str, str]:
    """A fresh session's id and the chunk channel its open reply advertises."""
    reply = await _open(node, version, named)
    return reply["session_id"], reply["chunk_channel"]


async def test_a_push_over_the_channel_lands_byte_identical_and_the_socket_is_private(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=5)
        pusher = WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2)
        report = await pusher.push(named, version="over-channel", step=1)
        assert pusher.last_path == "channel"
        assert report.chunks >= 5 and len(pusher.chunk_log) == report.chunks
        assert await _checksum(node.engine_url) == tensor_checksum(named)
        assert 1 <= report.commit["max_in_flight"]["ref0"] <= 2

        probe = await _open(node, "probe", named)
        address = probe["chunk_channel"]
        assert address.startswith("unix:")
        assert (await node.client.session(probe["session_id"]))["chunk_channel"] == address  # GET says the same
        assert stat.S_IMODE(os.stat(address.removeprefix("unix:")).st_mode) == 0o600
        await node.client.abort(probe["session_id"])
    assert not os.path.exists(address.removeprefix("unix:"))  # noqa: ASYNC240 (the daemon removed its socket)


async def test_caller_mistakes_get_error_frames_naming_the_field_and_the_connection_keeps_serving(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path, limits={"max_body_bytes": 64 * 1024}) as node:
        named = _model(seed=6)
        sid, address = await _open_with_channel(node, "mistakes", named)
        conn = await RawConnection.open(address)
        greeting = await conn.send({"session_id": sid, "rank": 0, "token": TOKEN})
        assert greeting["channel"] == "colocd-chunks/1" and greeting["max_frame_bytes"] == 64 * 1024

        not_json = await conn.send(b"{this is not json\n")
        assert (not_json["status"], not_json["error"]) == (400, "BadRequest")
        wrong_type = await conn.send({"seq": "zero", "transport": "shm", "nbytes": 1, "handle": {}})
        assert (wrong_type["status"], wrong_type["field"]) == (422, "seq") and "seq" not in wrong_type
        handle = {"shm_name": "colocd-1-ab", "nbytes": 1, "layout": []}  # well formed: another field is at fault
        unknown_key = await conn.send({"seq": 0, "transport": "shm", "nbytes": 1, "handle": handle, "extra": 1})
        assert (unknown_key["status"], unknown_key["field"], unknown_key["seq"]) == (422, "extra", 0)
        other_rank = await conn.send({"seq": 0, "rank": 1, "transport": "shm", "nbytes": 1, "handle": handle})
        assert (other_rank["status"], other_rank["field"]) == (422, "rank")
        # The same refusal HTTP gives for a handle that names no segment: 422 before any engine call.
        missing = await conn.send({"seq": 0, "transport": "shm", "nbytes": 8,
                                   "handle": {"shm_name": "colocd-0-missing", "nbytes": 8, "layout": []}})
        with pytest.raises(ColocdHTTPError) as over_http:
            await node.client._call("POST", f"/v1/weights/sessions/{sid}/chunks", {
                "seq": 0, "transport": "shm", "nbytes": 8,
                "handle": {"shm_name": "colocd-0-missing", "nbytes": 8, "layout": []}})
        assert missing["status"] == over_http.value.status == 422
        assert {k: v for k, v in missing.items() if k not in ("status", "seq")} == over_http.value.body

        # After every mistake the same connection carries the real chunks, and the session commits.
        producer = producer_for("shm")
        buckets = list(plan_chunks(named, 20_000))
        for seq, bucket in enumerate(buckets):
            chunk = producer.export(bucket)
            ack = await conn.send({"seq": seq, "transport": "shm", "nbytes": chunk.nbytes, "handle": chunk.handle})
            assert (ack["seq"], ack["rank"], ack["engines"]) == (seq, 0, ["ref0"]) and ack["load_s"] > 0
            chunk.release()
        await node.client.commit(sid, len(buckets))
        assert await _checksum(node.engine_url) == tensor_checksum(named)

        # A frame over the limit cannot be framed any more: refused, then the connection closes.
        too_big = await conn.send(b'{"seq": 99, "pad": "' + b"x" * 100_000 + b'"}\n')
        assert (too_big["status"], too_big["error"]) == (413, "PayloadTooLarge")
        assert await conn.closed_by_daemon()
        conn.close()
        assert (await node.client.status())["weight_session"]["state"] == "committed"  # still serving


async def test_a_wrong_token_or_an_unknown_session_is_refused_at_hello(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=7)
        sid, address = await _open_with_channel(node, "hello", named)
        for hello, status, field in (
            ({"session_id": sid, "rank": 0, "token": "wrong"}, 401, "token"),
            ({"session_id": sid, "rank": 0}, 401, "token"),
            ({"session_id": "no-such-session", "rank": 0, "token": TOKEN}, 404, None),
            ({"session_id": sid, "rank": 3, "token": TOKEN}, 422, "rank"),
            ({"session": sid, "token": TOKEN}, 422, "open"),  # no session named (and the field it has, refused)
            ({"token": TOKEN}, 422, "open"),  # neither a session nor one to open
            ({"session_id": sid, "open": {"version": "v"}, "token": TOKEN}, 422, "open"),  # both
        ):
            conn = await RawConnection.open(address)
            refused = await conn.send(hello)
            assert (refused["status"], refused.get("field")) == (status, field), refused
            assert await conn.closed_by_daemon()
            conn.close()
        with pytest.raises(ColocdHTTPError) as err:
            await ChunkChannel.connect(address, session_id=sid, rank=0, token="wrong")
        assert err.value.status == 401
        # The session is untouched: the right token streams it.
        await WeightPusher(node.client, bucket_mb=0.05, channel="channel").stream(sid, named)
        await node.client.commit(sid)
        assert await _checksum(node.engine_url) == tensor_checksum(named)


async def test_the_greeting_joins_the_session_as_the_http_join_does_and_a_refused_join_closes_it(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=11)
        sid, address = await _open_with_channel(node, "greeting-join", named)
        channel = await ChunkChannel.connect(address, session_id=sid, rank=0, token=TOKEN, device_id="cpu:0")
        assert channel.joined is not None and channel.joined["streams"] is True
        # Joining again on the same device is a no-op, so HTTP now answers what the greeting did.
        assert channel.joined == await node.client.join_session(sid, rank=0, device_id="cpu:0")
        await channel.aclose()

        conn = await RawConnection.open(address)
        refused = await conn.send({"session_id": sid, "rank": 0, "token": TOKEN, "device_id": "cpu:7"})
        assert refused["status"] == 409 and "joined on device 'cpu:0'" in refused["message"], refused
        assert await conn.closed_by_daemon()
        conn.close()
        conn = await RawConnection.open(address)
        refused = await conn.send({"session_id": sid, "rank": 0, "token": TOKEN, "device_id": ""})
        assert (refused["status"], refused.get("field")) == (422, "device_id"), refused
        conn.close()
        assert (await node.client.session(sid))["state"] == "open"  # refusals changed nothing
        await node.client.abort(sid)

        # The pusher joins in its greeting: no HTTP join per stream.
        http_joins: list[int] = []
        join_over_http = node.client.join_session

        async def counted_join(*args: Any, **kwargs: Any) -> dict[str, Any]:
            http_joins.append(1)
            return await join_over_http(*args, **kwargs)

        node.client.join_session = counted_join  # type: ignore[method-assign]
        pusher = WeightPusher(node.client, transport="shm", bucket_mb=0.05)
        await pusher.push(named, version="joined-in-greeting", step=1)
        assert pusher.last_path == "channel" and not http_joins
        assert pusher.last_join is not None and pusher.last_join["feeds"] == [{"engine": "ref0", "tp_rank": 0}]
        assert await _checksum(node.engine_url) == tensor_checksum(named)


@asynccontextmanager
async def _older_daemon_channel(real: str, tmp_path: Any) -> AsyncIterator[str]:
    """The real channel behind a door that answers a hello carrying ``device_id`` as a daemon from before joining
    in the hello did (its strict hello model forbids the field), and passes everything else through."""
    refusal = {"error": "ValidationError", "field": "device_id", "status": 422,
               "message": "hello frame: device_id: Extra inputs are not permitted",
               "fields": [{"field": "device_id", "message": "Extra inputs are not permitted"}]}
    hellos: list[dict[str, Any]] = []

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
        dst.close()

    async def door(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = json.loads(await reader.readline())
        hellos.append(hello)
        if "device_id" in hello:
            writer.write(json.dumps(refusal).encode() + b"\n")
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_unix_connection(real.removeprefix("unix:"))
        up_writer.write(json.dumps(hello).encode() + b"\n")
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer), return_exceptions=True)

    path = tmp_path / "older.sock"
    server = await asyncio.start_unix_server(door, str(path))
    try:
        yield f"unix:{path}"
    finally:
        server.close()
    assert [("device_id" in h) for h in hellos] == [True, False]


async def test_against_a_daemon_whose_hello_cannot_join_the_pusher_greets_plainly_and_joins_over_http(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=12)
        sid, real = await _open_with_channel(node, "older-daemon", named)
        async with _older_daemon_channel(real, tmp_path) as older:
            pusher = WeightPusher(node.client, transport="shm", bucket_mb=0.05, channel="channel")
            await pusher.stream(sid, named, chunk_channel=older)
        assert pusher.last_path == "channel"
        assert pusher.last_join is not None and pusher.last_join["device_id"] == "cpu:0"  # joined over HTTP
        await node.client.commit(sid)
        assert await _checksum(node.engine_url) == tensor_checksum(named)


async def test_a_connection_dropped_mid_stream_leaves_the_session_to_its_lease(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path, timeouts={"session_idle_s": 1.5}) as node:
        named = _model(seed=8)
        sid, address = await _open_with_channel(node, "dropped", named)
        channel = await ChunkChannel.connect(address, session_id=sid, rank=0, token=TOKEN)
        producer = producer_for("shm")
        sent = [producer.export(bucket) for bucket in list(plan_chunks(named, 20_000))[:2]]
        for seq, chunk in enumerate(sent):
            await channel.send_chunk(sid, seq=seq, rank=0, chunk=chunk)
        await channel.aclose()  # gone mid-stream, its segments left behind (never released)
        segments = {c.handle["shm_name"] for c in sent}
        assert segments <= shm_segments()
        assert (await node.client.session(sid))["state"] == "open"  # a dropped connection alone changes nothing

        async with asyncio.timeout(DEADLINE_S):
            while (await node.client.session(sid))["state"] == "open":  # noqa: ASYNC110
                await asyncio.sleep(0.1)  # polling cadence until the lease lapses
        session = await node.client.session(sid)
        assert session["state"] == "expired" and "idle limit" in session["error"]
        # The state turns expired first; closing (the engines' end of the update, then the unlink) follows.
        async with asyncio.timeout(DEADLINE_S):
            while segments & shm_segments():  # noqa: ASYNC110
                await asyncio.sleep(0.05)  # polling cadence until the daemon unlinked the trainer's segments
        with pytest.raises(ColocdHTTPError) as err:
            await ChunkChannel.connect(address, session_id=sid, rank=0, token=TOKEN)
        assert (err.value.status, err.value.body["session_state"]) == (410, "expired")

        # The next push needs no manual call, over the channel again.
        fresh = _model(seed=9)
        pusher = WeightPusher(node.client, bucket_mb=0.05)
        await pusher.push(fresh, version="after-drop", step=1)
        assert pusher.last_path == "channel"
        assert await _checksum(node.engine_url) == tensor_checksum(fresh)


async def test_with_the_channel_off_the_pusher_uses_http_and_says_so(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path, token=None, listen={"chunk_channel": "off"}) as node:
        named = _model(seed=10)
        reply = await _open(node, "no-channel", named)
        assert reply["chunk_channel"] is None
        await node.client.abort(reply["session_id"])
        pusher = WeightPusher(node.client, bucket_mb=0.05)
        await pusher.push(named, version="over-http", step=1)
        assert pusher.last_path == "http"
        assert await _checksum(node.engine_url) == tensor_checksum(named)
        with pytest.raises(ConnectionError):
            await WeightPusher(node.client, bucket_mb=0.05, channel="channel").push(named, version="x", step=1)


# --- a one-rank push opens and commits on the channel ----------------------------------------------


async def _to_sync_of_step_2(node: Node) -> None:
    """Step 1's rollout (after its push), then step 2's train and sync: the node ready for the next push."""
    await node.client.phase("rollout", 1)
    await node.client.phase("train", 2)
    await node.client.phase("sync", 2)


def _count_http(client: AsyncColocdClient) -> dict[str, int]:
    """Counts the client's HTTP session opens and commits (an open it sends another way, ``send``, is not one)."""
    counts = {"open": 0, "commit": 0}
    open_session, commit = client.open_session, client.commit

    async def counted_open(*args: Any, **kw: Any) -> dict[str, Any]:
        counts["open"] += kw.get("send") is None
        return await open_session(*args, **kw)

    async def counted_commit(*args: Any, **kw: Any) -> dict[str, Any]:
        counts["commit"] += 1
        return await commit(*args, **kw)

    client.open_session = counted_open  # type: ignore[method-assign]
    client.commit = counted_commit  # type: ignore[method-assign]
    return counts


async def test_a_pushers_next_push_opens_and_commits_on_the_chunk_channel_and_lands_verified(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=11)
        counts = _count_http(node.client)
        async with WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2) as pusher:
            await pusher.push(named, version="first", step=1)
            assert counts == {"open": 1, "commit": 0}  # the first open learns where the channel is
            await _to_sync_of_step_2(node)
            named = _model(seed=12)
            report = await pusher.push(named, version="second", step=2)
        assert counts == {"open": 1, "commit": 0}
        assert report.commit["state"] == "committed" and report.commit["verification"]["mode"] == "full"
        assert all(v == "verified" for v in [e["status"] for e in report.commit["verification"]["engines"].values()])
        assert await _checksum(node.engine_url) == tensor_checksum(named)
        assert (await node.client.status())["engines"]["ref0"]["weight_version"] == "second"


async def test_an_open_the_daemon_refuses_on_the_channel_is_the_same_error_as_over_http_and_opens_nothing(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=13)
        sid, address = await _open_with_channel(node, "first", named)
        await node.client.abort(sid)
        conn = await RawConnection.open(address)  # the node is at step 1: an open for step 2 is refused
        refused = await conn.send({"open": {"version": "v", "step": 2, "ranks": 1}, "rank": 0, "token": TOKEN,
                                   "device_id": "cpu:0"})
        assert (refused["status"], refused["field"]) == (422, "step"), refused
        assert await conn.closed_by_daemon()
        conn.close()
        assert (await node.client.status())["weight_session"]["id"] == sid  # still the aborted one: none opened
        with pytest.raises(ColocdHTTPError) as over_http:
            await node.client.open_session("v", step=2, ranks=1)
        assert (over_http.value.status, over_http.value.body["field"]) == (422, "step")


async def test_a_commit_frame_with_a_wrong_chunk_count_is_refused_and_the_connection_then_commits(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=14)
        async with WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2) as pusher:
            await pusher.push(named, version="learn-the-channel", step=1)  # the pusher now knows the address
            await _to_sync_of_step_2(node)
            session = await pusher.open(named, version="v2", step=2)
            assert session.channel is not None and session.reply["session_id"] == session.session_id
            chunks, _ = await pusher.stream(session.session_id, named, session=session)
            with pytest.raises(ColocdHTTPError) as refused:
                await session.channel.commit(chunks + 1)
            assert (refused.value.status, refused.value.body.get("frame")) == (422, "commit")
            reply = await session.channel.commit(chunks)
            await session.aclose()
        assert reply["state"] == "committed" and reply["chunks_consumed"] == chunks
        assert await _checksum(node.engine_url) == tensor_checksum(named)


async def test_a_push_whose_remembered_channel_is_unreachable_opens_streams_and_commits_over_http(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=15)
        counts = _count_http(node.client)
        async with WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2) as pusher:
            first = await pusher.push(named, version="learn", step=1)
            address = (await node.client.session(first.session_id))["chunk_channel"]
            os.unlink(address.removeprefix("unix:"))  # the socket is gone (as behind another mount namespace)
            await _to_sync_of_step_2(node)
            named = _model(seed=16)
            report = await pusher.push(named, version="over-http", step=2)
        assert counts == {"open": 2, "commit": 1} and pusher.last_path == "http"
        assert report.commit["state"] == "committed"
        assert await _checksum(node.engine_url) == tensor_checksum(named)


async def test_a_session_opened_on_a_connection_that_then_closes_unused_is_aborted_and_frees_the_node(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        _, address = await _open_with_channel(node, "learn-the-address", _model(seed=17))
        await node.client.abort((await node.client.status())["weight_session"]["id"])
        conn = await RawConnection.open(address)
        greeting = await conn.send({"open": {"version": "v", "step": 1, "ranks": 1}, "rank": 0, "token": TOKEN})
        sid = greeting["session_id"]
        conn.close()  # as a trainer that died before it read the greeting
        async with asyncio.timeout(DEADLINE_S):
            while (await node.client.session(sid))["state"] == "open":  # noqa: ASYNC110 (polls the daemon, bounded)
                await asyncio.sleep(0.05)
        assert (await node.client.session(sid))["state"] == "aborted"
        # The abort's close (ending the engines' update) holds the node a moment after the state says aborted.
        async with asyncio.timeout(DEADLINE_S):
            while (await node.client.status())["busy_with"] is not None:  # noqa: ASYNC110 (polls the daemon, bounded)
                await asyncio.sleep(0.05)
        reopened = await node.client.open_session("v", step=1, ranks=1)  # the node is free again
        await node.client.abort(reopened["session_id"])


async def test_a_new_pusher_on_the_same_client_opens_on_the_channel_the_clients_last_open_named(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    # TrainerClient.push_weights (the README's push) makes a pusher per push over one client.
    async with _node(pooled_engine, tmp_path) as node:
        counts = _count_http(node.client)
        async with WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2) as first:
            await first.push(_model(seed=18), version="first", step=1)
        await _to_sync_of_step_2(node)
        named = _model(seed=19)
        async with WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2) as second:
            await second.push(named, version="second", step=2)
        assert counts == {"open": 1, "commit": 0}
        assert await _checksum(node.engine_url) == tensor_checksum(named)


async def test_a_commit_frame_sent_right_behind_the_chunks_before_their_acks_commits_once_they_are_consumed(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with _node(pooled_engine, tmp_path) as node:
        named = _model(seed=20)
        sid, address = await _open_with_channel(node, "behind", named)
        conn = await RawConnection.open(address)
        assert (await conn.send({"session_id": sid, "rank": 0, "token": TOKEN}))["session_id"] == sid
        producer = producer_for("shm")
        chunks = [producer.export(bucket) for bucket in plan_chunks(named, 20_000)]
        frames: list[dict[str, Any]] = [{"seq": seq, "transport": "shm", "nbytes": c.nbytes, "handle": c.handle}
                                        for seq, c in enumerate(chunks)]
        frames.append({"commit": {"num_chunks": len(chunks)}})
        # Every chunk and the commit written at once: nothing is read before the last frame is out.
        conn.writer.write(b"".join(json.dumps(f).encode() + b"\n" for f in frames))
        replies = []
        async with asyncio.timeout(DEADLINE_S):
            for _ in frames:
                replies.append(json.loads(await conn.reader.readline()))
        for chunk in chunks:
            chunk.release()
        conn.close()
        assert sorted(r["seq"] for r in replies[:-1]) == list(range(len(chunks)))  # every ack, then the commit
        assert replies[-1]["commit"]["state"] == "committed"
        assert replies[-1]["commit"]["chunks_consumed"] == len(chunks)
        assert await _checksum(node.engine_url) == tensor_checksum(named)


async def test_a_push_on_the_channel_sends_its_commit_behind_the_last_chunk_and_collects_its_reply(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[int] = []
    send_commit = ChunkChannel.send_commit

    def spy(channel: ChunkChannel, num_chunks: int) -> asyncio.Future[dict[str, Any]]:
        sent.append(num_chunks)
        return send_commit(channel, num_chunks)

    monkeypatch.setattr(ChunkChannel, "send_commit", spy)
    async with _node(pooled_engine, tmp_path) as node:
        async with WeightPusher(node.client, transport="shm", bucket_mb=0.05, depth=2) as pusher:
            # Opened over HTTP (no channel known yet), joined and committed on the channel.
            first = await pusher.push(_model(seed=21), version="joined-on-the-channel", step=1)
            assert sent == [first.chunks] and first.commit["chunks_consumed"] == first.chunks
            await _to_sync_of_step_2(node)
            named = _model(seed=22)
            report = await pusher.push(named, version="opened-on-the-channel", step=2)
        assert sent == [first.chunks, report.chunks] and report.commit["chunks_consumed"] == report.chunks
        assert report.commit["state"] == "committed"
        assert await _checksum(node.engine_url) == tensor_checksum(named)
