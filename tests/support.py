"""Test helpers: the fixture factory (reference engines, a module's engine pool reset through the engine's API,
daemons in the test's event loop or as ``colocd serve``, and their clients); serving an ASGI app on an OS-chosen
loopback port; this process's colocd shared-memory segments; an adapter that loads shm chunks as vLLM's colocd
extension does; a stand-in NVML that mirrors a CPU reference engine's memory as one GPU's."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping, MutableMapping, Sequence
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import uvicorn

from colocd.api.server import KEEP_ALIVE_S
from colocd.engines.base import (
    ChunkLoad,
    ChunkPart,
    EngineDigests,
    EngineInfo,
    MemoryReport,
    MemoryTag,
    Observation,
    PauseMode,
    ReleaseReport,
)
from colocd.engines.handles import parse_handle
from colocd.engines.shm_files import files_in_use
from colocd.policies import Transport

__all__ = ["BASE", "DEADLINE_S", "AsIfOnGpu", "DaemonNode", "EngineMirrorNvml", "EnginePool", "InMemoryEngine",
           "LoadsShm", "NvmlNode", "RestartableEngine", "chunk_part", "daemon_node", "engine_tags", "entered_in_thread",
           "in_process_daemon", "leaves_no_shm_segments", "node_config", "node_on_mirrored_gpu", "reference_config",
           "reference_engine", "request_body", "restartable_engine", "serve_app", "serve_lifespan", "served_checksums",
           "shm_left_behind", "shm_segments", "stand_in_engine", "weights_checksum"]

# An ASGI app's three arguments, as the tests' own forwarding apps take them.
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class InMemoryEngine:
    """An engine adapter with no server behind it: every verb succeeds at once, the weight version is what was last
    set, and the process never restarts. A test subclasses it to hold, fail or count the verbs it is about; the
    daemon under test is the real one."""

    transports: frozenset[Transport] = frozenset(Transport)  # it reads no payload, so any transport will do
    incarnation = "one"

    def __init__(self, name: str = "e0") -> None:
        self.name = name
        self.version: str | None = "v0"

    async def attach(self) -> EngineInfo:
        return EngineInfo(self.name, "fake", "0", "fake", self.version)

    async def started(self) -> bool:
        return True

    async def observe(self) -> Observation:
        return Observation(incarnation=self.incarnation, weight_version=self.version)

    async def pause_generation(self, mode: PauseMode) -> None: ...
    async def continue_generation(self) -> None: ...

    async def flush_cache(self) -> bool:
        return True

    async def release_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        return ReleaseReport(tags)

    async def resume_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        return ReleaseReport(tags)

    async def begin_weight_update(self) -> None: ...
    async def load_weights(self, load: ChunkLoad) -> None: ...

    async def end_weight_update(self, version: str | None = None) -> None:
        if version is not None:
            self.version = version

    async def weight_digests(self, names: Sequence[str]) -> EngineDigests:
        return EngineDigests(None, "an in-memory engine holds no tensors")

    async def memory_report(self) -> MemoryReport | None:
        return None

    async def load_lora_adapter(self, name: str, path: str) -> None: ...
    async def unload_lora_adapter(self, name: str) -> None: ...

    async def aclose(self) -> None: ...


async def serve_lifespan(receive: Receive, send: Send,
                         on_shutdown: Callable[[], Awaitable[None]] | None = None) -> None:
    """An ASGI app's lifespan conversation: started at once; ``on_shutdown`` runs before it reports stopped."""
    while (await receive())["type"] != "lifespan.shutdown":
        await send({"type": "lifespan.startup.complete"})
    if on_shutdown is not None:
        await on_shutdown()
    await send({"type": "lifespan.shutdown.complete"})


