"""The trainer's daemon client says "no answer" one way: ``DaemonUnreachable``, naming the call."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from colocd.api.client import AsyncColocdClient, ColocdClient, DaemonUnreachable


async def test_a_socket_nobody_listens_on_is_daemon_unreachable_naming_the_call(tmp_path: Path) -> None:
    async with AsyncColocdClient(f"unix:{tmp_path / 'absent.sock'}") as client:
        with pytest.raises(DaemonUnreachable, match="GET http://colocd/v1/status"):
            await client.status()


async def test_wait_ready_polls_an_unreachable_daemon_until_its_deadline(tmp_path: Path) -> None:
    async with AsyncColocdClient(f"unix:{tmp_path / 'absent.sock'}") as client:
        with pytest.raises(TimeoutError):
            await client.wait_ready(timeout_s=0.2)


async def test_a_daemon_that_drops_the_connection_is_daemon_unreachable() -> None:
    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(drop, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server, AsyncColocdClient(f"http://127.0.0.1:{port}") as client:
        with pytest.raises(DaemonUnreachable, match="POST"):
            await client.phase("train", 1)


def test_the_sync_client_raises_the_same(tmp_path: Path) -> None:
    with ColocdClient(f"unix:{tmp_path / 'absent.sock'}") as client, pytest.raises(DaemonUnreachable):
        client.status()
