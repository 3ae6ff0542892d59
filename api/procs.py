"""Start colocd's own daemon as a child process and wait for it: used by the demo, benchmarks and tests."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ..engines.logtail import read_tail

__all__ = ["DaemonProcess"]


class DaemonProcess:
    """``async with DaemonProcess(config_dict) as d: d.url`` — a real ``colocd serve`` process."""

    def __init__(self, config: dict[str, Any], *, workdir: str | None = None, ready_timeout_s: float = 60.0,
                 log_level: str = "warning") -> None:
        self._config = dict(config)
        self._dir = Path(workdir or tempfile.mkdtemp(prefix="colocd-daemon-"))
        self._ready_timeout_s = ready_timeout_s
        self._log_level = log_level
        self.url: str = ""
        self.pid: int | None = None  # the daemon's process id, once ready
        self.log_path = self._dir / "daemon.log"
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> DaemonProcess:
        ready = self._dir / "daemon.ready.json"
        ready.unlink(missing_ok=True)
        listen = {"host": "127.0.0.1", "port": 0, **self._config.get("listen", {}), "ready_file": str(ready)}
        config_path = self._dir / "colocd.yaml"
        config_path.write_text(yaml.safe_dump({**self._config, "listen": listen}))
        log = open(self.log_path, "wb")  # noqa: ASYNC230 - a local file handed to the child; closed in stop()
        self._log = log
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "colocd.api.cli", "serve", "--config", str(config_path),
            "--log-level", self._log_level, stdout=log, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            async with asyncio.timeout(self._ready_timeout_s):
                while not ready.exists():
                    if self._proc.returncode is not None:
                        raise RuntimeError(f"colocd daemon exited with {self._proc.returncode}: {self.log_tail()}")
                    await asyncio.sleep(0.02)  # polling for the ready file the child writes once listening
        except TimeoutError:
            await self.stop()
            raise RuntimeError(f"colocd daemon not ready within {self._ready_timeout_s}s: {self.log_tail()}") from None
        announced = json.loads(ready.read_text())
        self.url, self.pid = announced["url"], int(announced["pid"])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def log_tail(self, n: int = 4000) -> str:
        return read_tail(self.log_path, n)

    async def stop(self, grace_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s):
                await proc.wait()
        except TimeoutError:
            proc.kill()
            await proc.wait()
        self._log.close()
