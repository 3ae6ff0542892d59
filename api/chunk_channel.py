"""The framed chunk channel: weight-chunk descriptors on one Unix-socket connection per trainer rank and session.

Beside the HTTP API, not instead of it: the same calls into ``WeightSessions.submit_chunk`` with the same
validation (``schemas.ChunkDescriptor``), the same acks and the same error bodies, minus the HTTP
stack's per-request cost (about 1.4 ms per chunk on an H200 host, against ~0.15 ms for a JSON line
on a Unix socket: research/h200-limits.md). Session semantics do not change: a connection that drops
mid-stream is a trainer that went quiet, and the session's lease (``timeouts.session_idle_s``) decides.

Protocol, newline-delimited JSON (one UTF-8 object per line, at most ``limits.max_body_bytes``):

- trainer → daemon, first frame: ``{"session_id": "...", "rank": 0, "token": "...", "device_id": "..."}``
  (``ChunkChannelHello``; ``token`` when the node sets one; ``device_id`` to join the session in the same
  round trip, as ``POST /v1/weights/sessions/{id}/join`` would). Instead of ``session_id``, ``"open": {...}``
  (``OpenSessionRequest``) opens the session as ``POST /v1/weights/sessions`` would, and this connection carries
  it. The daemon answers ``{"channel": "colocd-chunks/1", "session_id", "rank", "max_frame_bytes",
  "max_in_flight"}`` plus ``"open"`` (the ``OpenSessionReply``) when the hello opened and ``"join"`` (the
  ``JoinReply``) when it joined, or an error frame and closes the connection (a session the hello opened and
  whose join was refused is aborted, as is one whose connection closes before another frame).
- every later frame is what ``POST /v1/weights/sessions/{id}/chunks`` carries (``seq``, ``rank``,
  ``transport``, ``nbytes``, ``handle``); ``rank`` may be left out (the hello's rank) but not changed.
- the daemon answers each with the ``ChunkAckReply`` body, or an error frame: ``ErrorBody`` plus
  ``status`` (what HTTP would have answered) and ``seq`` when the frame had one. Replies come in
  completion order, so a trainer keeps ``depth`` chunks in flight on one connection and matches by ``seq``.
- a frame whose first key is ``"commit"``, ``{"commit": {"num_chunks": N}}`` (``ChannelCommit``), commits the
  connection's session as ``POST .../commit`` would, once every chunk frame read before it is answered (so it may
  follow the last chunk at once, before its ack): the answer is ``{"commit": <its reply>}`` or an error frame with
  ``"frame": "commit"``. The session's open and commit then cost one Unix-socket round trip each instead of an
  HTTP request, and a commit sent behind the last chunk no round trip of its own.

A malformed frame is answered with an error frame naming the field and the connection stays usable;
only a frame over the size limit, a bad hello or a wrong token closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import socket
import struct
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..daemon.config import NodeConfig
from ..daemon.errors import ColocdError, RequestInvalid, SessionGone
from ..daemon.node import Daemon
from ..daemon.tasks import start_now
from ..engines.base import ChunkPart
from ..engines.errors import EngineError
from .channel_dir import ChannelDir, reclaim_dead_channel_dirs
from .errors import error_body, validation_body
from .schemas import ChannelCommit, ChunkChannelHello, ChunkDescriptor, JoinReply
from .session_calls import commit_session, encode_reply, open_session

__all__ = ["CHANNEL_PROTOCOL", "ChunkChannelServer", "channel_path"]

log = logging.getLogger("colocd.api")

CHANNEL_PROTOCOL = "colocd-chunks/1"
HELLO_TIMEOUT_S = 10.0  # a connection that never says which session it serves is dropped
# Chunks one connection may have submitted and unanswered; reading stops (back-pressure) beyond it.
# Sessions allow at most depth <= 64 outstanding per rank, so this never limits a correct trainer.
MAX_IN_FLIGHT = 64
_COMMIT_FRAME = b'{"commit"'  # a frame whose first key is "commit" commits; every other one is a chunk


def channel_path(config: NodeConfig) -> tuple[Path | None, ChannelDir | None]:
    """Where the channel listens and the private directory we made for it (removed on stop); None: off."""
    chosen = config.listen.chunk_channel
    if chosen == "off":
        return None, None
    if chosen:
        return Path(chosen), None
    if config.listen.uds:
        return Path(f"{config.listen.uds}.chunks"), None
    reclaim_dead_channel_dirs()  # those of SIGKILLed daemons, which could not remove their own
    # mkdtemp makes the directory 0700: only this user can even reach the socket.
    private = ChannelDir()
    return private.path / "chunks.sock", private


def _bind_unix(path: Path) -> socket.socket:
    if path.exists() or path.is_symlink():
        path.unlink()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)  # created 0600, as the HTTP socket: only this user may drive the node
    try:
        sock.bind(str(path))
    except BaseException:
        sock.close()
        raise
    finally:
        os.umask(old)
    return sock


def _frame(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode() + b"\n"


def _error_frame(status: int, body: dict[str, Any], seq: int | None = None, *, frame: str | None = None) -> bytes:
    extra: dict[str, Any] = {} if seq is None else {"seq": seq}
    if frame is not None:
        extra["frame"] = frame
    return _frame({**body, "status": status, **extra})


class _ChannelRefusal(Exception):
    """A hello the channel refuses: answered with this error frame, then the connection closes."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(body.get("message"))
        self.status = status
        self.body = body


