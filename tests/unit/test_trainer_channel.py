"""The trainer's end of the chunk channel against a peer that is not colocd: a Unix socket speaking the protocol.

``colocd.api.chunk_channel`` is the daemon's side; ``tests/integration/test_chunk_channel.py`` runs both ends
against a real daemon. Here the peer says exactly what each case needs, so the trainer's side of the protocol
is pinned on its own: acks matched by ``seq`` in whatever order they come, error frames, a frame that arrives
with the greeting, and a daemon that hangs up while chunks wait.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from colocd.api.client import ColocdHTTPError
from colocd.engines.chunks import ChunkLayout
from colocd.policies import Transport
from colocd.trainer.channel import MAX_REPLY_BYTES, ChannelClosed, ChunkChannel
from colocd.trainer.exported import ExportedPart

DEADLINE_S = 10
GREETING = {"channel": "colocd-chunks/1", "session_id": "s1", "rank": 0, "max_frame_bytes": 1 << 20,
            "max_in_flight": 64}
Peer = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def _line(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode() + b"\n"


def _chunk(seq: int) -> ExportedPart:
    """A chunk descriptor naming a segment that does not exist: the peer never opens the handle."""
    return ExportedPart(Transport.SHM, 8, {"shm_name": f"seg{seq}"}, ChunkLayout((), 8))


@asynccontextmanager
async def _peer(tmp_path: Path, serve: Peer) -> AsyncIterator[str]:
    path = tmp_path / "chunks.sock"
    server = await asyncio.start_unix_server(serve, path=str(path))
    try:
        yield f"unix:{path}"
    finally:
        server.close()


async def _frames(reader: asyncio.StreamReader, count: int) -> list[dict[str, Any]]:
    return [json.loads(await reader.readline()) for _ in range(count)]


async def test_acks_reach_their_chunks_by_seq_in_the_order_the_daemon_finishes_them(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        hello = json.loads(await reader.readline())
        writer.write(_line({**GREETING, "session_id": hello["session_id"]}))
        frames = await _frames(reader, 2)
        # Both acks in one write, the later chunk first: the trainer must match them by seq.
        writer.write(b"".join(_line({"seq": f["seq"], "rank": 0, "engines": ["e"], "load_s": 0.1 * f["seq"]})
                              for f in reversed(frames)))
        await reader.read()

    async with _peer(tmp_path, serve) as address, asyncio.timeout(DEADLINE_S):
        channel = await ChunkChannel.connect(address, session_id="s1")
        acks = await asyncio.gather(*(channel.send_chunk("s1", seq=seq, rank=0, chunk=_chunk(seq)) for seq in (0, 1)))
        assert [(a["seq"], a["load_s"]) for a in acks] == [(0, 0.0), (1, 0.1)]
        await channel.aclose()


async def test_an_error_frame_fails_its_chunk_with_the_status_and_the_channel_keeps_serving(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(_line(GREETING))
        (first,) = await _frames(reader, 1)
        writer.write(_line({"error": "RequestInvalid", "field": "seq", "message": "bad seq", "status": 422,
                            "seq": first["seq"]}))
        (second,) = await _frames(reader, 1)
        writer.write(_line({"seq": second["seq"], "rank": 0, "engines": ["e"], "load_s": 0.0}))
        await reader.read()

    async with _peer(tmp_path, serve) as address, asyncio.timeout(DEADLINE_S):
        channel = await ChunkChannel.connect(address, session_id="s1")
        with pytest.raises(ColocdHTTPError) as err:
            await channel.send_chunk("s1", seq=5, rank=0, chunk=_chunk(5))
        assert (err.value.status, err.value.body["field"]) == (422, "seq")
        assert (await channel.send_chunk("s1", seq=0, rank=0, chunk=_chunk(0)))["seq"] == 0
        await channel.aclose()


async def test_a_frame_that_arrives_with_the_greeting_is_not_lost(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        # One write: the greeting and, behind it, an error for no chunk (what a frame over the limit gets).
        writer.write(_line(GREETING) + _line({"error": "PayloadTooLarge", "message": "frame over the limit",
                                              "status": 413}))
        await reader.read()

    async with _peer(tmp_path, serve) as address, asyncio.timeout(DEADLINE_S):
        channel = await ChunkChannel.connect(address, session_id="s1")
        with pytest.raises(ChannelClosed, match="frame over the limit"):
            await channel.send_chunk("s1", seq=0, rank=0, chunk=_chunk(0))


async def test_a_reply_line_over_the_limit_ends_the_channel_even_when_it_arrives_whole(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(_line(GREETING))
        (frame,) = await _frames(reader, 1)
        writer.write(_line({"seq": frame["seq"], "rank": 0, "engines": ["e"], "load_s": 0.0,
                            "pad": "x" * MAX_REPLY_BYTES}))
        await reader.read()

    async with _peer(tmp_path, serve) as address, asyncio.timeout(DEADLINE_S):
        channel = await ChunkChannel.connect(address, session_id="s1")
        with pytest.raises(ChannelClosed, match="over"):
            await channel.send_chunk("s1", seq=0, rank=0, chunk=_chunk(0))


async def test_a_daemon_that_hangs_up_fails_every_waiting_chunk_and_refuses_later_ones(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(_line(GREETING))
        await _frames(reader, 2)
        writer.close()  # gone with two chunks unanswered

    async with _peer(tmp_path, serve) as address, asyncio.timeout(DEADLINE_S):
        channel = await ChunkChannel.connect(address, session_id="s1")
        results = await asyncio.gather(*(channel.send_chunk("s1", seq=seq, rank=0, chunk=_chunk(seq))
                                         for seq in (0, 1)), return_exceptions=True)
        assert all(isinstance(r, ChannelClosed) for r in results), results
        with pytest.raises(ChannelClosed, match="is closed"):
            await channel.send_chunk("s1", seq=2, rank=0, chunk=_chunk(2))


async def test_a_refused_hello_raises_the_daemons_status_and_a_silent_hangup_says_so(tmp_path: Path) -> None:
    async def refuse(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.write(_line({"error": "Unauthorized", "field": "token", "message": "wrong token", "status": 401}))
        writer.close()

    async with _peer(tmp_path, refuse) as address, asyncio.timeout(DEADLINE_S):
        with pytest.raises(ColocdHTTPError) as err:
            await ChunkChannel.connect(address, session_id="s1", token="nope")
        assert (err.value.status, err.value.body["field"]) == (401, "token")

    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.close()

    async with _peer(tmp_path, hang_up) as address, asyncio.timeout(DEADLINE_S):
        with pytest.raises(ChannelClosed, match="before greeting"):
            await ChunkChannel.connect(address, session_id="s1")


async def test_a_daemon_that_vanishes_is_channel_closed_not_a_connection_reset(tmp_path: Path) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        writer.transport.pause_reading()  # what the trainer sends next stays unread in the kernel
        writer.write(_line(GREETING))
        sock = socket.socket(fileno=os.dup(writer.get_extra_info("socket").fileno()))  # a plain one, to peek
        async with asyncio.timeout(DEADLINE_S):
            while True:  # until the chunk frame has arrived (peeked, not read)
                try:
                    if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        break
                except BlockingIOError:
                    pass
                await asyncio.sleep(0.01)  # polls the kernel's queue, bounded by the deadline
        sock.close()
        writer.transport.abort()  # closed with unread data: the trainer's end sees ECONNRESET, as on a SIGKILL

    async with _peer(tmp_path, serve) as address, asyncio.timeout(DEADLINE_S):
        channel = await ChunkChannel.connect(address, session_id="s1")
        with pytest.raises(ChannelClosed, match="broke: ConnectionResetError") as caught:
            await channel.send_chunk("s1", seq=0, rank=0, chunk=_chunk(0))
        assert isinstance(caught.value.__cause__, ConnectionResetError)
        await channel.aclose()
