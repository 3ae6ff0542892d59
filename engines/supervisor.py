"""One supervisor for every child process colocd starts: engines (reference, SGLang, vLLM) and daemons.

    proc = ManagedProcess("ref0", argv, env, label="reference engine")
    proc.spawn()                                            # own process group, output to a log file
    url = await proc.wait_ready(lambda: read_ready_file(path), deadline_s=60)
    code = await proc.stop(grace_s=10)                      # SIGTERM the group, then SIGKILL

A launcher (``engines/<kind>/launcher.py``, ``api/procs.py``) only builds the command line and
says what "ready" means; starting, readiness under a deadline, exit detection, log capture and
stopping live here, once. Children run with ``start_new_session=True``: each is the leader of its
own process group (pgid == pid), so a stop reaches the engine's own children (SGLang's scheduler
and detokenizer, vLLM's engine core) and nothing else. The process is a ``subprocess.Popen``, so
the same object serves asyncio callers (the daemon) and blocking ones (test fixtures, scripts);
an async wait for exit uses a pidfd on the event loop, not a thread.

A tethered child (``tether=True``, or by default when this process's environment has
``COLOCD_TETHER=1``) is killed by the kernel when this process dies, however it dies
(``engines/tether.py``). Its own process group does not help there: a SIGKILLed supervisor
signals nobody, so under the cluster actor every level (actor → daemon → engine) is tethered.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from ..errors import EngineLaunchError
from .logtail import read_tail
from .shm_files import GroupShmFiles
from .tether import TETHER_ENV, tether_prefix

__all__ = [
    "LaunchOptions",
    "Launched",
    "ManagedProcess",
    "free_port",
    "group_alive",
    "read_ready_file",
    "signal_group",
    "wait_pidfd",
]

log = logging.getLogger("colocd.supervisor")
T = TypeVar("T")

POLL_S = 0.05  # readiness and group-exit poll interval; every wait is bounded by a deadline
_LOG_TAIL_BYTES = 4000
_GROUP_GONE_S = 10.0  # after SIGKILL: how long the group's members may take to be reaped
_REDACTED_FLAGS = ("--api-key",)


async def wait_pidfd(pidfd: int) -> None:
    """Return once the process behind ``pidfd`` has exited (the descriptor turns readable); the caller closes it."""
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)


class Launched(NamedTuple):
    """A started, ready engine: where it answers and the process to watch and stop."""

    url: str
    process: ManagedProcess


class LaunchOptions(NamedTuple):
    """How the daemon wants an engine started.

    ``on_spawn``: told the process as soon as it exists, before it is ready (the daemon journals it).
    """

    on_spawn: Callable[[ManagedProcess], None] | None = None


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on right now (racy by nature: launchers retry once on EADDRINUSE)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal one process group; a group already gone (or never ours) is not an error."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def group_alive(pgid: int) -> bool:
    """True while any process of the group exists (a zombie member counts until it is reaped)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def read_ready_file(path: str | os.PathLike[str]) -> str | None:
    """The ``url`` a child announced in its ready file (written atomically), or None while absent."""
    try:
        with open(path) as f:
            data: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return None
    return str(data["url"])


def _shown(argv: Sequence[str]) -> str:
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg in _REDACTED_FLAGS:
            shown[i + 1] = "***"
    return shlex.join(shown)


