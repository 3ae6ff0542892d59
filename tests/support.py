"""Test helpers: serve an ASGI app on an OS-chosen loopback port; this process's colocd shared-memory segments;
a stand-in NVML that mirrors a CPU reference engine's memory as one GPU's."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import uvicorn

from colocd.api.server import KEEP_ALIVE_S
from colocd.policies import Transport

__all__ = ["BASE", "AsIfOnGpu", "EngineMirrorNvml", "NvmlNode", "leaves_no_shm_segments", "node_on_mirrored_gpu",
           "serve_app", "shm_segments"]


@asynccontextmanager
async def serve_app(app: Any, *, ready_path: str = "/healthz", timeout_s: float = 30.0) -> AsyncIterator[str]:
    """Serve an ASGI app on 127.0.0.1 with an OS-chosen port bound before uvicorn starts."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else ~40 ms per keep-alive reply (Nagle)
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_keep_alive=KEEP_ALIVE_S))
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


def shm_segments(owner: int | str | None = None) -> set[str]:
    """colocd segments created by one process: ``owner`` is its pid (default: this process, the trainer
    side of most tests) or a name prefix such as ``f"colocd-{pid}-"``.

    Segment names carry their creator's pid (``colocd-<pid>-<hex>``, engines/chunks.py), so other
    processes on the machine (another test run, another user's trainer) are never counted.
    """
    prefix = owner if isinstance(owner, str) else f"colocd-{os.getpid() if owner is None else owner}-"
    if not prefix.startswith("colocd-"):
        raise ValueError(f"{prefix!r} would match other processes' segments; pass a pid or 'colocd-<pid>-'")
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


@contextmanager
def leaves_no_shm_segments() -> Iterator[None]:
    """Fails if the block created segments (in this process) that it did not unlink."""
    before = shm_segments()
    yield
    leaked = shm_segments() - before
    assert not leaked, f"shared-memory segments created here and left behind: {sorted(leaked)}"


@dataclass(frozen=True)
class NvmlNode:
    """What tests/gpu's ``nvml_node`` fixture yields: a daemon client, its engine's URL and model config."""

    client: Any  # colocd.api.client.AsyncColocdClient
    engine_url: str
    model: dict[str, Any]


BASE = 512 << 20  # what EngineMirrorNvml's GPU holds besides the engine (a CUDA context, the trainer)


class EngineMirrorNvml:
    """Stands in for pynvml on a machine without a GPU: GPU 0's used bytes are BASE plus what the
    reference engine reports resident plus ``extra`` (another tenant: the trainer); the test sets ``total``."""

    def __init__(self, engine_url: str) -> None:
        self._http = httpx.Client(base_url=engine_url, trust_env=False, timeout=10)
        self.total = 1 << 40
        self.extra = 0
        self.reads = 0

    def tag_size(self, tag: str) -> int:
        """Bytes ``tag`` holds when resident, whatever its state now (the engine's report)."""
        return int(self._http.get("/colocd/memory").json()["tags"][tag]["resident_nbytes"])

    def resident(self) -> int:
        tags = self._http.get("/colocd/memory").json()["tags"]
        return sum(int(t["nbytes"]) for t in tags.values())

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        self.reads += 1
        used = BASE + self.extra + self.resident()
        return SimpleNamespace(used=used, free=max(self.total - used, 0), total=self.total)

    def nvmlDeviceGetComputeRunningProcesses(self, h: int) -> list[Any]:
        return []

    def nvmlShutdown(self) -> None:
        self._http.close()


class AsIfOnGpu:
    """The real adapter, advertising the transports the reference engine accepts on CUDA: it runs on the
    CPU here, and a CPU engine honestly offers only shm and disk, which stage no GPU memory."""

    transports = frozenset(Transport)

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@asynccontextmanager
async def node_on_mirrored_gpu(model: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
    """A reference engine on the CPU and an in-process daemon that sees it on GPU 0 through
    ``EngineMirrorNvml``, with the adapter offering the CUDA transports (``AsIfOnGpu``); yields the
    client, the stand-in NVML and the URLs of the daemon and of the engine."""
    from colocd.api.app import create_app
    from colocd.api.client import AsyncColocdClient
    from colocd.daemon.config import NodeConfig
    from colocd.daemon.memory import NvmlProbe
    from colocd.daemon.node import Daemon
    from colocd.engines.config import ReferenceEngineConfig
    from colocd.engines.reference.launcher import ReferenceEngineProcess
    from colocd.engines.registry import build_adapter

    engine_cfg = ReferenceEngineConfig(name="ref0", url="http://127.0.0.1:0", seed=0, model=model)
    async with ReferenceEngineProcess(engine_cfg) as engine:
        config = NodeConfig.model_validate({"engines": [{"kind": "reference", "name": "ref0", "url": engine.url,
                                                         "gpus": [0]}]})
        nvml = EngineMirrorNvml(engine.url)
        http = httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), trust_env=False)
        adapter = AsIfOnGpu(build_adapter(config.engines[0], http))
        daemon = Daemon(config, probe=NvmlProbe(nvml), adapters={"ref0": adapter})
        async with http, serve_app(create_app(config, daemon=daemon)) as url, AsyncColocdClient(url) as client:
            await client.wait_ready(30)
            yield {"client": client, "nvml": nvml, "url": url, "engine_url": str(engine.url)}
