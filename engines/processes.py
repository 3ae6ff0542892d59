"""Every child process colocd starts (engines and daemons): spawn, ready, stop, and adopt one a previous daemon left.

    proc = ManagedProcess("ref0", argv, env, label="reference engine")
    proc.spawn()                                            # own process group, output to a log file
    url = await proc.wait_ready(lambda: read_ready_file(path), deadline_s=60)
    code = await proc.stop(grace_s=10)                      # SIGTERM the group, then SIGKILL

A launcher (``engines/<kind>/launcher.py``, ``api/procs.py``) only builds the command line and says what "ready"
means. Each child leads its own process group (``start_new_session``), so a stop reaches the engine's own children
and nothing else; an async wait for exit uses a pidfd. A tethered child (``engines/tether.py``) is killed by the
kernel when this process dies, however it dies.

Adoption: a ``LaunchRecord`` (in the daemon's journal) names a process by pid and the kernel's start time of that
pid (a reused pid has another), with its URL, group and log. A restarted daemon adopts a recorded engine that is
alive and answers on its URL (``AdoptedProcess``), and stops one that is alive but does not answer.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar
from urllib.parse import urlsplit

import httpx

from ..errors import EngineLaunchError
from .shm_files import GroupShmFiles
from .tether import TETHER_ENV, tether_prefix

__all__ = ["AdoptedProcess", "LaunchOptions", "LaunchRecord", "Launched", "ManagedProcess", "flag_values", "free_port",
           "gpu_environment", "group_alive", "launch_until_healthy", "process_start_time", "read_ready_file",
           "read_tail", "signal_group", "stop_group", "strip_expandable_segments"]

log = logging.getLogger("colocd.supervisor")
T = TypeVar("T")

POLL_S = 0.05  # readiness and group-exit poll interval; every wait is bounded by a deadline
_LOG_TAIL_BYTES = 4000
_GROUP_GONE_S = 10.0  # after SIGKILL: how long the group's members may take to be reaped
_REDACTED_FLAGS = ("--api-key",)


async def _await_exit(pid: int, alive: Callable[[], bool]) -> None:
    """Return once ``pid`` has exited (``alive`` false): its pidfd turns readable, or polled where there is none."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except (AttributeError, OSError):  # no pidfd (old kernel): poll instead
        while alive():  # noqa: ASYNC110 - no exit event to await without a pidfd
            await asyncio.sleep(POLL_S)
        return
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def on_exit() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, on_exit)
    try:
        if alive():  # else gone already, or the pid was reused before the pidfd pinned it
            await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)


class Launched(NamedTuple):
    """A started, ready engine: where it answers and the process to watch and stop."""

    url: str
    process: ManagedProcess


class LaunchOptions(NamedTuple):
    """How the daemon wants an engine started: ``on_spawn`` is told the process as soon as it exists (journalled)."""

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


def read_tail(path: str | os.PathLike[str], nbytes: int) -> str:
    """The last ``nbytes`` of the file, decoded leniently; a note instead of an error if unreadable."""
    try:
        with open(Path(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - nbytes))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"


def _shown(argv: Sequence[str]) -> str:
    shown = list(argv)
    for i, arg in enumerate(shown[:-1]):
        if arg in _REDACTED_FLAGS:
            shown[i + 1] = "***"
    return shlex.join(shown)