async def request_body(receive: Receive) -> bytes:
    """An ASGI request's whole body."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


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


def chunk_part(rank: int, transport: Transport | str, nbytes: int, handle: dict[str, Any],
               digests: dict[str, str] | None = None) -> ChunkPart:
    """A trainer rank's part of a chunk as the API builds it: ``handle`` parsed into its transport's model."""
    return ChunkPart(rank, Transport(transport), nbytes, parse_handle(Transport(transport), handle), digests)


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


def shm_left_behind(before: set[str]) -> set[str]:
    """/dev/shm files that appeared since ``before`` (a listing) and that no process maps or holds open any more:
    what something stopped meanwhile left behind. (Other programs' files are in use, or were there before.)"""
    return set(os.listdir("/dev/shm")) - before - files_in_use()


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
        return engine_tags(self._http.get("/server_info").json())[tag][1]

    def resident(self) -> int:
        return sum(n for resident, n in engine_tags(self._http.get("/server_info").json()).values() if resident)

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
    """The real adapter, advertising the transports the reference engine accepts on CUDA (SGLang's): it runs on
    the CPU here, and a CPU engine honestly offers only inline."""

    transports = frozenset({Transport.INLINE, Transport.CUDA_IPC, Transport.PER_TENSOR})

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


class LoadsShm:
    """The real adapter of a reference engine, loading colocd's ``shm`` chunks as vLLM's colocd worker extension
    does: each rank's segment is opened read-only by name and its tensors copied out (the extension's own
    ``ChunkReceiver``, never unlinking: the trainer owns the segment); the copies then reach the engine the way
    it loads tensors (inline). Every other verb, and every other transport, is the engine's own."""

    def __init__(self, inner: Any) -> None:
        import torch

        from colocd.engines.vllm.extension import ChunkReceiver

        self._inner = inner
        self._receiver = ChunkReceiver(torch.device("cpu"))

    @property
    def transports(self) -> frozenset[Transport]:
        return frozenset(self._inner.transports) | {Transport.SHM}

    async def load_weights(self, load: ChunkLoad) -> None:
        import dataclasses

        parts = tuple([await asyncio.to_thread(self._inline, p) if p.transport is Transport.SHM else p
                       for p in load.payloads])
        await self._inner.load_weights(dataclasses.replace(load, payloads=parts))

    def _inline(self, part: ChunkPart) -> ChunkPart:
        from colocd.trainer.producer import Producer

        named = self._receiver.tensors({"transport": "shm", "handle": part.handle.wire})
        exported = Producer("inline").export(named)
        return chunk_part(part.rank, Transport.INLINE, exported.nbytes, exported.handle, part.digests)

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


# --- the fixture factory: reference engines, daemons, clients -------------------------------------------
#
# Every integration test builds its node from these: ``reference_engine`` (a fresh process, where the process is
# the point: it is killed, restarted, or its launch is what is tested), ``stand_in_engine`` (a script in its
# place, where only the supervised process group matters), ``EnginePool`` (module-scoped processes a
# test borrows and the pool resets through the engine's own API afterwards) and ``daemon_node`` (the daemon in
# the test's event loop, or ``colocd serve`` as a child process where the process is the point).

DEADLINE_S = 60.0  # readiness of an engine or a daemon


def write_peft_adapter(folder: Path, seed: int, rank: int = 8) -> Path:
    """A PEFT LoRA folder for the tiny Qwen2 both live tiers serve (q_proj 128 → 128, v_proj 128 → 64), as
    ``save_pretrained`` writes it; A and B random (PEFT's default B = 0 would change nothing)."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in (0, 1):
        for proj, out in (("q_proj", 128), ("v_proj", 64)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 128, generator=g) * 0.5
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.5
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["q_proj", "v_proj"], "base_model_name_or_path": None}))
    return folder


def reference_config(name: str = "ref0", **config: Any) -> Any:
    """A reference engine on an OS-chosen loopback port: seed 0 unless ``config`` says otherwise."""
    from colocd.engines.config import ReferenceEngineConfig

    return ReferenceEngineConfig.model_validate({"name": name, "url": "http://127.0.0.1:0", "seed": 0, **config})


@asynccontextmanager
async def reference_engine(name: str = "ref0", *, drivable: bool = False, options: Any = None, log_path: Any = None,
                           **config: Any) -> AsyncIterator[Any]:
    """A fresh reference engine process (``ReferenceEngineProcess``), ready once a generation answers (``drivable``:
    once it accepts a pause); ``drivable``, ``options`` and ``log_path`` are the launcher's."""
    from colocd.engines.reference.launcher import ReferenceEngineProcess

    async with ReferenceEngineProcess(reference_config(name, **config), drivable=drivable, options=options,
                                      log_path=log_path) as proc:
        yield proc


class RestartableEngine:
    """A reference engine that a test SIGKILLs and starts again on the same URL (what ``restartable_engine``
    yields); ``proc`` is the process running now."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @property
    def url(self) -> str:
        return str(self.proc.url)

    async def kill(self) -> None:
        """SIGKILL: no handler runs; the process is reaped."""
        import signal

        assert self.proc.pid is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        await self.proc.aclose()
        assert self.proc.returncode == -signal.SIGKILL

    async def restart(self, *, drivable: bool = False) -> None:
        """Kill it (if it runs) and start a fresh process of its config on its URL, ready once a generation answers
        (``drivable``: once it accepts a pause, where a daemon watching it may pause it before its first generation)."""
        from colocd.engines.reference.launcher import ReferenceEngineProcess

        if self.proc.returncode is None:
            await self.kill()
        self.proc = ReferenceEngineProcess(self.proc.config.model_copy(update={"url": self.url}),
                                           drivable=drivable)
        await self.proc.astart()


@asynccontextmanager
async def restartable_engine(name: str = "ref0", **config: Any) -> AsyncIterator[RestartableEngine]:
    """A fresh reference engine process the test may kill and restart; whichever runs last is stopped at exit."""
    async with reference_engine(name, **config) as proc:
        engine = RestartableEngine(proc)
        try:
            yield engine
        finally:
            await engine.proc.aclose()


@asynccontextmanager
async def stand_in_engine(script: str, *args: str, workdir: Any, name: str = "stand-in") -> AsyncIterator[Any]:
    """A small Python ``script`` in place of an engine, supervised as a launcher supervises one
    (``engines/processes.py``: its own process group, its log in ``workdir``): started with ``args`` and the path
    of a ready file, ready once the script creates that file; stopped at exit (again, if the test stopped it)."""
    import sys
    from pathlib import Path

    from colocd.engines.processes import ManagedProcess

    ready = Path(workdir, f"{name}.ready")
    proc = ManagedProcess(name, [sys.executable, "-c", script, *args, str(ready)], dict(os.environ),
                          log_file=Path(workdir, f"{name}.log"))
    proc.spawn()
    try:
        async def created() -> bool | None:
            return True if ready.exists() else None  # noqa: ASYNC240 - one stat per poll

        await proc.wait_ready(created, DEADLINE_S)
        yield proc
    finally:
        await proc.stop(grace_s=5)


class EnginePool:
    """Reference engine processes shared by a module's tests, one per configuration.

    ``borrow(**config)`` hands out the module's engine for that configuration (started at its first borrow);
    ``give_back`` resets it through its API (generation continued, every tag resident, no update open, the seed's
    weights, the start's weight version, caches flushed) and then requires every observable of it to equal what
    the freshly started process showed. An engine a test killed, or one the reset cannot bring back, is stopped
    and the next borrow starts another, so no test ever sees what an earlier one did.
    """

    def __init__(self) -> None:
        self._idle: dict[str, Any] = {}

    def _held(self, name: str, config: dict[str, Any]) -> Any:
        """The module's idle engine of this configuration, or a new, not yet started process of it."""
        from colocd.engines.reference.launcher import ReferenceEngineProcess

        key = repr(sorted({"name": name, **config}.items()))
        proc = self._idle.pop(key, None)
        if proc is None or proc.returncode is not None:
            proc = ReferenceEngineProcess(reference_config(name, **config))
        proc.pool_key = key
        return proc

    def borrow(self, name: str = "ref0", **config: Any) -> Any:
        proc = self._held(name, config)
        if proc.process is None:
            proc.start()
            proc.fresh = _observe(proc)
        return proc

    @asynccontextmanager
    async def lent(self, **engines: dict[str, Any]) -> AsyncIterator[dict[str, str]]:
        """The module's engines by name, each of its configuration, as ``{name: url}`` (what ``daemon_node``
        takes); those not yet running start concurrently (each is a process importing torch); each is given back
        (reset) afterwards."""
        procs = [self._held(name, config) for name, config in engines.items()]
        new = [proc for proc in procs if proc.process is None]
        try:
            started = await asyncio.gather(*(proc.astart() for proc in new), return_exceptions=True)
            if failed := [error for error in started if error is not None]:
                raise failed[0]
            for proc in new:
                proc.fresh = await asyncio.to_thread(_observe, proc)
            yield {proc.config.name: str(proc.url) for proc in procs}
        finally:
            for proc in procs:
                self.give_back(proc)

    def give_back(self, proc: Any) -> None:
        if proc.returncode is not None or getattr(proc, "fresh", None) is None:  # killed, or never ready
            proc.stop()
            return
        try:
            _reset(proc, proc.fresh)
            now = _observe(proc)
        except BaseException:
            proc.stop()
            raise
        if now != proc.fresh:
            proc.stop()
            raise AssertionError(f"the reset left engine {proc.config.name!r} unlike a fresh one: {now} != "
                                 f"{proc.fresh}")
        self._idle[proc.pool_key] = proc

    def close(self) -> None:
        """Stop every engine, concurrently: each waits for its own clean exit."""
        from concurrent.futures import ThreadPoolExecutor

        procs = list(self._idle.values())
        self._idle.clear()
        with ThreadPoolExecutor(max(1, len(procs))) as stopping:
            list(stopping.map(lambda proc: proc.stop(), procs))


def engine_tags(server_info: dict[str, Any]) -> dict[str, tuple[bool, int]]:
    """A reference engine's tags from its server_info: whether each is resident now (``memory_resident``, which only
    the reference engine reports) and the bytes it holds when resident (SGLang's ``memory_usage``, in GB)."""
    state = server_info["internal_states"][0]
    usage = state["memory_usage"]
    sizes = {"weights": usage["weight"], "kv_cache": usage["kvcache"], "cuda_graph": sum(usage["graph"].values())}
    return {tag: (bool(state["memory_resident"][tag]), round(gb * 2**30)) for tag, gb in sizes.items()}


def weights_checksum(named: Iterable[tuple[str, Any]]) -> str:
    """The ``per_gpu_checksum`` SGLang's ``/weights_checker`` answers for a TP rank that serves exactly these tensors
    (utils/weight_checker.py): per tensor the first 16 hex digits of the sha256 of its bytes; over them, the sha256
    of each name and its digest, in name order."""
    import torch

    digests = {name: hashlib.sha256(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
               .hexdigest()[:16] for name, t in named}
    overall = hashlib.sha256()
    for name in sorted(digests):
        overall.update(name.encode())
        overall.update(digests[name].encode())
    return overall.hexdigest()


async def served_checksums(url: str, *, api_key: str | None = None) -> list[str]:
    """Each TP rank's ``per_gpu_checksum`` of the weights the engine at ``url`` serves, from the ``ranks`` of its
    ``/weights_checker`` checksum reply (SGLang's shape); ``== [weights_checksum(named)] * tp_size`` says that every
    rank serves exactly ``named``."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(trust_env=False, timeout=DEADLINE_S, headers=headers) as http:
        response = await http.post(f"{url.rstrip('/')}/weights_checker", json={"action": "checksum"})
        response.raise_for_status()
        return [str(rank["per_gpu_checksum"]) for rank in response.json()["ranks"]]


def _engine_http(proc: Any) -> httpx.Client:
    headers = {"Authorization": f"Bearer {proc.config.api_key}"} if proc.config.api_key else {}
    return httpx.Client(base_url=str(proc.url), headers=headers, timeout=DEADLINE_S, trust_env=False)


def _observe(proc: Any) -> dict[str, Any]:
    """What a client can see of an engine's state: the daemon's inputs, and what the tests assert on."""
    legacy = proc.config.protocol == "legacy"
    with _engine_http(proc) as http:
        info = http.get("/get_server_info" if legacy else "/server_info").json()
        model = http.get("/get_model_info" if legacy else "/model_info").json()
        tags = engine_tags(info)
        check = http.post("/weights_checker", json={"action": "checksum"}).json() if not legacy else {}
    return {"state": info["internal_states"][0], "weight_version": model["weight_version"],
            "resident": {tag: resident for tag, (resident, _) in tags.items()},
            "checksum": check.get("per_engine_checksum"), "pid": proc.pid}


def _reset(proc: Any, fresh: dict[str, Any]) -> None:
    legacy = proc.config.protocol == "legacy"
    with _engine_http(proc) as http:
        _ok(http.post("/continue_generation", **({} if legacy else {"json": {}})))
        info = http.get("/get_server_info" if legacy else "/server_info").json()
        released = [t for t, (resident, _) in engine_tags(info).items() if not resident]
        if released:
            _ok(http.post("/resume_memory_occupation", json={"tags": released}))
        if not legacy and http.get("/server_info").json()["internal_states"][0]["weight_update_session"]:
            _ok(http.post("/end_weight_update", json={}))
        if not legacy and http.post("/weights_checker", json={"action": "checksum"}).json().get(
                "per_engine_checksum") != fresh["checksum"]:
            _load_seed_weights(http, proc.config)
        _ok(http.post("/update_weight_version", json={"new_version": fresh["weight_version"]}))
        _ok(http.post("/flush_cache"))


def _load_seed_weights(http: httpx.Client, config: Any) -> None:
    """The weights a fresh engine of ``config`` serves, loaded through one inline (SGLang flattened_bucket) update."""
    from colocd.engines.reference.model import QwenLikeConfig, build_model
    from colocd.trainer.producer import Producer

    named = list(build_model(QwenLikeConfig(**config.model), seed=config.seed).named_parameters())
    entry = Producer("inline").export(named).handle["payload_b64"]
    _ok(http.post("/begin_weight_update", json={}))
    _ok(http.post("/update_weights_from_tensor", json={
        "serialized_named_tensors": [entry] * int(config.tp_size), "load_format": "flattened_bucket",
        "flush_cache": True}))
    _ok(http.post("/end_weight_update", json={}))


def _ok(response: httpx.Response) -> None:
    assert response.status_code == 200, f"{response.request.url.path}: {response.status_code} {response.text}"
    body = response.json() if response.headers.get("content-type", "").startswith("application/json") else None
    assert not (isinstance(body, dict) and body.get("success") is False), body


@dataclass
class DaemonNode:
    """What ``daemon_node`` yields: a client of the daemon, its URL, its engines' own URLs (not the daemon's view of
    them: a proxy may stand between), and the daemon itself (in this event loop) or its process (``colocd serve``)."""

    client: Any  # colocd.api.client.AsyncColocdClient
    url: str
    process: Any = None  # colocd.api.procs.DaemonProcess, with ``subprocess=True``
    token: str | None = None
    engine_urls: dict[str, str] = field(default_factory=dict)
    daemon: Any = None  # colocd.daemon.node.Daemon, in this event loop
    fronts: dict[str, Any] = field(default_factory=dict)  # engine name → the app served in front of it (``via``)

    @property
    def engine_url(self) -> str:
        """The URL of the node's one engine."""
        (url,) = self.engine_urls.values()
        return url

    @property
    def front(self) -> Any:
        """The app served in front of the node's one engine."""
        (app,) = self.fronts.values()
        return app

    def http(self, timeout_s: float = DEADLINE_S) -> httpx.AsyncClient:
        """A plain HTTP client of the daemon (with its token, if it has one), for requests the client cannot make."""
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=timeout_s, trust_env=False)

    async def engine_get(self, path: str, engine: str | None = None) -> Any:
        """``GET path`` of an engine itself (the only one unless named), as JSON."""
        url = self.engine_urls[engine] if engine is not None else self.engine_url
        async with httpx.AsyncClient(trust_env=False, timeout=DEADLINE_S) as http:
            response = await http.get(url + path)
            response.raise_for_status()
            return response.json()

    async def engine_memory(self, engine: str | None = None) -> dict[str, bool]:
        """An engine's own per-tag residency, asked directly."""
        tags = engine_tags(await self.engine_get("/server_info", engine))
        return {tag: resident for tag, (resident, _) in tags.items()}

    async def kill(self) -> None:
        """The crash of ``colocd serve``: SIGKILL, no handler runs, nothing it started is stopped."""
        import signal

        assert self.process is not None and self.process.process is not None, "kill() needs subprocess=True"
        os.kill(self.process.pid, signal.SIGKILL)
        await self.process.process.wait_exit()

    async def stop(self) -> None:
        """Stop ``colocd serve`` the way an operator does (SIGTERM: it shuts down and leaves attached engines as
        they are)."""
        assert self.process is not None, "stop() needs subprocess=True"
        await self.process.stop()

    async def restart(self, *, ready: bool = True) -> None:
        """Start ``colocd serve`` again after ``kill()`` or ``stop()``, with the same config and workdir (so the same
        journal); the client follows it to its new port. Waits for ``/readyz`` unless ``ready=False``."""
        from colocd.api.client import AsyncColocdClient

        assert self.process is not None and not self.process.process.running, "restart() follows kill() or stop()"
        await self.client.aclose()
        await self.process.__aenter__()  # daemon_node's exit stops whichever process runs last
        self.url = self.process.url
        self.client = AsyncColocdClient(self.url, token=self.token)
        if ready:
            await self.client.wait_ready(DEADLINE_S)


@contextmanager
def entered_in_thread(manager: Any) -> Iterator[tuple[Any, Callable[[Awaitable[Any]], Any]]]:
    """Enter the async context manager ``manager`` (a ``daemon_node(...)``) on an event loop of its own thread, for
    a fixture of synchronous tests that outlives one event loop (a module's); yields what it yields and
    ``run(coroutine)``, which runs a coroutine on that loop (its methods: ``run(node.restart())``)."""
    import threading

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="entered-in-thread", daemon=True)
    thread.start()

    def run(coroutine: Awaitable[Any]) -> Any:
        async def wrapped() -> Any:
            return await coroutine

        return asyncio.run_coroutine_threadsafe(wrapped(), loop).result()

    try:
        value = run(manager.__aenter__())
        try:
            yield value, run
        finally:
            run(manager.__aexit__(None, None, None))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
        loop.close()


