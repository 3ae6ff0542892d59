"""Command line of the reference engine server: bind, announce in a ready file, serve until SIGTERM.

The socket is bound here (port 0 = the OS picks), so the URL in the ready file (``{"url", "pid"}``, written
atomically once listening) is the real one; ``/health`` answers 503 until the model is built, then 200.
``main(argv, app_factory)`` serves another app of the same settings (the lab's ``benchmarks/sink_engine.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import uvicorn
from fastapi import FastAPI

from .model import QwenLikeConfig
from .server import create_app
from .settings import PROTOCOL_VERSIONS, ReferenceServerSettings

__all__ = ["AppFactory", "main"]

logger = logging.getLogger("colocd.engines.reference")

AppFactory = Callable[[ReferenceServerSettings], FastAPI]
_GRACEFUL_SHUTDOWN_S = 5  # in-flight requests get this long after SIGTERM before being cancelled


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, ReferenceServerSettings]:
    parser = argparse.ArgumentParser(prog="python -m colocd.engines.reference", description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("--host", default="127.0.0.1")
    add("--port", type=int, default=0, help="0 lets the OS choose")
    add("--device", default="cpu", help="cpu or cuda[:N] (with --tp-size > 1: cpu or cuda)")
    add("--tp-size", type=int, default=1, help="TP ranks, each a full copy of the weights on its own device "
        "(CUDA: visible GPU r), fed by its own serialized_named_tensors entry")
    add("--seed", type=int, default=0, help="seed of the initial weights")
    add("--protocol", choices=sorted(PROTOCOL_VERSIONS), default="0.5.23")
    add("--ready-file", required=True, help="where to write {url, pid} once listening")
    add("--api-key", default=None, help="bearer token required on all but health routes")
    add("--model-json", default="{}", help="JSON object of QwenLikeConfig overrides")
    add("--max-batch", type=int, default=8, help="KV pool slots (concurrent requests)")
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = parser.parse_args(argv)
    try:
        overrides = json.loads(args.model_json)
        if not isinstance(overrides, dict):
            raise ValueError("--model-json must be a JSON object")
        settings = ReferenceServerSettings(
            device=args.device, seed=args.seed, protocol=args.protocol, max_batch=args.max_batch,
            api_key=args.api_key or os.environ.get("COLOCD_REFERENCE_API_KEY") or None,
            model=QwenLikeConfig.from_overrides(overrides), tp_size=args.tp_size)
    except (ValueError, TypeError) as exc:
        parser.error(str(exc))
    return args, settings


class _Server(uvicorn.Server):
    """uvicorn's server, except that SIGTERM/SIGINT end ``serve()`` and the process exits 0 (uvicorn re-raises
    the signal after its graceful shutdown; here SIGTERM is the documented way to stop)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


async def _serve(args: argparse.Namespace, settings: ReferenceServerSettings, app_factory: AppFactory) -> int:
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.create_server((args.host, args.port), family=family, backlog=128)
    # Inherited by accepted connections; asyncio would not set it on a socket it did not create,
    # and every keep-alive reply would then wait ~40 ms for the client's delayed ACK (Nagle).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    host, port = sock.getsockname()[:2]  # port 0: the OS picked, and the URL is the real one
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    app = app_factory(settings)
    server = _Server(uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level == "debug",
                                    timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    failed = asyncio.create_task(app.state.engine.wait_failed())
    tmp = f"{args.ready_file}.tmp"
    Path(tmp).write_text(json.dumps({"url": url, "pid": os.getpid()}))  # noqa: ASYNC240 - once, tiny
    os.replace(tmp, args.ready_file)  # readers never see a half-written file
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


def main(argv: Sequence[str] | None = None, app_factory: AppFactory = create_app) -> int:
    """Serve ``app_factory(settings)`` (whose ``state.engine`` is a ``ReferenceEngine``) until SIGTERM."""
    args, settings = _parse(argv)
    torch.set_num_threads(1)  # the model is tiny: more intra-op threads only contend
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(_serve(args, settings, app_factory))


if __name__ == "__main__":
    sys.exit(main())
