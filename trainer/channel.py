"""The trainer's end of the chunk channel (``colocd.api.chunk_channel``): chunk descriptors as JSON lines.

    async with await ChunkChannel.connect(reply["chunk_channel"], session_id=sid, rank=0) as ch:
        ack = await ch.send_chunk(sid, seq=0, rank=0, chunk=exported)

One connection per session and rank. ``connect(..., device_id=...)`` joins the session in the greeting
(``channel.joined`` is the join reply), one Unix-socket round trip instead of ``POST .../join``;
``connect(..., open_body={...})`` opens the session there too (``channel.opened`` is the open reply), and
``commit(num_chunks)`` commits it on the same connection: a one-rank push then makes no HTTP request at all.
``send_commit(num_chunks)`` sends that commit right behind the last chunk, before its ack (the daemon answers it
once every chunk before it is answered), and ``commit`` then collects its reply: one round trip fewer.
``send_chunk`` has the signature of ``AsyncColocdClient.send_chunk`` and fails the same way
(``ColocdHTTPError`` with the status HTTP would have answered), so ``WeightPusher`` uses either. Many
chunks may be in flight at once; each reply is matched to its call by ``seq``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from ..api.client import ChunkDescriptor, ColocdHTTPError

__all__ = ["ChannelClosed", "ChunkChannel", "chunk_frame"]

CONNECT_TIMEOUT_S = 5.0
# The longest line the daemon may send: the greeting and acks are small, but an error frame may quote a large
# request. A longer one ends the channel.
MAX_REPLY_BYTES = 1 << 24


def chunk_frame(seq: int, rank: int, chunk: ChunkDescriptor) -> bytes:
    """One chunk's frame as the channel writes it: the chunk route's body as one JSON line."""
    body = {"seq": seq, "rank": rank, "transport": chunk.transport, "nbytes": chunk.nbytes, "handle": chunk.handle}
    if chunk.digests is not None:
        body["digests"] = chunk.digests
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


class ChannelClosed(ConnectionError):
    """The daemon closed the channel (or it broke) while chunks were waiting for their acks."""


class _Replies(asyncio.Protocol):
    """The connection's reading end: splits what arrives into lines and hands each to ``on_line`` as it comes.

    A protocol instead of a ``StreamReader`` and a task reading it: an ack then resolves its chunk's future from
    the callback that received it, one pass of the event loop sooner (about 0.02-0.04 ms per chunk on an H200
    host). Writes pause with the transport's buffer (``drain``)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._buffer = bytearray()
        self.on_line: Callable[[bytes], None] = lambda line: None
        self.on_lost: Callable[[BaseException], None] = lambda exc: None
        self.transport: asyncio.Transport | None = None
        self._writable: asyncio.Future[None] | None = None  # set while the transport's buffer is full
        self.lost: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.lost is not None:
            return  # the channel is over: nothing after its end is read
        buffer = self._buffer
        buffer += data
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            if end - start > self._limit:
                break  # left in the buffer, which is then over the limit: refused below
            line = bytes(buffer[start:end + 1])
            start = end + 1
            self.on_line(line)
            if self.lost is not None:
                return
        del buffer[:start]
        if len(buffer) > self._limit:  # a line still arriving, or a whole one, over the limit
            self.end(ChannelClosed(f"the daemon sent a line over {self._limit} bytes"))

    def eof_received(self) -> bool:
        self.end(ChannelClosed("the daemon closed the chunk channel"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is None:
            self.end(ChannelClosed("the daemon closed the chunk channel"))
        else:  # the daemon vanished (a reset, a broken pipe): the channel's end, said as the channel's error
            closed = ChannelClosed(f"the chunk channel to the daemon broke: {type(exc).__name__}: {exc}")
            closed.__cause__ = exc
            self.end(closed)
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)
        self._writable = None

    async def drain(self) -> None:
        if self._writable is not None:
            await self._writable

    def end(self, exc: BaseException) -> None:
        """The channel is over (``exc`` says why): close the connection and tell ``on_lost``, once."""
        if self.lost is None:
            self.lost = exc
            if self.transport is not None:
                self.transport.close()
            self.on_lost(exc)


class ChunkChannel:
    """One open, greeted connection to a daemon's chunk channel, bound to one session and rank."""

    def __init__(self, replies: _Replies, *, session_id: str, rank: int, greeting: dict[str, Any],
                 early: list[bytes] | None = None) -> None:
        assert replies.transport is not None
        self._replies = replies
        self._transport = replies.transport
        self.session_id = session_id
        self.rank = rank
        self.max_frame_bytes = int(greeting.get("max_frame_bytes", 0)) or None
        # The join reply when the hello joined; None when it did not (or the daemon predates joining there).
        joined = greeting.get("join")
        self.joined: dict[str, Any] | None = joined if isinstance(joined, dict) else None
        opened = greeting.get("open")
        self.opened: dict[str, Any] | None = opened if isinstance(opened, dict) else None  # when the hello opened
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._committing: asyncio.Future[dict[str, Any]] | None = None
        self._frames = 0  # chunk frames written
        self._commit_after: int | None = None  # a sent commit's frame waits for this many chunk frames
        self._closed: BaseException | None = None
        for line in early or ():  # frames that came with the greeting, before this object listened
            self._on_reply(line)
        replies.on_line = self._on_reply
        replies.on_lost = self._fail_waiting
        if replies.lost is not None:
            self._fail_waiting(replies.lost)

    @classmethod
    async def connect(cls, address: str, *, session_id: str | None = None, rank: int = 0, token: str | None = None,
                      device_id: str | None = None, open_body: dict[str, Any] | None = None,
                      timeout_s: float = CONNECT_TIMEOUT_S, sent: Callable[[], None] | None = None) -> ChunkChannel:
        """Connect to ``unix:/path`` and greet: for ``session_id``, or opening the session ``open_body`` describes
        (``POST /v1/weights/sessions``' body); joining on ``device_id`` when given. ``ColocdHTTPError`` if the
        daemon refuses the hello, the open or the join, ``OSError`` if the socket cannot be reached (e.g. the
        daemon runs on another host). ``sent`` is called once the hello is written."""
        if (session_id is None) == (open_body is None):
            raise ValueError("give exactly one of session_id and open_body")
        if not address.startswith("unix:"):
            raise ValueError(f"chunk channel address {address!r}: only unix:/path is supported")
        loop = asyncio.get_running_loop()
        greeted: asyncio.Future[bytes] = loop.create_future()
        replies = _Replies(limit=MAX_REPLY_BYTES)
        early: list[bytes] = []

        def on_line(line: bytes) -> None:
            if greeted.done():
                early.append(line)
            else:
                greeted.set_result(line)

        def on_lost(exc: BaseException) -> None:
            if not greeted.done():
                greeted.set_exception(ChannelClosed(f"chunk channel {address} closed the connection before "
                                                    f"greeting ({exc})"))

        replies.on_line, replies.on_lost = on_line, on_lost
        async with asyncio.timeout(timeout_s):
            await loop.create_unix_connection(lambda: replies, address.removeprefix("unix:"))
            assert replies.transport is not None
            try:
                hello: dict[str, Any] = {"rank": rank}
                if session_id is not None:
                    hello["session_id"] = session_id
                else:
                    hello["open"] = open_body
                if token is not None:
                    hello["token"] = token
                if device_id is not None:
                    hello["device_id"] = device_id
                replies.transport.write(json.dumps(hello).encode() + b"\n")
                if sent is not None:
                    sent()
                greeting = json.loads(await greeted)
                if "error" in greeting:
                    raise ColocdHTTPError(int(greeting.get("status", 502)), greeting)
            except BaseException:
                replies.transport.close()
                raise
        return cls(replies, session_id=str(greeting.get("session_id", session_id)), rank=rank, greeting=greeting,
                   early=early)

    async def __aenter__(self) -> ChunkChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._transport.close()
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
        frame = chunk_frame(seq, rank, chunk)
        reply: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[seq] = reply
        try:
            self._transport.write(frame)
            self._frames += 1
            if self._commit_after is not None and self._frames >= self._commit_after:
                self._write_commit(self._commit_after)
            await self._replies.drain()
            return await reply
        finally:
            self._waiting.pop(seq, None)

    @property
    def committing(self) -> bool:
        """A commit was sent on this channel and its reply not yet collected."""
        return self._committing is not None

    def send_commit(self, num_chunks: int) -> asyncio.Future[dict[str, Any]]:
        """Commit this channel's session behind its ``num_chunks``-th chunk frame, acked or not: the frame is
        written as soon as that many chunk frames are (at once if they already are), and the daemon answers it
        once it has answered every chunk before it. ``commit(num_chunks)`` collects the reply (so does the
        returned future, whose failure counts as seen)."""
        committing = self._new_commit()
        if self._frames >= num_chunks:
            self._write_commit(num_chunks)
        else:
            self._commit_after = num_chunks
        return committing

    def _new_commit(self) -> asyncio.Future[dict[str, Any]]:
        """The future of this channel's one commit, whose failure counts as seen (a caller may never await it)."""
        if self._closed is not None:
            raise ChannelClosed(f"chunk channel is closed: {self._closed}")
        if self._committing is not None:
            raise ValueError("commit only once on this channel")
        self._committing = committing = asyncio.get_running_loop().create_future()
        committing.add_done_callback(lambda f: f.cancelled() or f.exception())
        return committing

    def _write_commit(self, num_chunks: int | None) -> None:
        self._commit_after = None
        self._transport.write(json.dumps({"commit": {"num_chunks": num_chunks}}).encode() + b"\n")

    async def commit(self, num_chunks: int | None = None) -> dict[str, Any]:
        """Commit this channel's session once every chunk sent on it was acked (or collect the reply of the commit
        ``send_commit`` sent); returns what ``POST .../commit`` would (``ColocdHTTPError`` with its status where that
        would fail)."""
        committing = self._committing
        try:
            if committing is None:
                if self._closed is None and self._waiting:
                    raise ValueError("commit after every chunk on this channel was acked (or use send_commit)")
                committing = self._new_commit()
                self._write_commit(num_chunks)
                await self._replies.drain()
            return await committing
        finally:
            self._committing = None

    def _on_reply(self, line: bytes) -> None:
        try:
            body = json.loads(line)
            if not isinstance(body, dict):
                raise ValueError(f"not a JSON object: {line[:200]!r}")
        except ValueError as exc:
            self._replies.end(ChannelClosed(f"the daemon sent an unreadable frame: {exc}"))
            return
        if self._committing is not None and ("commit" in body or body.get("frame") == "commit"):
            if not self._committing.done():
                if "error" in body:
                    self._committing.set_exception(ColocdHTTPError(int(body.get("status", 502)), body))
                else:
                    self._committing.set_result(body["commit"])
            return
        seq = body.get("seq")
        waiter = self._waiting.get(seq) if isinstance(seq, int) else None
        error = ColocdHTTPError(int(body.get("status", 502)), body) if "error" in body else None
        if waiter is None:
            if error is not None:
                # An error for no chunk of ours (e.g. a frame over the limit): it ends the channel.
                self._replies.end(error)
            return
        if not waiter.done():
            if error is not None:
                waiter.set_exception(error)
            else:
                waiter.set_result(body)

    def _fail_waiting(self, exc: BaseException) -> None:
        """Every chunk still waiting learns why the channel ended; later sends are refused."""
        self._closed = self._closed or exc
        for waiter in [*self._waiting.values(), *([self._committing] if self._committing is not None else [])]:
            if not waiter.done():
                waiter.set_exception(exc)
