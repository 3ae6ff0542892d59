"""``Http1Transport``, the transport under the daemon's engine client and the trainer's daemon client.

Against a real uvicorn app and against a raw asyncio server on loopback ports the OS picks, the latter writing
replies byte for byte (chunked, close-delimited, cut short, never sent) so each framing and failure is exact.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from support import serve_app

from colocd.http1 import Http1Transport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def _echo(request: Request) -> JSONResponse:
    client = request.client
    return JSONResponse({"body": (await request.body()).decode(), "method": request.method,
                         "query": request.url.query, "peer_port": client.port if client else None})


_APP = Starlette(routes=[Route("/echo", _echo, methods=["GET", "POST", "PUT"]),
                         Route("/healthz", lambda _: JSONResponse({}), methods=["GET"])])


@asynccontextmanager
async def _raw_server(handle: Handler, *, uds: Path | None = None) -> AsyncIterator[tuple[str, list[int]]]:
    """A server that runs ``handle`` per connection; yields its URL and the list it appends one entry to per
    connection accepted."""
    accepted: list[int] = []

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            await handle(reader, writer)
        finally:
            writer.close()

    if uds is not None:
        server = await asyncio.start_unix_server(on_connect, path=str(uds))
        url = "http://colocd"
    else:
        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    async with server:
        yield url, accepted


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return head + await reader.readexactly(length)


def _replying(*replies: bytes, then_close: bool = False) -> Handler:
    """Answer each request on a connection with the next reply (cycling), closing after one if ``then_close``."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        n = 0
        while True:
            try:
                await _read_request(reader)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            writer.write(replies[n % len(replies)])
            await writer.drain()
            n += 1
            if then_close:
                return
    return handle


_OK = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 11\r\n\r\n{\"ok\":true}"


async def test_a_json_post_round_trips_and_consecutive_calls_share_one_connection() -> None:
    async with serve_app(_APP) as url, httpx.AsyncClient(transport=Http1Transport(), base_url=url) as client:
        first = await client.post("/echo", params={"q": "1"}, json={"a": [1, 2]})
        second = await client.post("/echo", content=b"")
        third = await client.get("/echo")
    assert first.status_code == 200
    assert first.json()["body"] == json.dumps({"a": [1, 2]}, separators=(",", ":"))
    assert first.json()["query"] == "q=1"
    assert (second.json()["body"], third.json()["method"]) == ("", "GET")
    assert first.json()["peer_port"] == second.json()["peer_port"] == third.json()["peer_port"]


async def test_a_large_body_travels_whole_both_ways() -> None:
    body = bytes(range(256)) * 8192  # 2 MiB: sent apart from its head
    async with serve_app(_APP) as url, httpx.AsyncClient(transport=Http1Transport(), base_url=url) as client:
        reply = await client.put("/echo", content=body.hex().encode())
    assert bytes.fromhex(reply.json()["body"]) == body


async def test_concurrent_calls_each_get_a_connection_and_all_are_answered() -> None:
    async with serve_app(_APP) as url, httpx.AsyncClient(transport=Http1Transport(), base_url=url) as client:
        replies = await asyncio.gather(*(client.post("/echo", content=str(i).encode()) for i in range(8)))
    assert [r.json()["body"] for r in replies] == [str(i) for i in range(8)]


async def test_a_chunked_reply_is_reassembled() -> None:
    reply = (b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"
             b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n")
    async with _raw_server(_replying(reply)) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        first = await client.get(url)
        second = await client.get(url)
    assert (first.content, second.content, len(accepted)) == (b"abcdefg", b"abcdefg", 1)


async def test_a_reply_without_a_length_ends_with_its_connection_which_is_not_reused() -> None:
    reply = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end"
    async with _raw_server(_replying(reply, then_close=True)) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        bodies = [(await client.get(url)).text for _ in range(2)]
    assert (bodies, len(accepted)) == (["until the end"] * 2, 2)


async def test_a_reply_saying_connection_close_is_not_followed_on_that_connection() -> None:
    reply = b"HTTP/1.1 200 OK\r\nconnection: close\r\ncontent-length: 2\r\n\r\nok"
    async with _raw_server(_replying(reply)) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        statuses = [(await client.get(url)).status_code for _ in range(3)]
    assert (statuses, len(accepted)) == ([200] * 3, 3)


async def test_an_idle_connection_the_server_closed_is_not_used_again() -> None:
    async with _raw_server(_replying(_OK, then_close=True)) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        assert (await client.get(url)).json() == {"ok": True}
        for _ in range(500):  # up to 5 s, until the loop has read the server's close
            if _all_idle_at_eof(client):
                break
            await asyncio.sleep(0.01)
        assert (await client.get(url)).json() == {"ok": True}
    assert len(accepted) == 2


def test_a_closed_idle_connection_is_seen_even_where_the_loop_did_not_run_since() -> None:
    # As ColocdClient runs its private loop only inside a call: the server's close arrives between two calls.
    listener = socket.create_server(("127.0.0.1", 0))
    answered, closed, accepted = threading.Event(), threading.Event(), []

    def serve() -> None:
        for n in range(2):
            conn, _ = listener.accept()
            accepted.append(1)
            with conn:
                conn.recv(65536)
                conn.sendall(_OK)
                if n == 0:
                    answered.wait(10)  # closed once the client's call has returned and its loop stopped
            closed.set()  # after the close: the reply said nothing of it (no "connection: close")

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    transport = Http1Transport()

    def call() -> bytes:  # the transport's first step runs before the loop reads what arrived while it was idle
        return loop.run_until_complete(transport.handle_async_request(httpx.Request("GET", url))).read()

    try:
        assert call() == b'{"ok":true}'
        answered.set()
        assert closed.wait(10)
        assert call() == b'{"ok":true}'
    finally:
        loop.run_until_complete(transport.aclose())
        loop.close()
        listener.close()
    assert len(accepted) == 2


def _all_idle_at_eof(client: httpx.AsyncClient) -> bool:
    transport = client._transport
    assert isinstance(transport, Http1Transport)
    return all(c.reader.at_eof() for pool in transport._idle.values() for c in pool)


async def test_an_idle_connection_past_its_expiry_is_not_used_again() -> None:
    async with _raw_server(_replying(_OK)) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport(keepalive_expiry=0.0)) as client:
        for _ in range(2):
            await client.get(url)
    assert len(accepted) == 2


async def test_a_refused_connection_is_a_connect_error() -> None:
    async with _raw_server(_replying(_OK)) as (url, _):
        pass  # closed: nothing listens at url now
    async with httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url)