def node_config(engines: list[dict[str, Any]] | dict[str, str] | None = None, *,
                adapters: Mapping[str, Any] | None = None, **config: Any) -> Any:
    """A ``NodeConfig`` over ``engines`` (config entries, or ``{name: url}`` of reference engines) and, for each of
    ``adapters`` not among them, an entry no request will reach (the adapter stands in for its engine)."""
    from colocd.daemon.config import NodeConfig

    entries = _engine_entries(engines or {})
    named = {entry["name"] for entry in entries}
    entries += [{"kind": "sglang", "name": n, "url": "http://unused"} for n in (adapters or {}) if n not in named]
    return NodeConfig.model_validate({"engines": entries, **config})


@asynccontextmanager
async def in_process_daemon(adapters: Mapping[str, Any] | None = None, engines: Any = None,
                            **config: Any) -> AsyncIterator[Any]:
    """A ``Daemon`` entered in this event loop, with no server: ``adapters`` (``{name: adapter}``, such as
    ``InMemoryEngine``s) stand in for the engines; the test drives its concerns directly."""
    from colocd.daemon.node import Daemon

    async with Daemon(node_config(engines, adapters=adapters, **config),
                      adapters=dict(adapters) if adapters else None) as daemon:
        yield daemon


def _engine_entries(engines: list[dict[str, Any]] | dict[str, str]) -> list[dict[str, Any]]:
    if isinstance(engines, dict):
        return [{"kind": "reference", "name": n, "url": str(u)} for n, u in engines.items()]
    return [dict(entry) for entry in engines]


