"""Run the app under uvicorn on a socket we bind ourselves (TCP loopback or a 0600 Unix socket)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.config import LOGGING_CONFIG

from ..daemon.config import ListenConfig, NodeConfig
from ..daemon.events import emit
from ..daemon.node import Daemon
from ..daemon.policy_runtime import PolicyRuntime
from .app import create_app

__all__ = ["KEEP_ALIVE_S", "bind", "serve"]

# How long an idle keep-alive connection stays open: longer than any client keeps one (uvicorn's default 5 s equals
# httpx's pool expiry, and a reused connection then meets the server closing it: "Server disconnected").
KEEP_ALIVE_S = 75  # seconds; uvicorn takes an int


def bind(listen: ListenConfig) -> tuple[socket.socket, str]:
    """Bind the listening socket before uvicorn starts, so port 0 (OS-chosen) is race-free."""
    if listen.uds:
        path = Path(listen.uds)
        if path.exists():
            path.unlink()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is created 0600: only this user may drive the node
        try:
            sock.bind(str(path))
        finally:
            os.umask(old)
        return sock, f"unix:{path}"
    sock = socket.socket(socket.AF_INET6 if ":" in listen.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this (asyncio sets it only on sockets it creates): no ~40 ms Nagle wait per reply.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((listen.host, listen.port))
    host, port = sock.getsockname()[:2]
    return sock, f"http://{host}:{port}"


def _write_ready(path: str, url: str) -> None:
    Path(f"{path}.tmp").write_text(json.dumps({"url": url, "pid": os.getpid()}))
    os.replace(f"{path}.tmp", path)  # readers never see a half-written file


async def _launch_engines(daemon: Daemon) -> bool:
    """Start the engines colocd launches (``launch:``) before serving; False if a signal stopped it. Not in the
    lifespan, so a launch failure is one line from the CLI; SIGINT/SIGTERM cancel the launch (stopping what it
    started), where the default handler would orphan them."""
    loop = asyncio.get_running_loop()
    launching = asyncio.ensure_future(daemon.launches.start())
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, launching.cancel)
    try:
        await launching
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if launching.cancelled() and not (task is not None and task.cancelling()):
            return False
        raise
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    return True


async def serve(config: NodeConfig, *, log_level: str = "info", log_json: bool = False) -> None:
    """Serve until SIGINT/SIGTERM; SIGHUP reloads the policy file if one is configured. Launched engines are ready
    before the daemon listens and stopped when it exits (``EngineLaunchError`` if one is not ready in time)."""
    policies = PolicyRuntime(config)  # an invalid policy file fails here, before we listen
    sock, url = bind(config.listen)
    daemon = Daemon(config, policies=policies)
    try:
        if await _launch_engines(daemon):
            await _serve_app(config, daemon, policies, sock, url, log_level=log_level, log_json=log_json)
    finally:
        await daemon.launches.aclose()  # also when the app's startup failed before the daemon closed them
        sock.close()


async def _serve_app(config: NodeConfig, daemon: Daemon, policies: PolicyRuntime, sock: socket.socket, url: str,
                     *, log_level: str, log_json: bool) -> None:
    app = create_app(config, daemon=daemon)
    # JSON logs: no uvicorn log config, so its records reach our root handler as JSON too.
    log_config = None if log_json else LOGGING_CONFIG
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, lifespan="on", access_log=False,
                                           log_config=log_config, timeout_keep_alive=KEEP_ALIVE_S))
    loop = asyncio.get_running_loop()
    if config.policy_file:
        # Parsing is CPU work: a signal only schedules it on a worker thread, never on the event loop.
        reloads: set[asyncio.Future[Any]] = set()

        def reload_on_sighup() -> None:
            future = asyncio.ensure_future(asyncio.to_thread(policies.reload_file))
            reloads.add(future)
            future.add_done_callback(reloads.discard)

        loop.add_signal_handler(signal.SIGHUP, reload_on_sighup)

    serve_task = asyncio.create_task(server.serve(sockets=[sock]))
    # uvicorn exposes no started-event, only this flag; poll it briefly.
    while not server.started and not serve_task.done():  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    if server.started:
        if log_json:  # every line of a JSON log is one object: this one too, on stderr with the others
            emit("listening", logging.INFO, url=url, pid=os.getpid())
        else:
            print(f"colocd listening on {url}", flush=True)
        if config.listen.ready_file:
            _write_ready(config.listen.ready_file, url)
    await serve_task
