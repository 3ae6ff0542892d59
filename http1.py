"""The HTTP/1.1 transport under colocd's own httpx clients: the daemon's engine calls and the trainer's daemon calls.

httpx's default transport (httpcore) parses with pure-Python h11 and wraps every read in anyio; on loopback that
is most of a call (a no-op POST to a uvicorn app through httpx: 1.05 ms over httpcore, 0.40 ms over this
transport on the 2-core CPU VM), and a weight session makes one call per begin, chunk and end. This one writes
the request itself, parses the reply with httptools (what uvicorn parses requests with) and keeps idle
connections per origin for ``keepalive_expiry`` seconds, under the servers' own keep-alive timeouts (uvicorn's
is 5 s), so a pooled connection is not one the server is closing.

It speaks only what those calls need: plain ``http`` over TCP or a Unix socket, whole bodies both ways (a
streamed request body is read first; a reply is read whole before ``handle_async_request`` returns); an
``https`` URL goes through httpx's own transport. Failures are httpx's own exceptions, as the default transport
raises them: ``ConnectError``, ``ConnectTimeout``, ``ReadTimeout``, ``WriteTimeout``, ``ReadError``,
``WriteError``, ``RemoteProtocolError``. A connection that did not end its exchange cleanly (an error, a
cancelled call) is closed, never pooled, and no request is retried.
"""

from __future__ import annotations

import asyncio
import select
import time
from dataclasses import dataclass, field

import httptools
import httpx

__all__ = ["Http1Transport"]

_READ_SIZE = 256 * 1024
_ONE_WRITE_MAX = 256 * 1024  # a larger body is written apart from its head, not copied into one buffer


@dataclass
class _Connection:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = 0.0

    def reusable(self, now: float, expiry: float) -> bool:
        if self.reader.at_eof() or self.writer.is_closing() or now - self.idle_since >= expiry:
            return False
        # An idle connection has nothing to read: readable means the server closed it, which the loop has not
        # seen yet where it did not run since (``ColocdClient`` runs its loop only inside a call).
        sock = self.writer.get_extra_info("socket")
        return sock is None or not select.select([sock], [], [], 0)[0]

    def close(self) -> None:
        self.writer.close()