async def test_a_reply_that_never_comes_is_a_read_timeout_and_its_connection_is_dropped() -> None:
    answered: list[int] = []

    async def silent_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        if not answered:
            answered.append(1)
            await reader.read()  # never answers; ends when the client closes
            return
        writer.write(_OK)
        await writer.drain()

    async with _raw_server(silent_once) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.get(url, timeout=httpx.Timeout(5.0, read=0.2))
        assert (await client.get(url)).json() == {"ok": True}
    assert len(accepted) == 2


async def test_a_reply_cut_short_is_a_remote_protocol_error() -> None:
    cut = b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly this"
    async with _raw_server(_replying(cut, then_close=True)) as (url, _), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url)


async def test_a_malformed_reply_is_a_remote_protocol_error() -> None:
    async with _raw_server(_replying(b"NOT HTTP AT ALL\r\n\r\n", then_close=True)) as (url, _), \
            httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get(url)


async def test_a_unix_socket_carries_every_call(tmp_path: Path) -> None:
    path = tmp_path / "d.sock"
    async with _raw_server(_replying(_OK), uds=path) as (url, accepted), \
            httpx.AsyncClient(transport=Http1Transport(uds=str(path))) as client:
        replies = [(await client.post(f"{url}/v1/x", json={})).json() for _ in range(3)]
    assert (replies, len(accepted)) == ([{"ok": True}] * 3, 1)


async def test_an_https_url_goes_through_httpx_s_own_transport() -> None:
    async with _raw_server(_replying(_OK)) as (url, _):
        pass  # closed: nothing listens there now
    async with httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.ConnectError):
            await client.get(url.replace("http://", "https://"))
        assert isinstance(client._transport, Http1Transport) and client._transport._tls is not None


async def test_another_scheme_is_refused_by_name() -> None:
    async with httpx.AsyncClient(transport=Http1Transport()) as client:
        with pytest.raises(httpx.UnsupportedProtocol, match="ftp"):
            await client.get("ftp://127.0.0.1:1/")