class ChunkChannelServer:
    """``async with ChunkChannelServer(daemon, config) as ch: ch.address`` (``unix:/path`` or None when off)."""

    def __init__(self, daemon: Daemon, config: NodeConfig) -> None:
        self._daemon = daemon
        self._token = config.token.encode() if config.token is not None else None
        self.max_frame_bytes = config.limits.max_body_bytes
        self._explicit = config.listen.chunk_channel not in (None, "off")
        self._config = config
        self._server: asyncio.Server | None = None
        self._path: Path | None = None
        self._private_dir: ChannelDir | None = None
        self._connections: set[asyncio.Task[None]] = set()
        self.address: str | None = None

    async def __aenter__(self) -> ChunkChannelServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        path, private = channel_path(self._config)
        if path is None:
            return
        try:
            sock = _bind_unix(path)
        except OSError as exc:
            if private is not None:
                private.remove()
            if self._explicit:
                raise OSError(f"listen.chunk_channel {str(path)!r}: cannot listen there: {exc}") from exc
            # The default place failed: trainers fall back to HTTP, which costs time, not correctness.
            log.warning("chunk channel not started (%s: %s); trainers will send chunks over HTTP", path, exc)
            return
        self._path, self._private_dir = path, private
        # limit: readline refuses a line longer than this instead of buffering without bound.
        self._server = await asyncio.start_unix_server(self._accept, sock=sock, limit=self.max_frame_bytes)
        self.address = f"unix:{path}"

    async def stop(self) -> None:
        """Stop listening and drop every connection (the daemon is shutting down; its sessions end with it)."""
        if self._server is not None:
            self._server.close()
        for task in list(self._connections):
            task.cancel()
        await asyncio.gather(*self._connections, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                self._path.unlink()
            if self._private_dir is not None:
                self._private_dir.remove()
                self._private_dir = None
            self._path = None
        self.address = None

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the trainer went away: its session's lease decides what happens next
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                line = await reader.readline()
            hello = self._hello(line)
            opened = await self._open(hello) if hello.open is not None else None
            session_id = opened["session_id"] if opened is not None else hello.session_id
            assert session_id is not None
            if (pid := _peer_pid(writer)) is not None:  # the kernel's word: this process is the trainer
                self._daemon.sessions.note_trainer_pid(session_id, pid)
            joined = await self._join(hello, session_id, opened=opened is not None)
        except TimeoutError:
            writer.write(_error_frame(408, {"error": "HelloTimeout", "message": (
                f"no hello frame within {HELLO_TIMEOUT_S:g} s of connecting: send "
                '{"session_id": ..., "rank": ..., "token": ...} first')}))
            return
        except ValueError:  # a hello over the frame limit
            writer.write(_error_frame(413, self._too_large()))
            return
        except _ChannelRefusal as refusal:
            writer.write(_error_frame(refusal.status, refusal.body))
            return
        rank = hello.rank
        greeting: dict[str, Any] = {"channel": CHANNEL_PROTOCOL, "session_id": session_id, "rank": rank,
                                    "max_frame_bytes": self.max_frame_bytes, "max_in_flight": MAX_IN_FLIGHT}
        if opened is not None:
            greeting["open"] = opened
        if joined is not None:
            greeting["join"] = joined
        writer.write(_frame(greeting))
        window = asyncio.Semaphore(MAX_IN_FLIGHT)
        chunks: set[asyncio.Task[None]] = set()
        framed = False  # a frame came after the greeting
        try:
            while True:
                await window.acquire()
                try:
                    line = await reader.readline()
                    framed = framed or bool(line.strip())
                except ValueError:
                    # Over the limit: the rest of that line is still arriving and cannot be framed; close.
                    writer.write(_error_frame(413, self._too_large()))
                    break
                if not line.endswith(b"\n"):
                    window.release()
                    break  # end of stream (a partial last line is a trainer cut off mid-frame)
                if not line.strip():
                    window.release()
                    continue
                if line.startswith(_COMMIT_FRAME):
                    # It may come right behind the last chunk: answered once every chunk read before it is,
                    # and before anything read after it.
                    try:
                        await asyncio.gather(*chunks, return_exceptions=True)
                        writer.write(await self._commit(line, session_id))
                    finally:
                        window.release()
                    await writer.drain()
                    continue
                task = start_now(self._chunk(line, session_id, rank, writer, window))
                chunks.add(task)
                task.add_done_callback(chunks.discard)
                await writer.drain()  # back-pressure on acks the trainer is not reading
        finally:
            if opened is not None and not framed and not _cancelling():
                # The connection that opened the session ended before saying anything more: its trainer may
                # never have seen the greeting, so nobody else knows the session: abort it rather than let it
                # hold the node until its idle lease expires.
                with contextlib.suppress(ColocdError, EngineError):
                    await self._daemon.sessions.abort(session_id, "the connection that opened it closed first")
            # Let submitted chunks finish, as an HTTP request whose client hung up does: the session
            # accounts for them. Cancelled only when the daemon stops (stop() cancels this task).
            if chunks:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    for task in chunks:  # the daemon is stopping: do not wait out engine loads
                        task.cancel()
                try:
                    await asyncio.gather(*chunks, return_exceptions=True)
                except asyncio.CancelledError:
                    for task in chunks:
                        task.cancel()
                    raise

    def _hello(self, line: bytes) -> ChunkChannelHello:
        try:
            hello = ChunkChannelHello.model_validate_json(line)
        except ValidationError as exc:
            status, body = validation_body(exc.errors(include_url=False))
            body["message"] = f"hello frame: {body['message']}"
            raise _ChannelRefusal(status, body) from None
        if self._token is not None and not hmac.compare_digest((hello.token or "").encode(), self._token):
            raise _ChannelRefusal(401, {"error": "Unauthorized", "field": "token",
                                        "message": "missing or wrong token in the hello frame"})
        if hello.open is not None:
            if hello.rank >= (ranks := hello.open.ranks or 1):
                raise _ChannelRefusal(422, {"error": "RequestInvalid", "field": "rank", "message": (
                    f"rank {hello.rank} is outside the opened session's ranks 0..{ranks - 1}")})
            return hello
        assert hello.session_id is not None
        try:
            stats = self._daemon.sessions.get(hello.session_id).stats()
            if stats["state"] != "open":
                raise SessionGone(f"weight session {hello.session_id} is {stats['state']}"
                                  + (f": {stats['error']}" if stats.get("error") else ""),
                                  session_id=hello.session_id, state=str(stats["state"]))
            if hello.rank >= int(stats["ranks"]):
                raise RequestInvalid(f"rank {hello.rank} is outside session {hello.session_id}'s ranks "
                                     f"0..{int(stats['ranks']) - 1}", field="rank")
        except (ColocdError, EngineError) as exc:
            raise _ChannelRefusal(*error_body(exc)) from None
        return hello

    async def _open(self, hello: ChunkChannelHello) -> dict[str, Any]:
        """The session a hello asked to open (``OpenSessionReply``'s fields), saving the trainer an HTTP call."""
        assert hello.open is not None
        try:
            return await open_session(self._daemon, hello.open, self.address)
        except (ColocdError, EngineError) as exc:
            raise _ChannelRefusal(*error_body(exc)) from None

    async def _join(self, hello: ChunkChannelHello, session_id: str, *, opened: bool) -> dict[str, Any] | None:
        """The join a hello asked for (its reply, as JSON), saving the trainer an HTTP call; None if it asked none.
        A session this hello ``opened`` is aborted when its join is refused: nobody else knows its id."""
        if hello.device_id is None:
            return None
        try:
            joined = await self._daemon.sessions.join(session_id, hello.rank, hello.device_id)
        except (ColocdError, EngineError) as exc:
            if opened:
                with contextlib.suppress(ColocdError, EngineError):
                    await self._daemon.sessions.abort(session_id, f"the opening rank's join was refused: {exc}")
            raise _ChannelRefusal(*error_body(exc)) from None
        return JoinReply.model_validate(joined).model_dump(mode="json")

    async def _commit(self, line: bytes, session_id: str) -> bytes:
        """A commit frame's answer: ``{"commit": <the commit reply>}``, or an error frame with ``"frame": "commit"``."""
        try:
            body = ChannelCommit.model_validate_json(line)
        except ValidationError as exc:
            return _error_frame(*validation_body(exc.errors(include_url=False)), frame="commit")
        try:
            reply = {"commit": await commit_session(self._daemon, session_id, body.commit)}
        except (ColocdError, EngineError) as exc:
            return _error_frame(*error_body(exc), frame="commit")
        except Exception as exc:
            log.exception("unexpected error committing on the chunk channel (session %s)", session_id)
            return _error_frame(500, {"error": "InternalError", "message": f"{type(exc).__name__}: {exc}"},
                                frame="commit")
        encoded = encode_reply(reply)
        return encoded + b"\n" if encoded is not None else _frame(reply)

    async def _chunk(self, line: bytes, session_id: str, rank: int, writer: asyncio.StreamWriter,
                     window: asyncio.Semaphore) -> None:
        try:
            try:
                reply = await self._answer(line, session_id, rank)
            except Exception as exc:
                # A bug, not the caller's: answered like the HTTP guard does, and the connection stays usable.
                log.exception("unexpected error on the chunk channel (session %s)", session_id)
                reply = _error_frame(500, {"error": "InternalError", "message": f"{type(exc).__name__}: {exc}"},
                                     _seq_of(line))
            writer.write(reply)
        finally:
            window.release()

    async def _answer(self, line: bytes, session_id: str, rank: int) -> bytes:
        try:
            body = ChunkDescriptor.model_validate_json(line)
        except ValidationError as exc:
            status, error = validation_body(exc.errors(include_url=False))
            return _error_frame(status, error, _seq_of(line))
        try:
            if "rank" in body.model_fields_set and body.rank != rank:
                raise RequestInvalid(f"rank {body.rank}: this connection carries rank {rank}'s chunks "
                                     "(open one connection per rank)", field="rank")
            part = ChunkPart.of(rank=rank, transport=body.transport, nbytes=body.nbytes, handle=body.handle,
                                digests=body.digests)
            ack = await self._daemon.sessions.submit_chunk(session_id, body.seq, part)
        except (ColocdError, EngineError) as exc:
            return _error_frame(*error_body(exc), body.seq)
        # ChunkAckReply's fields, written directly: a model built and dumped per chunk is pure overhead here.
        return _frame({"seq": ack.seq, "rank": ack.rank, "engines": list(ack.engines), "load_s": float(ack.load_s)})

    def _too_large(self) -> dict[str, Any]:
        return {"error": "PayloadTooLarge", "message": (
            f"frame over the node's limit of {self.max_frame_bytes} bytes (limits.max_body_bytes in the node "
            "config); the connection is closed")}


def _cancelling() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _seq_of(line: bytes) -> int | None:
    """The frame's seq where it has a readable one, so the trainer can match an error to its chunk."""
    try:
        seq = json.loads(line).get("seq")
    except (ValueError, AttributeError):
        return None
    return seq if isinstance(seq, int) and not isinstance(seq, bool) else None


def _peer_pid(writer: asyncio.StreamWriter) -> int | None:
    """The connected trainer's pid from the kernel (SO_PEERCRED); None where it cannot tell (0: a pid namespace
    this one does not see)."""
    sock = writer.get_extra_info("socket")
    option = getattr(socket, "SO_PEERCRED", None)
    if sock is None or option is None or sock.family != socket.AF_UNIX:
        return None
    try:
        pid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, struct.calcsize("3i")))[0]
    except OSError:
        return None
    return int(pid) or None
