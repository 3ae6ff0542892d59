"""Starting and stopping a reference engine server as a child process, with a readiness deadline.

This module builds the command line and says what "ready" means (the child's ready file, then ``/health`` or, for a
``drivable`` engine, ``/server_info``, inside ``launch.ready_timeout_s``); the process is ``engines/processes.py``'s.
It imports neither torch nor the server, so the daemon can use it cheaply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import urlsplit

import httpx

from ...errors import EngineLaunchError
from ..config import ReferenceEngineConfig
from ..processes import Launched, LaunchOptions, ManagedProcess, read_ready_file

__all__ = ["EngineLaunchError", "ReferenceEngineProcess", "launch_reference"]

_DEFAULT_READY_TIMEOUT_S = 120.0


class ReferenceEngineProcess:
    """One reference engine server process, started from a ``ReferenceEngineConfig``."""

    def __init__(self, config: ReferenceEngineConfig, *, log_path: str | os.PathLike[str] | None = None,
                 grace_s: float = 10.0, drivable: bool = False,
                 options: LaunchOptions | None = None) -> None:
        if config.device.startswith("cuda:") and config.tp_size > 1:
            raise ValueError(f"engine {config.name!r}: device {config.device!r} names one GPU but tp_size is "
                             f"{config.tp_size}; use device 'cuda' with one GPU per TP rank in gpus or gpu_uuids")
        self.config, self.grace_s, self.options = config, grace_s, options or LaunchOptions()
        # Ready once /health's generation answers; ``drivable``: once it can be driven (its model built, so a pause
        # is accepted), for a daemon that may pause it before its first generation.
        self.drivable = drivable
        self._log_file = log_path if log_path is not None else config.launch.log_file if config.launch else None
        self.ready_timeout_s = config.launch.ready_timeout_s if config.launch else _DEFAULT_READY_TIMEOUT_S
        self._workdir: str | None = None
        self.process: ManagedProcess | None = None
        self.url: str | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process is not None else None

    async def __aenter__(self) -> ReferenceEngineProcess:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def command(self, ready_file: str) -> list[str]:
        """The child's command line, under the ``COLOCD_REFERENCE_PYTHON`` of its environment (``launch.env``, else
        this process's), else this interpreter. The API key travels in the environment, not in argv."""
        c, url = self.config, urlsplit(self.config.url or "")
        python = self._environment().get("COLOCD_REFERENCE_PYTHON") or sys.executable
        cmd = [python, "-m", "colocd.engines.reference", "--host", url.hostname or "127.0.0.1",
               "--port", str(url.port or 0), "--device", c.device, "--seed", str(c.seed), "--protocol", c.protocol,
               "--ready-file", ready_file, "--model-json", json.dumps(c.model), "--tp-size", str(c.tp_size)]
        return cmd + (c.launch.args if c.launch else [])

    async def astart(self) -> None:
        """Start the child and return once it is ready; raises ``EngineLaunchError`` otherwise."""
        proc, ready_file = self._spawn()
        try:

            async def listening() -> str | None:
                return read_ready_file(ready_file)

            self.url = await proc.wait_ready(listening, self.ready_timeout_s)
            self._cleanup()  # the ready file has been read
            info = "/get_server_info" if self.config.protocol == "legacy" else "/server_info"
            probe = info if self.drivable else "/health"
            headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}
            async with httpx.AsyncClient(timeout=5.0, headers=headers, trust_env=False) as client:

                async def ready() -> bool | None:
                    with contextlib.suppress(httpx.TransportError, ValueError, KeyError, IndexError):
                        if (r := await client.get(f"{self.url}{probe}")).status_code != 200:
                            return None
                        if not self.drivable or r.json()["internal_states"][0]["engine_state"] == "running":
                            return True
                    return None

                assert proc.started_at is not None  # what is left of the one readiness deadline
                await proc.wait_ready(ready, max(0.001, self.ready_timeout_s - (time.monotonic() - proc.started_at)))
        except BaseException:
            await self.aclose()
            raise

    async def aclose(self) -> None:
        """SIGTERM, wait ``grace_s``, then SIGKILL; idempotent."""
        if self.process is not None:
            await self.process.stop(self.grace_s)
        self._cleanup()

    def start(self) -> None:
        """Blocking twin of ``astart`` for synchronous callers (tests, scripts), on a loop of its own."""
        with ThreadPoolExecutor(1, thread_name_prefix="colocd-ref-start") as pool:
            pool.submit(asyncio.run, self.astart()).result()

    def stop(self) -> None:
        if self.process is not None:
            self.process.stop_sync(self.grace_s)
        self._cleanup()

    def _spawn(self) -> tuple[ManagedProcess, str]:
        if self.process is not None:
            raise RuntimeError(f"engine {self.config.name!r}: this launcher has already been started")
        self._workdir = tempfile.mkdtemp(prefix=f"colocd-ref-{self.config.name}-")
        ready_file = os.path.join(self._workdir, "ready.json")
        self.process = ManagedProcess(self.config.name, self.command(ready_file), self._environment(),
                                      label="reference engine", log_file=self._log_file, on_spawn=self.options.on_spawn)
        try:
            self.process.spawn()
        except BaseException:
            self._cleanup()
            raise
        return self.process, ready_file

    def _environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        devices = self.config.gpu_uuids or [str(g) for g in self.config.gpus]
        # Only a bare "cuda" is pinned through the environment: an explicit "cuda:N" already names a
        # host device, and renumbering the visible set under it would point it elsewhere.
        if devices and self.config.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if self.config.api_key:
            env["COLOCD_REFERENCE_API_KEY"] = self.config.api_key
        if self.config.launch:
            env.update(self.config.launch.env)
        return env

    def _cleanup(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None


async def launch_reference(config: ReferenceEngineConfig, options: LaunchOptions | None = None) -> Launched:
    """Start ``config``'s engine for the daemon, ready once it can be driven (its model built: it accepts a pause);
    not by ``/health``, which runs a generation. The process belongs to the caller."""
    engine = ReferenceEngineProcess(config, drivable=True, options=options)
    await engine.astart()
    assert engine.process is not None and engine.url is not None
    return Launched(engine.url, engine.process)