class ManagedProcess:
    """One child process in its own process group, its output appended to a log file. ``failure`` turns a one-line
    reason into the exception to raise (default ``EngineLaunchError`` with the log tail); ``header`` writes the
    (redacted) command line into the log first; ``tether`` None: tethered when this process's environment has
    ``COLOCD_TETHER=1``; ``on_spawn`` is called right after the start."""

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

    def failure(self, what: str) -> BaseException:
        """The exception for ``what`` went wrong, built by this process's ``failure`` factory."""
        return self._failure(self, what)

    # --- start -----------------------------------------------------------------------------------

    def spawn(self) -> None:
        """Start the child in its own process group, output appended to the log (created 0600)."""
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
        await _await_exit(proc.pid, lambda: proc.poll() is None)
        return proc.wait()  # it has exited, so this reaps without blocking

    async def wait_ready(
        self, probe: Callable[[], Awaitable[T | None]], deadline_s: float, *, setting: str = "launch.ready_timeout_s"
    ) -> T:
        """Poll ``probe`` until it returns a value; an exit or ``deadline_s`` raises this process's failure (naming
        ``setting``), leaving the child running on a deadline."""
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

    # --- stop ------------------------------------------------------------------------------------

    def note_shm(self) -> None:
        """Note the ``/dev/shm`` files the group maps or holds open now (``engines/shm_files.py``)."""
        if self.shm is not None:
            self.shm.note()

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM the group, SIGKILL it after ``grace_s``; the exit status (None if never started). Returns once the
        group is gone and the ``/dev/shm`` files it left are unlinked; idempotent (``stop_group``)."""
        proc = self._popen
        if proc is None:
            return None
        await asyncio.to_thread(self.note_shm)
        await stop_group(proc.pid, grace_s, self.wait_exit if proc.poll() is None else None, label=self._what)
        if self.shm is not None:
            await asyncio.to_thread(self.shm.reclaim)
        return proc.returncode

    def stop_sync(self, grace_s: float = 10.0) -> int | None:
        """Blocking twin of ``stop``, on an event loop of its own in a thread (a blocking caller may be in a loop)."""
        with ThreadPoolExecutor(1, thread_name_prefix="colocd-blocking") as pool:
            return pool.submit(asyncio.run, self.stop(grace_s)).result()

    @property
    def _what(self) -> str:
        return f"{self.label} {self.name!r}"

    def _require(self) -> subprocess.Popen[bytes]:
        if self._popen is None:
            raise RuntimeError(f"{self.label} {self.name!r}: not started")
        return self._popen


# --- what the HTTP engine launchers (SGLang, vLLM) share ------------------------------------------------------


def flag_values(name: str, args: Sequence[str], owned: Mapping[str, str]) -> dict[str, str | None]:
    """``--flag value`` and ``--flag=value`` pairs of ``launch.args`` (a bare flag maps to None); a flag colocd
    sets itself (``owned``: flag → the setting it comes from) is an ``EngineLaunchError`` naming both."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg.startswith("-"):
            flag, eq, value = arg.partition("=")
            if eq:
                out[flag] = value
            elif i + 1 < len(args) and not args[i + 1].startswith("-"):
                out[flag] = args[i + 1]
                i += 1
            else:
                out[flag] = None
            if flag in owned:
                raise EngineLaunchError(name, f"launch.args sets {flag}; colocd sets it from {owned[flag]}")
        i += 1
    return out


def strip_expandable_segments(value: str) -> tuple[str, bool]:
    """``value`` of PYTORCH_CUDA_ALLOC_CONF without ``expandable_segments:True``, and whether it had it:
    torch_memory_saver refuses them, CUDA IPC of VMM memory needs ``pidfd_getfd``, and vLLM's sleep frees nothing."""
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


def gpu_environment(name: str, env: dict[str, str], launch_env: Mapping[str, str], devices: Sequence[str],
                    tp_size: int) -> dict[str, str]:
    """``env`` without expandable segments and with ``CUDA_VISIBLE_DEVICES`` pinned to ``devices`` (one per TP
    rank, not contradicted by ``launch.env``)."""
    for key in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        if key in env:
            cleaned, removed = strip_expandable_segments(env[key])
            if removed:
                log.warning("engine %r: removed expandable_segments:True from %s (%r): it breaks "
                            "torch_memory_saver, CUDA IPC and vLLM's sleep (research/engine-apis.md §6.4 #12)",
                            name, key, env[key])
            if cleaned:
                env[key] = cleaned
            else:
                del env[key]
    if devices:
        visible = ",".join(devices)
        if len(devices) != tp_size:
            raise EngineLaunchError(name, f"{len(devices)} GPUs configured (gpu_uuids/gpus) but tp_size={tp_size}; "
                                          "one GPU per TP rank")
        if launch_env.get("CUDA_VISIBLE_DEVICES", visible) != visible:
            raise EngineLaunchError(name, f"launch.env CUDA_VISIBLE_DEVICES={launch_env['CUDA_VISIBLE_DEVICES']} "
                                          f"differs from the configured GPUs ({visible})")
        env["CUDA_VISIBLE_DEVICES"] = visible
    return env


async def launch_until_healthy(
    name: str, label: str, command: Callable[[int], tuple[list[str], dict[str, str]]], *, url: str | None,
    log_file: str | os.PathLike[str] | None, ready_timeout_s: float,
    on_spawn: Callable[[ManagedProcess], None] | None = None,
) -> tuple[ManagedProcess, str]:
    """Start ``command(port)`` on 127.0.0.1 at ``url``'s port and return the process and its URL once ``GET
    /health`` answers 200 (the process's exit or ``ready_timeout_s`` is its failure). ``url`` None: a free port (a
    second once, if another process took the first); a failed server is stopped."""
    parts = urlsplit(url) if url is not None else None
    if parts is not None and parts.hostname not in ("127.0.0.1", "localhost"):
        raise EngineLaunchError(name, f"a launched {label} listens on 127.0.0.1; url {url!r} names another host")
    if parts is not None and parts.port is None:
        raise EngineLaunchError(name, f"url {url!r} has no port")
    port = parts.port if parts is not None else None
    async with httpx.AsyncClient(timeout=5.0, trust_env=False) as http:
        for attempt in (1, 2):
            chosen = port or free_port()
            argv, env = command(chosen)
            process = ManagedProcess(name, argv, env, label=label, log_file=log_file, on_spawn=on_spawn)
            process.spawn()
            served = f"http://127.0.0.1:{chosen}"

            async def healthy(served: str = served) -> bool | None:
                with contextlib.suppress(httpx.TransportError):
                    if (await http.get(f"{served}/health", timeout=max(ready_timeout_s, 1.0))).status_code == 200:
                        return True
                return None

            try:
                await process.wait_ready(healthy, ready_timeout_s)
                return process, served
            except EngineLaunchError:
                await process.stop()
                if attempt == 1 and port is None and "address already in use" in process.log_tail(64_000).lower():
                    log.warning("engine %r: port %d was taken; retrying on another", name, chosen)
                    continue
                raise
            except BaseException:
                await process.stop()
                raise
    raise AssertionError("unreachable")