@dataclass
class _Reply:
    """What httptools reports of one response, as it parses it."""

    head: bool  # a reply to HEAD: no body follows its headers
    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: list[bytes] = field(default_factory=list)
    headers_done: bool = False
    done: bool = False
    keep_alive: bool = False  # httptools answers should_keep_alive() only inside its callbacks

    def __post_init__(self) -> None:
        self._parser = httptools.HttpResponseParser(self)

    def feed(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True
        self.status = self._parser.get_status_code()
        if self.head:
            self._complete()

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self._complete()

    def _complete(self) -> None:
        self.done = True
        self.keep_alive = self._parser.should_keep_alive()

    def framed(self) -> bool:
        """The reply says where its body ends (else it ends when the server closes the connection)."""
        names = {name.lower() for name, _ in self.headers}
        return b"content-length" in names or b"transfer-encoding" in names


class Http1Transport(httpx.AsyncBaseTransport):
    """``httpx.AsyncClient(transport=Http1Transport())``: HTTP/1.1 keep-alive over TCP, or ``uds`` for every URL."""

    def __init__(self, *, uds: str | None = None, keepalive_expiry: float = 2.0, max_idle_per_origin: int = 16) -> None:
        self._uds = uds
        self._expiry = keepalive_expiry
        self._max_idle = max_idle_per_origin
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._closed = False
        self._tls: httpx.AsyncHTTPTransport | None = None  # https, made on first use

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.scheme == "https" and self._uds is None:
            self._tls = self._tls or httpx.AsyncHTTPTransport()
            return await self._tls.handle_async_request(request)
        if request.url.scheme != "http":
            raise httpx.UnsupportedProtocol(f"{request.url.scheme!r} URLs are not served here (http, https)",
                                            request=request)
        if self._closed:
            raise RuntimeError("the transport is closed")
        timeouts = request.extensions.get("timeout", {})
        origin = (request.url.host, request.url.port or 80)
        message = await _message(request)  # head and body: one write for a small body, two for a large one
        connection = self._pooled(origin) or await self._connect(request, origin, timeouts.get("connect"))
        try:
            await _write(connection, message, request, timeouts.get("write"))
            reply = await _read(connection, request, timeouts.get("read"))
        except BaseException:
            connection.close()  # mid-exchange: what the server sends next is not a reply to the next request
            raise
        if reply.keep_alive and not connection.reader.at_eof() and not self._closed:
            self._release(origin, connection)
        else:
            connection.close()
        return httpx.Response(reply.status, headers=reply.headers, stream=httpx.ByteStream(b"".join(reply.body)),
                              request=request, extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        self._closed = True
        for pool in self._idle.values():
            for connection in pool:
                connection.close()
        self._idle.clear()
        if self._tls is not None:
            await self._tls.aclose()

    def _pooled(self, origin: tuple[str, int]) -> _Connection | None:
        pool = self._idle.get(origin, [])
        now = time.monotonic()
        while pool:
            connection = pool.pop()  # the most recently used: the likeliest to be open at the server
            if connection.reusable(now, self._expiry):
                return connection
            connection.close()
        return None

    def _release(self, origin: tuple[str, int], connection: _Connection) -> None:
        pool = self._idle.setdefault(origin, [])
        if len(pool) >= self._max_idle:
            connection.close()
            return
        connection.idle_since = time.monotonic()
        pool.append(connection)

    async def _connect(self, request: httpx.Request, origin: tuple[str, int], limit_s: float | None) -> _Connection:
        try:
            async with asyncio.timeout(limit_s):
                if self._uds is not None:
                    reader, writer = await asyncio.open_unix_connection(self._uds, limit=_READ_SIZE)
                else:
                    reader, writer = await asyncio.open_connection(*origin, limit=_READ_SIZE)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connecting to {self._uds or origin} timed out", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {self._uds or origin}: {exc}", request=request) from exc
        return _Connection(reader, writer)


async def _message(request: httpx.Request) -> list[bytes]:
    """The request as bytes on the wire; a streamed body is read whole and sent with its length."""
    body = await request.aread()
    headers = [(k, v) for k, v in request.headers.raw if k.lower() not in (b"transfer-encoding", b"content-length")]
    if body or request.method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
        headers.append((b"Content-Length", str(len(body)).encode()))
    target = request.url.raw_path or b"/"
    lines = [request.method.encode() + b" " + target + b" HTTP/1.1"]
    lines += [k + b": " + v for k, v in headers]
    head = b"\r\n".join(lines) + b"\r\n\r\n"
    return [head + body] if len(body) <= _ONE_WRITE_MAX else [head, body]


async def _write(connection: _Connection, message: list[bytes], request: httpx.Request,
                 limit_s: float | None) -> None:
    try:
        for part in message:  # write() each: writelines() joins them first on Python 3.11
            connection.writer.write(part)
        async with asyncio.timeout(limit_s):
            await connection.writer.drain()
    except TimeoutError:
        raise httpx.WriteTimeout("writing the request timed out", request=request) from None
    except OSError as exc:
        raise httpx.WriteError(f"writing the request failed: {exc}", request=request) from exc


async def _read(connection: _Connection, request: httpx.Request, limit_s: float | None) -> _Reply:
    """One whole response, and whether it lets the connection carry another (``keep_alive``)."""
    reply = _Reply(head=request.method == "HEAD")
    while not reply.done:
        try:
            async with asyncio.timeout(limit_s):
                data = await connection.reader.read(_READ_SIZE)
        except TimeoutError:
            raise httpx.ReadTimeout("waiting for the response timed out", request=request) from None
        except OSError as exc:
            raise httpx.ReadError(f"reading the response failed: {exc}", request=request) from exc
        if not data:
            if reply.headers_done and not reply.framed():
                reply.keep_alive = False  # its body ended with the connection
                return reply
            raise httpx.RemoteProtocolError("the server closed the connection before the whole response",
                                            request=request)
        try:
            reply.feed(data)
        except httptools.HttpParserError as exc:
            raise httpx.RemoteProtocolError(f"malformed response: {exc}", request=request) from exc
    return reply
