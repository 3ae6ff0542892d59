"""Idle HTTP connections on both sides of the daemon: no request may meet a connection its server is closing.

uvicorn closes a keep-alive connection idle for 5 s (SGLang and vLLM run it so), and httpx keeps one for 5 s:
a request sent on a connection idle for just under 5 s can cross the server's close and fail with "Server
disconnected without sending a response" (a cluster client hit it in CI). So the daemon holds its own idle
connections longer than clients keep theirs, and lets its connections to engines go well before they close.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from support import daemon_node

from colocd.engines.reference.launcher import ReferenceEngineProcess

HTTPX_KEEPALIVE_S = 5.0  # httpx's default pool expiry, and uvicorn's default keep-alive
IDLE_S = 3.0  # between the daemon's engine-connection expiry and the engines' keep-alive
DEADLINE_S = 60


class CountingProxy:
    """A TCP relay in front of an engine that counts the connections made to it (the engine is the real one)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self.connections = 0
        self.url = ""

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        up_reader, up_writer = await asyncio.open_connection(*self._upstream)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except ConnectionError:
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    @asynccontextmanager
    async def serve(self) -> AsyncIterator[CountingProxy]:
        server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            yield self


async def test_the_daemon_keeps_an_idle_connection_open_longer_than_an_httpx_client_keeps_it(
        pooled_engine: ReferenceEngineProcess) -> None:
    # colocd serve itself: its server's keep-alive is what is under test.
    async with daemon_node({"ref0": str(pooled_engine.url)}, subprocess=True) as d:
        host, port = d.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: colocd\r\n\r\n")
        async with asyncio.timeout(DEADLINE_S):
            head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        # Idle past the client's expiry: the server must not have closed it (read() would return b"").
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(HTTPX_KEEPALIVE_S + 1.0):
                await reader.read(1)
        writer.write(b"GET /healthz HTTP/1.1\r\nHost: colocd\r\n\r\n")  # and it still serves on it
        async with asyncio.timeout(DEADLINE_S):
            assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200")
        writer.close()


async def test_the_daemon_lets_an_engine_connection_go_before_the_engines_keep_alive_would_close_it(
        pooled_engine: ReferenceEngineProcess) -> None:
    # No health passes during the test: only the calls it makes reach the engine.
    async with (CountingProxy(str(pooled_engine.url)).serve() as proxy,
                daemon_node({"ref0": proxy.url}, timeouts={"health_interval_s": 600}) as node):
        client = node.client
        await client.phase("train", 1)  # engine calls: observe, release
        before = proxy.connections
        assert before >= 1
        # Idle longer than the daemon keeps an engine connection, shorter than the engine keeps it open.
        await asyncio.sleep(IDLE_S)  # the idle time is what is under test
        await client.phase("sync", 1)  # engine calls again: on a new connection, not the one left idle
        assert proxy.connections > before