class ManagedProcess:
    """One child process in its own process group, its output appended to a log file.

    ``label`` names what it is in messages ("reference engine", "SGLang", "colocd daemon");
    ``failure`` turns a one-line reason into the exception to raise (default ``EngineLaunchError``
    with the log tail), so a non-engine child can raise its own kind. ``header`` writes the
    (redacted) command line into the log before the child's output. ``tether``: the child dies
    with this process (None: when this process's environment has ``COLOCD_TETHER=1``).
    ``on_spawn`` is called with the process right after it started.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        *,
        label: str = "engine",
        log_file: str | os.PathLike[str] | None = None,
        failure: Callable[[ManagedProcess, str], BaseException] | None = None,
        header: bool = True,
        tether: bool | None = None,
        on_spawn: Callable[[ManagedProcess], None] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.env = dict(env)
        self.label = label
        self.log_path: Path | None = Path(log_file) if log_file is not None else None
        self._failure = failure or _engine_failure
        self._header = header  # the "# colocd: <command>" line; off where the log must stay one format
        self.tethered = os.environ.get(TETHER_ENV) == "1" if tether is None else tether
        self._popen: subprocess.Popen[bytes] | None = None
        self._on_spawn = on_spawn
        self.started_at: float | None = None  # time.monotonic() of spawn
        self.shm: GroupShmFiles | None = None  # what the group maps in /dev/shm; reclaimed when it is stopped

    # --- facts -----------------------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen is not None else None

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited (negative: killed by that signal); reaps a zombie."""
        return self._popen.poll() if self._popen is not None else None

    @property
    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        return read_tail(self.log_path, nbytes) if self.log_path is not None else ""

    def log_mentions(self, text: str) -> bool:
        return text in self.log_tail(64_000)

    def failure(self, what: str) -> BaseException:
        """The exception for ``what`` went wrong, built by this process's ``failure`` factory."""
        return self._failure(self, what)

    # --- start -----------------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the child in a new session (its own process group), output appended to the log.

        The log is created 0600 (the command line may carry secrets; the logged one is redacted).
        """
        if self._popen is not None:
            raise RuntimeError(f"{self.label} {self.name!r}: this process has already been started")
        if self.log_path is None:
            fd, path = tempfile.mkstemp(prefix=f"colocd-{self.name}-", suffix=".log")
            self.log_path = Path(path)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            if self._header:
                os.write(fd, f"\n# colocd: {_shown(self.argv)}\n".encode())
            try:
                # The tether execs the command: same pid, same process group, so nothing else changes.
                argv = tether_prefix() + self.argv if self.tethered else self.argv
                self._popen = subprocess.Popen(
                    argv, env=self.env, stdin=subprocess.DEVNULL, stdout=fd, stderr=subprocess.STDOUT,
                    start_new_session=True,
                )  # fmt: skip
            except OSError as exc:
                raise self.failure(f"could not be started: {exc}") from exc
        finally:
            os.close(fd)  # the child holds its own copy
        self.started_at = time.monotonic()
        self.shm = GroupShmFiles(self._popen.pid)
        fields = {"event": "process_started", "engine": self.name if "engine" in self.label else None,
                  "session": None, "pid": self._popen.pid, "log": str(self.log_path) if self.log_path else None}
        log.info("%s %s: started pid %d, logs in %s", self.label, self.name, self._popen.pid, self.log_path,
                 extra={"colocd": fields})  # the JSON log's fields (api/logs.py)
        if self._on_spawn is not None:
            try:
                self._on_spawn(self)
            except Exception:  # the hook records the process; it must not orphan it
                log.exception("%s %r: on_spawn hook failed", self.label, self.name)

    # --- wait ------------------------------------------------------------------------------------

    async def wait_exit(self) -> int:
        """Return the exit status once the child exits (and is reaped)."""
        proc = self._require()
        if (code := proc.poll()) is not None:
            return code
        try:
            pidfd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):  # no pidfd (old kernel): poll instead
            while proc.poll() is None:  # noqa: ASYNC110 - no exit event to await without a pidfd
                await asyncio.sleep(POLL_S)
            return int(proc.returncode)
        try:
            await wait_pidfd(pidfd)
        finally:
            os.close(pidfd)
        return proc.wait()  # readable pidfd: it has exited, so this reaps without blocking

    async def wait_ready(
        self, probe: Callable[[], Awaitable[T | None]], deadline_s: float, *, setting: str = "launch.ready_timeout_s"
    ) -> T:
        """Poll ``probe`` until it returns a value, the child exits, or ``deadline_s`` passes.

        An exit or the deadline raises this process's failure (the deadline's message names
        ``setting``); the child is left running on a deadline: the caller decides to stop it.
        """
        self._require()
        exited = asyncio.ensure_future(self.wait_exit())
        try:
            async with asyncio.timeout(deadline_s):
                while True:
                    if (value := await probe()) is not None:
                        await asyncio.to_thread(self.note_shm)  # what it made starting up, should it crash
                        return value
                    await asyncio.wait({exited}, timeout=POLL_S)  # wakes at once if the child exits
                    if exited.done():
                        raise self.failure(f"exited with code {exited.result()} before it was ready")
        except TimeoutError:
            raise self.failure(f"was not ready within {deadline_s:g}s ({setting})") from None
        finally:
            exited.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await exited

    def wait_ready_sync(
        self, probe: Callable[[], T | None], deadline_s: float, *, setting: str = "launch.ready_timeout_s"
    ) -> T:
        """Blocking twin of ``wait_ready`` for synchronous callers."""
        proc = self._require()
        deadline = time.monotonic() + deadline_s
        while True:
            if (value := probe()) is not None:
                self.note_shm()  # what it made starting up, should it crash
                return value
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self.failure(f"was not ready within {deadline_s:g}s ({setting})")
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = proc.wait(min(POLL_S, remaining))
                raise self.failure(f"exited with code {code} before it was ready")

    # --- stop ------------------------------------------------------------------------------------

    def note_shm(self) -> None:
        """Note the ``/dev/shm`` files the group maps or holds open now (``engines/shm_files.py``): its owner calls
        this while it runs, so what a crash leaves is known; ``stop`` calls it before it signals."""
        if self.shm is not None:
            self.shm.note()

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL it after ``grace_s``; the exit status (None if never started).

        Returns only once the leader is reaped and the group is gone, so a successor never
        overlaps it, and the ``/dev/shm`` files the group left are unlinked (``note_shm``). Idempotent.
        If cancelled meanwhile, the group is killed before the cancel goes on: no child outlives its owner.
        """
        proc = self._popen
        if proc is None:
            return None
        try:
            await asyncio.to_thread(self.note_shm)
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
                try:
                    async with asyncio.timeout(grace_s):
                        await self.wait_exit()
                except TimeoutError:
                    log.warning("%s %r ignored SIGTERM for %gs; killing it", self.label, self.name, grace_s)
            # The leader may be gone while its children linger; pgid == pid stays reserved while they do.
            signal_group(proc.pid, signal.SIGKILL)
            await self.wait_exit()
            async with asyncio.timeout(_GROUP_GONE_S):
                while group_alive(proc.pid):  # noqa: ASYNC110 - the kernel offers no event for a group
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            log.warning("%s %r: process group %d still has members after SIGKILL", self.label, self.name, proc.pid)
        except BaseException:
            signal_group(proc.pid, signal.SIGKILL)
            raise
        if self.shm is not None:
            await asyncio.to_thread(self.shm.reclaim)
        return proc.returncode

    def stop_sync(self, grace_s: float = 10.0) -> int | None:
        """Blocking twin of ``stop``."""
        proc = self._popen
        if proc is None:
            return None
        try:
            self.note_shm()
            if proc.poll() is None:
                signal_group(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(grace_s)
            signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
            deadline = time.monotonic() + _GROUP_GONE_S
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(POLL_S)  # SIGKILL is sent; waiting for the kernel to reap the group
        except BaseException:
            signal_group(proc.pid, signal.SIGKILL)
            raise
        if self.shm is not None:
            self.shm.reclaim()
        return proc.returncode

    def _require(self) -> subprocess.Popen[bytes]:
        if self._popen is None:
            raise RuntimeError(f"{self.label} {self.name!r}: not started")
        return self._popen


def _engine_failure(proc: ManagedProcess, what: str) -> EngineLaunchError:
    return EngineLaunchError(
        proc.name, f"{proc.label} (pid {proc.pid}) {what}", log_path=proc.log_path, tail=proc.log_tail()
    )