@asynccontextmanager
async def _fronted(engine_urls: dict[str, str], via: Callable[[str], Any] | None,
                   fronts: dict[str, Any]) -> AsyncIterator[dict[str, str]]:
    """Each engine URL, or the URL of ``via(engine_url)`` (an ASGI app in front of it, kept in ``fronts``) served
    here. A front's ``release()``, where it has one, runs before its server stops: requests it holds must end."""
    if via is None:
        yield engine_urls
        return
    async with AsyncExitStack() as stack:
        seen = {}
        for name, url in engine_urls.items():
            fronts[name] = app = via(url)
            seen[name] = await stack.enter_async_context(serve_app(app, ready_path="/health"))
            if callable(getattr(app, "release", None)):
                stack.callback(app.release)
        yield seen


@asynccontextmanager
async def daemon_node(engines: list[dict[str, Any]] | dict[str, str] | None = None, *, subprocess: bool = False,
                      workdir: Any = None, token: str | None = None, ready: bool = True,
                      adapters: Mapping[str, Any] | None = None, via: Callable[[str], Any] | None = None,
                      wrap: Callable[[Any], Any] | None = None, synced_at: int | None = None,
                      log_level: str = "warning", tether: bool = False, deadline_s: float = DEADLINE_S,
                      loads_shm: bool = False, **config: Any) -> AsyncIterator[DaemonNode]:
    """A colocd daemon over ``engines`` (config entries, or ``{name: url}`` of reference engines) and a client.

    In the test's event loop by default (``node.daemon``); ``subprocess=True`` runs ``colocd serve`` as a child
    process (in ``workdir``, logging at ``log_level``, with the engines it launches ``tether``ed to it), for tests
    about that process (killed, restarted, its own segments, its log).
    ``adapters`` (``{name: adapter}``) stand in for engines in this event loop; ``via(engine_url)`` is an ASGI app
    served in front of each engine (the daemon sees it, ``node.engine_urls`` the engine); ``wrap(app)`` is what
    is served in place of the daemon's app. The client waits for ``/readyz`` (within ``deadline_s``, as
    ``colocd serve`` does for its ready file) unless ``ready=False``; with
    ``synced_at`` the node is then moved through train to sync at that step. ``loads_shm`` gives each engine that no
    adapter stands in for its real adapter wrapped in ``LoadsShm``: the node takes colocd's shm chunks, as a node
    of vLLM engines does (in this event loop only).
    """
    from colocd.api.client import AsyncColocdClient

    entries = _engine_entries(engines or {})
    own = {e["name"]: str(e["url"]) for e in entries if "url" in e and e.get("kind", "reference") == "reference"}
    async with AsyncExitStack() as stack:
        fronts: dict[str, Any] = {}
        seen = await stack.enter_async_context(_fronted(own, via, fronts))
        entries = [{**e, "url": seen[e["name"]]} if e["name"] in seen else e for e in entries]
        full = {**config, **({"token": token} if token is not None else {})}
        daemon = None
        if subprocess:
            from colocd.api.procs import DaemonProcess

            if loads_shm:
                raise ValueError("loads_shm wraps adapters in this event loop; colocd serve builds its own")

            process = await stack.enter_async_context(DaemonProcess(
                {"engines": entries, **full}, workdir=None if workdir is None else str(workdir),
                ready_timeout_s=deadline_s, log_level=log_level, tether=tether))
            url = process.url
        else:
            from colocd.api.app import create_app
            from colocd.daemon.node import Daemon

            process = None
            node_cfg = node_config(entries, adapters=adapters, **full)
            given = dict(adapters or {})
            if loads_shm:
                from colocd.engines.registry import build_adapter

                http = await stack.enter_async_context(
                    httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=5.0), trust_env=False))
                given |= {e.name: LoadsShm(build_adapter(e, http)) for e in node_cfg.engines if e.name not in given}
            daemon = Daemon(node_cfg, adapters=given or None)
            app = create_app(node_cfg, daemon=daemon)
            url = await stack.enter_async_context(serve_app(wrap(app) if wrap else app, timeout_s=deadline_s))
        node = DaemonNode(AsyncColocdClient(url, token=token), url, process, token, own, daemon, fronts)
        stack.push_async_callback(lambda: node.client.aclose())  # the client of the last restart()
        if ready:
            await node.client.wait_ready(deadline_s)
        if synced_at is not None:
            await node.client.phase("train", synced_at)
            await node.client.phase("sync", synced_at)
        yield node