def _engine_failure(proc: ManagedProcess, what: str) -> EngineLaunchError:
    return EngineLaunchError(
        proc.name, f"{proc.label} (pid {proc.pid}) {what}", log_path=proc.log_path, tail=proc.log_tail()
    )


def process_start_time(pid: int) -> int | None:
    """The kernel's start time of ``pid`` (clock ticks since boot), None if no such process (or a zombie)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # "pid (comm) state ppid ... starttime ...": comm may hold spaces and parentheses; it ends at the last ')'.
    fields = raw[raw.rfind(b")") + 2:].split()
    if len(fields) < 20 or fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass(frozen=True)
class LaunchRecord:
    """One engine process a daemon launched, as its journal keeps it."""

    engine: str
    pid: int
    start_time: int
    url: str
    pgid: int
    log: str | None = None
    incarnation: str | None = None  # the engine's own (server_info's startup_time), once observed

    @classmethod
    def of(cls, engine: str, pid: int, *, url: str, log: str | None) -> LaunchRecord | None:
        """The record of a process just started; None if it is already gone (nothing to adopt)."""
        start = process_start_time(pid)
        return None if start is None else cls(engine, pid, start, url, pid, log)

    @property
    def port(self) -> int | None:
        return urlsplit(self.url).port

    def alive(self) -> bool:
        """The recorded process still runs: its pid exists with the recorded start time."""
        return process_start_time(self.pid) == self.start_time

    def leftovers(self) -> bool:
        """The leader is gone but members of its process group remain (a pid stays reserved while its group lives)."""
        return process_start_time(self.pid) is None and group_alive(self.pgid)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> LaunchRecord:
        return cls(engine=str(data["engine"]), pid=int(data["pid"]), start_time=int(data["start_time"]),
                   url=str(data["url"]), pgid=int(data["pgid"]), log=data.get("log"),
                   incarnation=data.get("incarnation"))


async def stop_group(pgid: int, grace_s: float, leader_exit: Callable[[], Awaitable[object]] | None = None, *,
                     label: str = "process group") -> None:
    """SIGTERM the group and give its leader ``grace_s`` to exit (``leader_exit``; None: gone already), then SIGKILL
    the group and return once it is empty. Cancelled meanwhile, the group is killed first: no child outlives us."""
    try:
        if leader_exit is not None:
            signal_group(pgid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await leader_exit()
            except TimeoutError:
                log.warning("%s ignored SIGTERM for %gs; killing it", label, grace_s)
        signal_group(pgid, signal.SIGKILL)
        if leader_exit is not None:
            await leader_exit()
        async with asyncio.timeout(_GROUP_GONE_S):
            while group_alive(pgid):  # noqa: ASYNC110 - the kernel offers no event for a group
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        log.warning("%s: process group %d still has members %gs after SIGKILL", label, pgid, _GROUP_GONE_S)
    except BaseException:
        signal_group(pgid, signal.SIGKILL)
        raise


class AdoptedProcess:
    """A recorded engine process this daemon did not start: the subset of ``ManagedProcess`` supervision uses."""

    def __init__(self, record: LaunchRecord, *, label: str = "engine") -> None:
        self.record = record
        self.name = record.engine
        self.label = label
        self.pid: int | None = record.pid
        self.log_path: Path | None = Path(record.log) if record.log else None
        self.returncode: int | None = None  # not our child: its exit status never reaches us

    @property
    def running(self) -> bool:
        return self.record.alive()

    async def wait_exit(self) -> int | None:
        """Return once the process is gone; its exit status is unknown (None)."""
        await _await_exit(self.record.pid, self.record.alive)
        return None

    async def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM its group, SIGKILL after ``grace_s``, return once the group is gone; idempotent."""
        running = self.record.alive()
        await stop_group(self.record.pgid, grace_s, self.wait_exit if running else None, label=self.name)
        return None
