"""Starting and stopping a reference engine server as a child process, with a readiness deadline.

    async with ReferenceEngineProcess(config) as proc:   # or: with ...: / proc.start() ... proc.stop()
        httpx.get(f"{proc.url}/model_info")

Readiness is the child's ready file (it binds its own port, so nothing is guessed) and then
``/health`` 200, polled inside ``launch.ready_timeout_s``; a child that exits meanwhile fails the
start at once with the tail of its log. Stopping sends SIGTERM, then SIGKILL after a grace period.
This module imports neither torch nor the server, so the daemon can use it cheaply.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Any, BinaryIO
from urllib.parse import urlsplit

import httpx

from ..config import ReferenceEngineConfig
from ..errors import EngineError
from ..logtail import read_tail

__all__ = ["EngineLaunchError", "ReferenceEngineProcess"]

_POLL_S = 0.05  # readiness poll interval; every wait also wakes the moment the child exits
_LOG_TAIL_BYTES = 4000
_DEFAULT_READY_TIMEOUT_S = 120.0


class EngineLaunchError(EngineError):
    """The engine process died or did not become healthy in time; the message carries its log tail."""


class ReferenceEngineProcess:
    """One reference engine server process, started from a ``ReferenceEngineConfig``."""

    def __init__(
        self,
        config: ReferenceEngineConfig,
        *,
        log_path: str | os.PathLike[str] | None = None,
        grace_s: float = 10.0,
        ready_path: str = "/health",
    ) -> None:
        if config.device.startswith("cuda:") and config.tp_size > 1:
            raise ValueError(
                f"engine {config.name!r}: device {config.device!r} names one GPU but tp_size is "
                f"{config.tp_size}; use device 'cuda' with one GPU per TP rank in gpus or gpu_uuids"
            )
        self.config = config
        self.grace_s = grace_s
        # "/health" (a generation answers) by default; "/model_info" when something else (a colocd
        # daemon that sees a restarted engine) may pause it before its first generation.
        self.ready_path = ready_path
        launch_log = config.launch.log_file if config.launch else None
        chosen = log_path if log_path is not None else launch_log
        self._log_path: Path | None = Path(chosen) if chosen is not None else None
        self._workdir: str | None = None
        self._aproc: asyncio.subprocess.Process | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self.url: str | None = None
        self.pid: int | None = None

    # --- public surface --------------------------------------------------------------------------

    @property
    def log_path(self) -> Path | None:
        return self._log_path

    @property
    def ready_timeout_s(self) -> float:
        return self.config.launch.ready_timeout_s if self.config.launch else _DEFAULT_READY_TIMEOUT_S

    @property
    def returncode(self) -> int | None:
        if self._aproc is not None:
            return self._aproc.returncode
        return self._proc.poll() if self._proc is not None else None

    async def __aenter__(self) -> ReferenceEngineProcess:
        await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __enter__(self) -> ReferenceEngineProcess:
        self.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def command(self, ready_file: str) -> list[str]:
        """The child's command line (the API key travels in the environment, not in argv)."""
        host, port = self._host_port()
        cmd = [
            sys.executable,
            "-m",
            "colocd.engines.reference",
            "--host",
            host,
            "--port",
            str(port),
            "--device",
            self.config.device,
            "--seed",
            str(self.config.seed),
            "--protocol",
            self.config.protocol,
            "--ready-file",
            ready_file,
            "--model-json",
            json.dumps(self.config.model),
            "--tp-size",
            str(self.config.tp_size),
        ]
        if self.config.device_ids:
            cmd += ["--device-ids", ",".join(self.config.device_ids)]
        if self.config.launch:
            cmd += self.config.launch.args
        return cmd

    # --- async -----------------------------------------------------------------------------------

    async def astart(self) -> None:
        """Start the child and return once ``/health`` is 200; raises ``EngineLaunchError`` otherwise."""
        ready_file = self._prepare()
        with self._open_log() as log:
            self._aproc = await asyncio.create_subprocess_exec(
                *self.command(ready_file),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,
            )
        self.pid = self._aproc.pid
        exited = asyncio.ensure_future(self._aproc.wait())
        try:
            async with asyncio.timeout(self.ready_timeout_s):
                self.url = await self._await_ready_file(ready_file, exited)
                await self._await_health(exited)
        except TimeoutError:
            await self.aclose()
            raise self._failure(f"did not become healthy within {self.ready_timeout_s:g}s") from None
        except BaseException:
            await self.aclose()
            raise
        finally:
            if not exited.done():
                exited.cancel()

    async def aclose(self) -> None:
        """SIGTERM, wait ``grace_s``, then SIGKILL; idempotent."""
        proc = self._aproc
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), self.grace_s)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()
        self._cleanup()

    async def _await_ready_file(self, path: str, exited: asyncio.Future[int]) -> str:
        while True:
            url = self._read_ready_file(path)
            if url is not None:
                return url
            await self._pause_or_die(exited)

    async def _await_health(self, exited: asyncio.Future[int]) -> None:
        headers = self._headers()
        async with httpx.AsyncClient(timeout=5.0, headers=headers) as client:
            while True:
                with contextlib.suppress(httpx.TransportError):
                    if (await client.get(f"{self.url}{self.ready_path}")).status_code == 200:
                        return
                await self._pause_or_die(exited)

    async def _pause_or_die(self, exited: asyncio.Future[int]) -> None:
        await asyncio.wait({exited}, timeout=_POLL_S)
        if exited.done():
            raise self._failure(f"exited with code {exited.result()} before becoming ready")

    # --- sync ------------------------------------------------------------------------------------

    def start(self) -> None:
        """Blocking twin of ``astart`` for synchronous callers (tests, scripts)."""
        ready_file = self._prepare()
        with self._open_log() as log:
            self._proc = subprocess.Popen(
                self.command(ready_file),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self._environment(),
                start_new_session=True,
            )
        self.pid = self._proc.pid
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while (url := self._read_ready_file(ready_file)) is None:
                self._wait_or_die(deadline)
            self.url = url
            with httpx.Client(timeout=5.0, headers=self._headers()) as client:
                while True:
                    with contextlib.suppress(httpx.TransportError):
                        if client.get(f"{self.url}/health").status_code == 200:
                            return
                    self._wait_or_die(deadline)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._cleanup()

    def _wait_or_die(self, deadline: float) -> None:
        assert self._proc is not None
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise self._failure(f"did not become healthy within {self.ready_timeout_s:g}s")
        with contextlib.suppress(subprocess.TimeoutExpired):
            code = self._proc.wait(min(_POLL_S, remaining))
            raise self._failure(f"exited with code {code} before becoming ready")

    # --- helpers ---------------------------------------------------------------------------------

    def _prepare(self) -> str:
        if self._aproc is not None or self._proc is not None:
            raise RuntimeError(f"engine {self.config.name!r}: this launcher has already been started")
        self._workdir = tempfile.mkdtemp(prefix=f"colocd-ref-{self.config.name}-")
        return os.path.join(self._workdir, "ready.json")

    def _open_log(self) -> BinaryIO:
        """The child's stdout/stderr; a private temp file unless a path was given. Kept after stop."""
        if self._log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"colocd-ref-{self.config.name}-", suffix=".log")
            self._log_path = Path(path)
            return os.fdopen(fd, "ab")
        return open(self._log_path, "ab")

    def _host_port(self) -> tuple[str, int]:
        if not self.config.url:
            return "127.0.0.1", 0
        parts = urlsplit(self.config.url)
        return parts.hostname or "127.0.0.1", parts.port or 0

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

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key else {}

    @staticmethod
    def _read_ready_file(path: str) -> str | None:
        try:
            with open(path) as f:
                data: dict[str, Any] = json.load(f)
        except FileNotFoundError:
            return None
        return str(data["url"])

    def _failure(self, what: str) -> EngineLaunchError:
        return EngineLaunchError(
            self.config.name,
            f"reference engine (pid {self.pid}) {what}; log {self._log_path}:\n{self._log_tail()}",
        )

    def _log_tail(self) -> str:
        if self._log_path is None:
            return ""
        return read_tail(self._log_path, _LOG_TAIL_BYTES)

    def _cleanup(self) -> None:
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
            self._workdir = None
