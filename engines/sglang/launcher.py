"""Starts an SGLang server with the flags colocation needs, or attaches to a running one; no engine verbs.

``sglang_command`` is pure (config in, argv and environment out) so the flag rules are tested
without SGLang; ``SGLangServer`` says what "ready" is (``/health`` 200) and hands the process to
``engines/processes.py`` (own process group, log file, readiness under a deadline, SIGTERM then
SIGKILL to the whole group: SGLang's scheduler and detokenizer are children of the launcher).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from ...errors import EngineLaunchError
from ..config import SGLangEngineConfig
from ..processes import (
    Launched,
    LaunchOptions,
    ManagedProcess,
    flag_values,
    free_port,
    gpu_environment,
    launch_until_healthy,
    strip_expandable_segments,
    wait_healthy,
)
from .protocol import parse_version

__all__ = [
    "LaunchError",
    "SGLangServer",
    "ServerState",
    "free_port",
    "launch_sglang",
    "sglang_command",
    "strip_expandable_segments",
]

logger = logging.getLogger(__name__)

# Flags colocd sets from the engine config; launch.args may not set them again.
_OWNED_FLAGS = {
    "--host": "host (colocd binds 127.0.0.1)",
    "--port": "port (from 'url' or picked free)",
    "--model-path": "model_path",
    "--model": "model_path",
    "--tp-size": "tp_size",
    "--tensor-parallel-size": "tp_size",
    "--tp": "tp_size",
    "--api-key": "api_key",
}
# First release verified to have --weight-cache-mode (arg_groups/fields/model.py:377); 0.5.9 lacks it.
_WEIGHT_CACHE_FLAG_MIN = (0, 5, 23)


# The SGLang server could not be started, did not become ready, or was misconfigured: the one
# launch error of every launcher (engines/processes.py), under this module's historical name.
LaunchError = EngineLaunchError


def sglang_command(
    config: SGLangEngineConfig,
    port: int,
    *,
    python: str = sys.executable,
    environ: Mapping[str, str] | None = None,
    sglang_version: str | None = None,
) -> tuple[list[str], dict[str, str]]:
    """The argv and full environment that start ``config``'s server on 127.0.0.1:``port``.

    With ``--device cpu`` in ``launch.args`` the server runs on SGLang's CPU engine
    (``SGLANG_USE_CPU_ENGINE=1``) and without ``--enable-memory-saver``, whose library has only CUDA hooks.

    ``environ`` is the environment to start from (default: this process's). ``sglang_version``,
    when known, drops flags that version does not have; unknown means the newest verified (0.5.23).
    Raises ``LaunchError`` naming the setting for anything that would break colocation.
    """
    if config.launch is None:
        raise LaunchError(config.name, f"has no 'launch' section: colocd attaches to {config.url}")
    if not config.model_path:
        raise LaunchError(config.name, "set 'model_path' to launch SGLang")
    extra = list(config.launch.args)
    given = flag_values(config.name, extra, _OWNED_FLAGS)
    cache_mode = given.get("--weight-cache-mode")
    if "--weight-cache-mode" in given and cache_mode != "off":
        # Not off: release/resume of weights and every update_weights_from_* raise
        # (weight_updater.py _assert_weight_cache_inactive; research §1.1).
        raise LaunchError(
            config.name, f"--weight-cache-mode {cache_mode} disables weight updates; use off"
        )
    for flag in ("--dp-size", "--data-parallel-size"):
        if given.get(flag) not in (None, "1"):
            # Tensor and distributed updates assert dp_size == 1 (research §1.6): one server per replica.
            raise LaunchError(
                config.name, f"{flag} {given[flag]}; run one SGLang server per DP replica"
            )

    on_cpu = given.get("--device") == "cpu"
    if on_cpu and "--enable-memory-saver" in given:
        raise LaunchError(
            config.name, "--enable-memory-saver with --device cpu: torch_memory_saver has only CUDA hooks and "
            "the server dies at start; on CPU colocd launches without it (releases then free nothing)"
        )
    argv = [
        python, "-m", "sglang.launch_server",
        "--model-path", config.model_path,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--tp-size", str(config.tp_size),
    ]  # fmt: skip
    if not on_cpu:
        # Without it release/resume only log a warning and free nothing (sgl-project/sglang#4566).
        argv.append("--enable-memory-saver")
    if "--weight-cache-mode" not in given and (
        sglang_version is None or parse_version(sglang_version)[:3] >= _WEIGHT_CACHE_FLAG_MIN
    ):
        argv += ["--weight-cache-mode", "off"]
    if config.api_key:
        # Visible in the process table to local users; control routes then need the bearer key.
        argv += ["--api-key", config.api_key]
    argv += extra

    env = dict(os.environ if environ is None else environ)
    for key, value in config.launch.env.items():
        env[key] = value
    if on_cpu:
        # --device cpu alone leaves SGLang's is_cpu() False and the model build imports vllm
        # (0.5.23 utils/common.py:221-224): the CPU engine needs this too.
        if config.launch.env.get("SGLANG_USE_CPU_ENGINE", "1") != "1":
            raise LaunchError(config.name, "--device cpu with launch.env SGLANG_USE_CPU_ENGINE="
                              f"{config.launch.env['SGLANG_USE_CPU_ENGINE']}: SGLang's CPU engine needs it 1")
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    graph_var = config.launch.env.get("SGLANG_MEMORY_SAVER_CUDA_GRAPH")
    if config.memory_saver_cuda_graph:
        if graph_var not in (None, "1", "true", "True"):
            raise LaunchError(
                config.name, f"launch.env SGLANG_MEMORY_SAVER_CUDA_GRAPH={graph_var} "
                "contradicts memory_saver_cuda_graph: true"
            )
        # Graph memory goes into the cuda_graph tag only with this set (environ.py:1645); NCCL's
        # graph buffer registration must be off or replays hang after a resume
        # (fzyzcjy/torch_memory_saver#88, sgl-project/sglang#40648).
        env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] = "1"
        env["NCCL_GRAPH_REGISTER"] = "0"
    else:
        if graph_var is not None:
            raise LaunchError(
                config.name, "launch.env sets SGLANG_MEMORY_SAVER_CUDA_GRAPH; "
                "set memory_saver_cuda_graph in the engine config instead, so colocd knows the tag owns "
                "memory"
            )
        # An inherited setting would make the cuda_graph tag own memory the daemon does not expect.
        env.pop("SGLANG_MEMORY_SAVER_CUDA_GRAPH", None)

    gpu_environment(config.name, env, config.launch.env, config.gpu_uuids or [str(g) for g in config.gpus],
                    config.tp_size)
    return argv, env


class ServerState(Enum):
    """Lifecycle of one ``SGLangServer``."""

    STARTING = "starting"  # process started, /health not yet 200
    READY = "ready"
    STOPPED = "stopped"  # stopped by us, or exited


class SGLangServer:
    """One SGLang server colocd started (it owns the process group) or attached to (it owns nothing)."""

    def __init__(self, name: str, url: str, process: ManagedProcess | None = None) -> None:
        self.name = name
        self.url = url.rstrip("/")
        self.process = process
        self.state = ServerState.STARTING

    @property
    def log_path(self) -> Path | None:
        return self.process.log_path if self.process is not None else None

    @classmethod
    def attach(cls, name: str, url: str) -> SGLangServer:
        """A server someone else runs; ``stop`` leaves it alone."""
        return cls(name, url)

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        url: str,
        *,
        log_file: str | os.PathLike[str] | None = None,
        on_spawn: Callable[[ManagedProcess], None] | None = None,
    ) -> SGLangServer:
        """Start ``argv`` in its own process group with stdout and stderr appended to a log file; ``on_spawn``
        is told the process as soon as it exists (the daemon journals it before it is ready)."""
        process = ManagedProcess(name, argv, env, label="SGLang", log_file=log_file, on_spawn=on_spawn)
        process.spawn()
        return cls(name, url, process)

    @classmethod
    async def launch(
        cls,
        config: SGLangEngineConfig,
        client: httpx.AsyncClient | None = None,
        *,
        python: str | None = None,
        sglang_version: str | None = None,
        on_spawn: Callable[[ManagedProcess], None] | None = None,
    ) -> SGLangServer:
        """Start ``config``'s server and wait for ``/health`` within ``launch.ready_timeout_s``.

        The port comes from ``config.url`` if set, else a free one; if that one is taken by the
        time SGLang binds it, a second free port is tried once.
        """
        if config.launch is None:
            raise LaunchError(config.name, "has no 'launch' section")
        python = python or os.environ.get("COLOCD_SGLANG_PYTHON") or sys.executable
        process, url = await launch_until_healthy(
            config.name, "SGLang",
            lambda port: sglang_command(config, port, python=python, sglang_version=sglang_version),
            port=_port_of(config.url, config.name) if config.url else None, log_file=config.launch.log_file,
            ready_timeout_s=config.launch.ready_timeout_s, on_spawn=on_spawn, client=client)
        server = cls(config.name, url, process)
        server.state = ServerState.READY
        return server

    async def wait_ready(self, client: httpx.AsyncClient, deadline_s: float) -> None:
        """Poll ``GET /health`` until 200, the process exits, or ``deadline_s`` passes (``LaunchError``)."""
        if self.process is None:
            raise LaunchError(self.name, "attached: colocd did not start this server")

        try:
            await wait_healthy(self.process, self.url, deadline_s, client)
        except LaunchError:
            if not self.process.running:
                self.state = ServerState.STOPPED
            raise
        self.state = ServerState.READY

    async def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``grace_s``; the exit code (None if attached).

        If this coroutine is cancelled while waiting, the group is killed before the cancel goes on,
        so no SGLang process outlives its owner.
        """
        try:
            return await self.process.stop(grace_s) if self.process is not None else None
        finally:
            self.state = ServerState.STOPPED

    def log_tail(self, nbytes: int = 4000) -> str:
        if self.process is None:
            return "(attached: no log)"
        return self.process.log_tail(nbytes)

    async def __aenter__(self) -> SGLangServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def launch_sglang(config: SGLangEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s server for the daemon; ready once ``/health`` answers 200. ``options.on_spawn``
    journals the process as soon as it exists; ``options.paused`` is not SGLang's (the daemon pauses it when
    it reconciles it)."""
    server = await SGLangServer.launch(config, on_spawn=(options or LaunchOptions()).on_spawn)
    assert server.process is not None
    return Launched(server.url, server.process)


def _port_of(url: str, name: str = "sglang") -> int:
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost"):
        raise LaunchError(name, f"a launched SGLang listens on 127.0.0.1; url {url!r} names another host")
    if parts.port is None:
        raise LaunchError(name, f"url {url!r} has no port")
    return parts.port
