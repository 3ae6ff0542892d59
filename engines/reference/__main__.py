"""Command line of the reference engine server: bind, announce in a ready file, serve until SIGTERM.

    python -m colocd.engines.reference --host 127.0.0.1 --port 0 --device cpu --seed 0 \\
        --protocol 0.5.23 --ready-file /tmp/x/ready.json [--api-key K] [--model-json '{...}'] \\
        [--tp-size 2 [--device-ids cpu:0,cpu:1]]

The socket is bound here (port 0 = the OS picks), so the URL in the ready file is the real one and
no port is ever guessed. The ready file (``{"url", "pid"}``) is written atomically once the socket
listens; ``/health`` answers 503 until the model is built, then 200.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib
import json
import logging
import os
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence

import torch
import uvicorn
from fastapi import FastAPI

from .model import QwenLikeConfig
from .server import create_app
from .settings import PROTOCOL_VERSIONS, ReferenceServerSettings

__all__ = ["main"]

logger = logging.getLogger("colocd.engines.reference")

_GRACEFUL_SHUTDOWN_S = 5  # in-flight requests get this long after SIGTERM before being cancelled


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ReferenceServerSettings]:
    parser = argparse.ArgumentParser(
        prog="python -m colocd.engines.reference", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 lets the OS choose")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N] (with --tp-size > 1: cpu or cuda)")
    parser.add_argument(
        "--tp-size", type=int, default=1,
        help="TP ranks, each a full copy of the weights on its own device (CUDA: visible GPU r), fed by "
        "its own serialized_named_tensors entry",
    )
    parser.add_argument(
        "--device-ids", default=None,
        help="CPU only: comma-separated identity of each TP rank (default cpu:0,cpu:1,...)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the initial weights")
    parser.add_argument("--protocol", choices=sorted(PROTOCOL_VERSIONS), default="0.5.23")
    parser.add_argument("--ready-file", required=True, help="where to write {url, pid} once listening")
    parser.add_argument("--api-key", default=None, help="bearer token required on all but health routes")
    parser.add_argument("--model-json", default="{}", help="JSON object of QwenLikeConfig overrides")
    parser.add_argument("--max-batch", type=int, default=8, help="KV pool slots (concurrent requests)")
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op CPU threads; the model is tiny, so more threads only contend (default 1)",
    )
    parser.add_argument("--app", default=None, metavar="MODULE:FUNCTION",
                        help="build the app with this function of the settings instead (the lab's engines, "
                        "e.g. benchmarks.sink_engine:create_sink_app)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    try:
        overrides = json.loads(args.model_json)
        if not isinstance(overrides, dict):
            raise ValueError("--model-json must be a JSON object")
        settings = ReferenceServerSettings(
            device=args.device,
            seed=args.seed,
            protocol=args.protocol,
            api_key=args.api_key or os.environ.get("COLOCD_REFERENCE_API_KEY") or None,
            model=QwenLikeConfig.from_overrides(overrides),
            max_batch=args.max_batch,
            host=args.host,
            tp_size=args.tp_size,
            device_ids=tuple(i.strip() for i in args.device_ids.split(",")) if args.device_ids else (),
        )
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    return args, settings


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end ``serve()`` and the process then exits 0.

    uvicorn re-raises the captured signal after its graceful shutdown (so the process dies of it);
    for us SIGTERM is the documented way to stop, and a clean stop should read as success.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=128)
    # Inherited by accepted connections; asyncio would not set it on a socket it did not create,
    # and every keep-alive reply would then wait ~40 ms for the client's delayed ACK (Nagle).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _write_ready_file(path: str, payload: dict[str, object]) -> None:
    """Write then rename, so a reader never sees a half-written file."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".ready-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(payload, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


async def _serve(args: argparse.Namespace, settings: ReferenceServerSettings) -> int:
    sock = _bind(args.host, args.port)
    url = _url(sock)
    settings = dataclasses.replace(settings, port=sock.getsockname()[1])
    app = _app_factory(args.app)(settings)
    config = uvicorn.Config(
        app,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
    )
    server = _Server(config)
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    failed = asyncio.create_task(app.state.engine.wait_failed())
    _write_ready_file(args.ready_file, {"url": url, "pid": os.getpid()})
    logger.info("listening on %s (pid %d)", url, os.getpid())
    done, _ = await asyncio.wait({serving, failed}, return_when=asyncio.FIRST_COMPLETED)
    if failed in done:
        logger.error("engine failed; shutting down")
        server.should_exit = True
        await serving
        return 1
    failed.cancel()
    await serving
    return 0


def _app_factory(spec: str | None) -> Callable[[ReferenceServerSettings], FastAPI]:
    if spec is None:
        return create_app
    module, _, name = spec.partition(":")
    factory: Callable[[ReferenceServerSettings], FastAPI] = getattr(importlib.import_module(module), name)
    return factory


def main(argv: Sequence[str] | None = None) -> int:
    args, settings = _parse(argv)
    torch.set_num_threads(max(1, args.torch_threads))
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(_serve(args, settings))


if __name__ == "__main__":
    sys.exit(main())
