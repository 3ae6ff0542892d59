"""Starts an SGLang server with the flags colocation needs, or attaches to a running one; no engine verbs.

``sglang_command`` is pure (config in, argv and environment out) so the flag rules are tested
without SGLang; ``SGLangServer`` says what "ready" is (``/health`` 200) and hands the process to
``engines/supervisor.py`` (own process group, log file, readiness under a deadline, SIGTERM then
SIGKILL to the whole group: SGLang's scheduler and detokenizer are children of the launcher).
"""

from __future__ import annotations

import contextlib
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
from ..supervisor import Launched, LaunchOptions, ManagedProcess, free_port
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
# PyTorch reads either name (PYTORCH_ALLOC_CONF is the newer spelling of the same setting).
_ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
# First release verified to have --weight-cache-mode (arg_groups/fields/model.py:377); 0.5.9 lacks it.
_WEIGHT_CACHE_FLAG_MIN = (0, 5, 23)


# The SGLang server could not be started, did not become ready, or was misconfigured: the one
# launch error of every launcher (engines/supervisor.py), under this module's historical name.
LaunchError = EngineLaunchError


def strip_expandable_segments(value: str) -> tuple[str, bool]:
    """``value`` of PYTORCH_CUDA_ALLOC_CONF without ``expandable_segments:True``; and whether it had it.

    torch_memory_saver refuses expandable segments, CUDA IPC of VMM memory needs ``pidfd_getfd``
    (denied in most containers), and vLLM's sleep frees nothing with them
    (research/engine-apis.md §3, §6.4 #12). ``expandable_segments:False`` entries are kept.
    """
    kept, removed = [], False
    for item in (part.strip() for part in value.split(",")):
        if not item:
            continue
        key, _, setting = item.partition(":")
        if key.strip() == "expandable_segments" and setting.strip().lower() in ("true", "1"):
            removed = True
            continue
        kept.append(item)
    return ",".join(kept), removed


def _flag_values(args: Sequence[str]) -> dict[str, str | None]:
    """``--flag value`` and ``--flag=value`` pairs of an argv tail (a bare flag maps to None)."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("--"):
            name, eq, value = arg.partition("=")
            if eq:
                out[name] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("--"):
                out[name] = args[i + 1]
                i += 1
            else:
                out[name] = None
        i += 1
    return out


def _visible_devices(config: SGLangEngineConfig) -> str | None:
    devices = config.gpu_uuids or [str(g) for g in config.gpus]
    if not devices:
        return None
    if len(devices) != config.tp_size:
        raise LaunchError(
            config.name, f"{len(devices)} GPUs configured "
            f"({'gpu_uuids' if config.gpu_uuids else 'gpus'}) "
            f"but tp_size={config.tp_size}; one GPU per TP rank"
        )
    return ",".join(devices)


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
    given = _flag_values(extra)
    for flag, setting in _OWNED_FLAGS.items():
        if flag in given:
            raise LaunchError(
                config.name, f"launch.args sets {flag}; colocd sets it from {setting}"
            )
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
    for key in _ALLOC_CONF_VARS:
        if key in env:
            cleaned, removed = strip_expandable_segments(env[key])
            if removed:
                logger.warning(
                    "engine %r: removed expandable_segments:True from %s (%r): it breaks torch_memory_saver "
                    "and CUDA IPC (research/engine-apis.md §6.4 #12)",
                    config.name,
                    key,
                    env[key],
                )
            if cleaned:
                env[key] = cleaned
            else:
                del env[key]

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

    visible = _visible_devices(config)
    if visible is not None:
        if (
            "CUDA_VISIBLE_DEVICES" in config.launch.env
            and config.launch.env["CUDA_VISIBLE_DEVICES"] != visible
        ):
            raise LaunchError(
                config.name, f"launch.env CUDA_VISIBLE_DEVICES="
                f"{config.launch.env['CUDA_VISIBLE_DEVICES']} "
                f"differs from the configured GPUs ({visible})"
            )
        env["CUDA_VISIBLE_DEVICES"] = visible
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
        client: httpx.AsyncClient,
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
        fixed_port = _port_of(config.url, config.name) if config.url else None
        for attempt in (1, 2):
            port = fixed_port or free_port()
            argv, env = sglang_command(config, port, python=python, sglang_version=sglang_version)
            server = await cls.start(
                config.name, argv, env, f"http://127.0.0.1:{port}", log_file=config.launch.log_file,
                on_spawn=on_spawn,
            )
            try:
                await server.wait_ready(client, config.launch.ready_timeout_s)
                return server
            except LaunchError:
                await server.stop()
                if attempt == 1 and fixed_port is None and server._log_mentions("Address already in use"):
                    logger.warning("engine %r: port %d was taken; retrying on another", config.name, port)
                    continue
                raise
            except BaseException:
                await server.stop()
                raise
        raise AssertionError("unreachable")

    async def wait_ready(self, client: httpx.AsyncClient, deadline_s: float) -> None:
        """Poll ``GET /health`` until 200, the process exits, or ``deadline_s`` passes (``LaunchError``)."""
        if self.process is None:
            raise LaunchError(self.name, "attached: colocd did not start this server")

        async def healthy() -> bool | None:
            # 503 while SGLang starts, refused before it binds: both mean "not yet".
            with contextlib.suppress(httpx.TransportError):
                response = await client.get(f"{self.url}/health", timeout=max(deadline_s, 1.0))
                if response.status_code == 200:
                    return True
            return None

        try:
            await self.process.wait_ready(healthy, deadline_s)
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

    def _log_mentions(self, text: str) -> bool:
        return self.process is not None and self.process.log_mentions(text)

    async def __aenter__(self) -> SGLangServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def launch_sglang(config: SGLangEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s server for the daemon; ready once ``/health`` answers 200. ``options.on_spawn``
    journals the process as soon as it exists; ``options.paused`` is not SGLang's (the daemon pauses it when
    it reconciles it)."""
    async with httpx.AsyncClient(trust_env=False) as client:
        server = await SGLangServer.launch(config, client, on_spawn=(options or LaunchOptions()).on_spawn)
    assert server.process is not None
    return Launched(server.url, server.process)


def _port_of(url: str, name: str = "sglang") -> int:
    parts = urlsplit(url)
    if parts.hostname not in ("127.0.0.1", "localhost"):
        raise LaunchError(name, f"a launched SGLang listens on 127.0.0.1; url {url!r} names another host")
    if parts.port is None:
        raise LaunchError(name, f"url {url!r} has no port")
    return parts.port
