"""Test helpers: serve an ASGI app on an OS-chosen loopback port; list colocd shared-memory segments."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn

__all__ = ["serve_app", "shm_segments"]


@asynccontextmanager
async def serve_app(app: Any, *, ready_path: str = "/healthz", timeout_s: float = 30.0) -> AsyncIterator[str]:
    """Serve an ASGI app on 127.0.0.1 with an OS-chosen port bound before uvicorn starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else ~40 ms per keep-alive reply (Nagle)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        async with httpx.AsyncClient(trust_env=False) as client, asyncio.timeout(timeout_s):
            while True:
                if task.done():
                    task.result()
                    raise RuntimeError("server exited before it was ready")
                try:
                    if (await client.get(url + ready_path)).status_code < 500:
                        break
                except httpx.TransportError:
                    pass
                await asyncio.sleep(0.01)  # readiness poll cadence
        yield url
    finally:
        server.should_exit = True
        await task
        sock.close()


def shm_segments(prefix: str = "colocd") -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}
