"""Start colocd's own daemon as a child process (``engines/processes.py``'s, as every engine) and wait for the
ready file it writes once it listens: for the demo, the Ray node actor, benchmarks and tests. ``tether=True`` ties
the daemon to this process and its engines to it (``engines/tether.py``): a SIGKILL up the chain leaves nothing."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import yaml

from ..engines.processes import ManagedProcess, read_tail
from ..engines.tether import TETHER_ENV

__all__ = ["DaemonProcess"]


class DaemonProcess:
    """``async with DaemonProcess(config_dict) as d: d.url`` — a real ``colocd serve`` process."""

    def __init__(self, config: dict[str, Any], *, workdir: str | None = None, ready_timeout_s: float = 60.0,
                 log_level: str = "warning", tether: bool = False) -> None:
        self._config = dict(config)
        self._dir = Path(workdir or tempfile.mkdtemp(prefix="colocd-daemon-"))
        self._ready_timeout_s = ready_timeout_s
        self._log_level = log_level
        self._tether = tether
        self.url: str = ""
        self.pid: int | None = None  # the daemon's process id, once ready
        self.log_path = self._dir / "daemon.log"
        self.process: ManagedProcess | None = None

    async def __aenter__(self) -> DaemonProcess:
        ready = self._dir / "daemon.ready.json"
        ready.unlink(missing_ok=True)
        listen = {"host": "127.0.0.1", "port": 0, **self._config.get("listen", {}), "ready_file": str(ready)}
        config_path = self._dir / "colocd.yaml"
        config_path.write_text(yaml.safe_dump({**self._config, "listen": listen}))
        self.process = ManagedProcess(
            "colocd", [sys.executable, "-m", "colocd.cli", "serve", "--config", str(config_path),
                       "--log-level", self._log_level],
            {**os.environ, "PYTHONUNBUFFERED": "1", **({TETHER_ENV: "1"} if self._tether else {})},
            label="colocd daemon", log_file=self.log_path, tether=self._tether,
            header=False,  # the daemon's log is its own format (JSON lines with log_format: json)
            failure=lambda proc, what: RuntimeError(f"colocd daemon {what}: {self.log_tail()}"))
        self.log_path.write_bytes(b"")  # this run's log only, as the ready file is this run's
        self.process.spawn()

        async def announced() -> dict[str, Any] | None:
            return json.loads(ready.read_text()) if ready.exists() else None  # written atomically

        try:
            found = await self.process.wait_ready(announced, self._ready_timeout_s, setting="ready_timeout_s")
        except BaseException:
            await self.stop()
            raise
        self.url, self.pid = found["url"], int(found["pid"])
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def log_tail(self, n: int = 4000) -> str:
        return read_tail(self.log_path, n)

    async def stop(self, grace_s: float = 10.0) -> None:
        if self.process is not None:
            await self.process.stop(grace_s)
