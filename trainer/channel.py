"""The trainer's end of the chunk channel (``colocd.api.chunk_channel``): chunk descriptors as JSON lines.

    async with await ChunkChannel.connect(reply["chunk_channel"], session_id=sid, rank=0) as ch:
        ack = await ch.send_chunk(sid, seq=0, rank=0, chunk=exported)

One connection per session and rank. ``connect(..., device_id=...)`` joins the session in the greeting
(``channel.joined`` is the join reply), one Unix-socket round trip instead of ``POST .../join``.
``send_chunk`` has the signature of ``AsyncColocdClient.send_chunk`` and fails the same way
(``ColocdHTTPError`` with the status HTTP would have answered), so ``WeightPusher`` uses either. Many
chunks may be in flight at once; each reply is matched to its call by ``seq``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import Any

from ..api.client import ChunkDescriptor, ColocdHTTPError

__all__ = ["ChannelClosed", "ChunkChannel"]

CONNECT_TIMEOUT_S = 5.0


class ChannelClosed(ConnectionError):
    """The daemon closed the channel (or it broke) while chunks were waiting for their acks."""


class ChunkChannel:
    """One open, greeted connection to a daemon's chunk channel, bound to one session and rank."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, session_id: str,
                 rank: int, greeting: dict[str, Any]) -> None:
        self._reader = reader
        self._writer = writer
        self.session_id = session_id
        self.rank = rank
        self.max_frame_bytes = int(greeting.get("max_frame_bytes", 0)) or None
        # The join reply when the hello joined; None when it did not (or the daemon predates joining there).
        joined = greeting.get("join")
        self.joined: dict[str, Any] | None = joined if isinstance(joined, dict) else None
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._closed: BaseException | None = None
        self._reading = asyncio.create_task(self._read_replies())

    @classmethod
    async def connect(cls, address: str, *, session_id: str, rank: int = 0, token: str | None = None,
                      device_id: str | None = None, timeout_s: float = CONNECT_TIMEOUT_S) -> ChunkChannel:
        """Connect to ``unix:/path`` and greet (joining on ``device_id`` when given); ``ColocdHTTPError`` if
        the daemon refuses the hello or the join, ``OSError`` if the socket cannot be reached (e.g. the
        daemon runs on another host)."""
        if not address.startswith("unix:"):
            raise ValueError(f"chunk channel address {address!r}: only unix:/path is supported")
        async with asyncio.timeout(timeout_s):
            # limit: the greeting and acks are small, but an error frame may quote a large request.
            reader, writer = await asyncio.open_unix_connection(address.removeprefix("unix:"), limit=1 << 24)
            try:
                hello: dict[str, Any] = {"session_id": session_id, "rank": rank}
                if token is not None:
                    hello["token"] = token
                if device_id is not None:
                    hello["device_id"] = device_id
                writer.write(json.dumps(hello).encode() + b"\n")
                line = await reader.readline()
                if not line:
                    raise ChannelClosed(f"chunk channel {address} closed the connection before greeting")
                greeting = json.loads(line)
                if "error" in greeting:
                    raise ColocdHTTPError(int(greeting.get("status", 502)), greeting)
            except BaseException:
                writer.close()
                raise
        return cls(reader, writer, session_id=session_id, rank=rank, greeting=greeting)

    async def __aenter__(self) -> ChunkChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading
        self._fail_waiting(ChannelClosed("chunk channel closed by the trainer"))

    async def send_chunk(self, session_id: str, *, seq: int, rank: int, chunk: ChunkDescriptor) -> dict[str, Any]:
        """Send one chunk descriptor; returns the daemon's ack once every engine consumed the chunk."""
        if session_id != self.session_id or rank != self.rank:
            raise ValueError(f"this channel carries session {self.session_id} rank {self.rank}, "
                             f"not session {session_id} rank {rank}")
        if self._closed is not None:
            raise ChannelClosed(f"chunk channel is closed: {self._closed}")
        if seq in self._waiting:
            raise ValueError(f"chunk {seq} is already in flight on this channel")
        frame = json.dumps({"seq": seq, "rank": rank, "transport": chunk.transport, "nbytes": chunk.nbytes,
                            "handle": chunk.handle}, separators=(",", ":")).encode() + b"\n"
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = reply
        try:
            self._writer.write(frame)
            await self._writer.drain()
            return await reply
        finally:
            self._waiting.pop(seq, None)

    async def _read_replies(self) -> None:
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    raise ChannelClosed("the daemon closed the chunk channel")
                body = json.loads(line)
                seq = body.get("seq")
                waiter = self._waiting.get(seq) if isinstance(seq, int) else None
                error = ColocdHTTPError(int(body.get("status", 502)), body) if "error" in body else None
                if waiter is None:
                    if error is not None:
                        # An error for no chunk of ours (e.g. a frame over the limit): it ends the channel.
                        raise error
                    continue
                if not waiter.done():
                    if error is not None:
                        waiter.set_exception(error)
                    else:
                        waiter.set_result(body)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # every waiter learns why the channel ended
            self._fail_waiting(exc)

    def _fail_waiting(self, exc: BaseException) -> None:
        self._closed = self._closed or exc
        for waiter in self._waiting.values():
            if not waiter.done():
                waiter.set_exception(exc)
