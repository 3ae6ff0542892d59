"""The engines this daemon launches itself (a ``launch:`` section): start, watch, relaunch, stop.

Start-up is all-or-nothing: an engine not ready by its ``launch.ready_timeout_s`` stops the others and the error
(naming it, with its log) propagates, so ``colocd serve`` exits non-zero. An engine that exits later is relaunched
on the same port after a backoff that doubles per consecutive failure; ``on_relaunch`` then has the daemon
reconcile it (a new incarnation, as for any restarted engine). Every process is journaled as soon as it exists:
a daemon started on a journal naming a live process that answers where the config says adopts it; any other
leftover's process group is stopped before a new one is launched, so a SIGKILLed daemon never runs a second
engine beside one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

import httpx

from ..engines.config import AnyEngineConfig, LaunchConfig
from ..engines.processes import (
    AdoptedProcess,
    Launched,
    LaunchOptions,
    LaunchRecord,
    ManagedProcess,
    free_port,
    stop_group,
)
from ..engines.registry import launch_engine
from ..errors import EngineLaunchError
from .events import emit
from .journal import Journal
from .metrics import Metrics

__all__ = ["Backoff", "EngineSupervision", "LaunchState", "LaunchedEngine"]

log = logging.getLogger("colocd.supervision")

SHM_NOTE_S = 5.0  # how often a launched engine's /dev/shm files are noted while it runs
Launcher = Callable[[AnyEngineConfig, LaunchOptions], Awaitable[Launched]]
Answers = Callable[[str], Awaitable[bool]]  # does something serve HTTP at this URL?


async def answers_http(url: str) -> bool:
    """Any HTTP answer at ``url`` (even 401, 404, 503) means a server listens there. ``/model_info``, not
    ``/health``: that runs a generation on SGLang, slow under load."""
    try:
        async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
            await client.get(f"{url}/model_info")
    except httpx.HTTPError:
        return False
    return True


@dataclass(frozen=True)
class Backoff:
    """Waits between relaunches: ``initial_s`` doubling per consecutive failure, at most ``max_s``."""

    initial_s: float = 1.0
    max_s: float = 30.0
    reset_after_s: float = 60.0  # a run that stayed up this long was a success: the count restarts

    def delay(self, failures: int) -> float:
        """The wait before relaunch number ``failures`` (1: the first failure in a row)."""
        return float(min(self.max_s, self.initial_s * 2 ** max(0, failures - 1)))

    def counts_as_failure(self, uptime_s: float | None) -> bool:
        """Whether a run that ended after ``uptime_s`` (None: it never became ready) continues the streak."""
        return uptime_s is None or uptime_s < self.reset_after_s


class LaunchState(StrEnum):
    STARTING = "starting"  # process started, not yet ready
    RUNNING = "running"  # ready; the daemon attached to it
    BACKOFF = "backoff"  # exited; waiting before the next launch
    EXITED = "exited"  # exited and launch.restart is false: left down
    STOPPED = "stopped"  # stopped by the daemon (shutdown)


_UNREADY = {LaunchState.STARTING: "launching", LaunchState.BACKOFF: "exited; in backoff before its relaunch",
            LaunchState.EXITED: "exited (launch.restart is false)", LaunchState.STOPPED: "stopped"}


@dataclass
class LaunchedEngine:
    """What the daemon knows about one engine it launches (status shows ``snapshot()``)."""

    config: AnyEngineConfig  # the engine's config, url filled in
    backoff: Backoff
    restart: bool
    grace_s: float
    state: LaunchState = LaunchState.STARTING
    process: ManagedProcess | AdoptedProcess | None = None
    up_since: float | None = None  # monotonic time it became ready; None while not running
    launches: int = 0  # processes that became ready
    restarts: int = 0  # of those, the relaunches after an exit
    failures: int = 0  # consecutive failures (drives the backoff)
    last_exit: int | None = None
    last_error: str | None = None
    next_launch_at: float | None = None  # wall-clock time of the pending relaunch, in BACKOFF
    adopted: bool = False  # the running process was launched by a previous daemon (engines/processes.py)
    record: LaunchRecord | None = None  # what the journal says about the process

    @property
    def name(self) -> str:
        return self.config.name

    def unready_reason(self) -> str | None:
        """Why the engine's process cannot be driven now (None: it runs)."""
        if self.state is LaunchState.RUNNING:
            return None
        why = _UNREADY[self.state]
        if self.state is LaunchState.BACKOFF and self.next_launch_at is not None:
            why += f" (next launch in {max(0.0, self.next_launch_at - time.time()):.1f}s)"
        if self.last_error:
            why += f"; last error: {self.last_error}"
        return f"engine {self.name!r}: {why}"

    def snapshot(self) -> dict[str, Any]:
        live = self.process is not None and self.state in (LaunchState.STARTING, LaunchState.RUNNING)
        return {"state": self.state.value, "pid": self.process.pid if live and self.process else None,
                "adopted": self.adopted,
                "url": self.config.url, "launches": self.launches, "restarts": self.restarts,
                "consecutive_failures": self.failures, "last_exit_code": self.last_exit,
                "last_error": self.last_error, "next_launch_at": self.next_launch_at,
                "log": str(self.process.log_path) if self.process and self.process.log_path else None}


def _launch_of(config: AnyEngineConfig) -> LaunchConfig:
    if config.launch is None:
        raise ValueError(f"engine {config.name!r} has no launch: section, so colocd does not launch it")
    return config.launch


def _for_launch(config: AnyEngineConfig) -> AnyEngineConfig:
    """``config`` as launched: a free port for port 0 (a relaunch comes back there), one log file for every run."""
    update: dict[str, Any] = {}
    if not (urlsplit(config.url).port if config.url else None):
        update["url"] = f"http://127.0.0.1:{free_port()}"
    launch = _launch_of(config)
    if launch.log_file is None:
        fd, path = tempfile.mkstemp(prefix=f"colocd-{config.name}-", suffix=".log")
        os.close(fd)
        update["launch"] = launch.model_copy(update={"log_file": path})
    return config.model_copy(update=update)


class EngineSupervision:
    """Launches and supervises the engines of one daemon that have a ``launch:`` section."""

    def __init__(self, engines: Sequence[AnyEngineConfig], metrics: Metrics, *,
                 launcher: Launcher = launch_engine,
                 journal: Journal | None = None, answers: Answers = answers_http) -> None:
        self._engines = list(engines)
        self._metrics = metrics
        self._launcher = launcher
        self._journal = journal or Journal(None)
        self._answers = answers
        self.launched: dict[str, LaunchedEngine] = {}
        self._started = False
        self._closed = False
        self._watchers: set[asyncio.Task[None]] = set()

    def configs(self) -> list[AnyEngineConfig]:
        """Every engine's config, launched ones with their URL (call after ``start``)."""
        return [self.launched[c.name].config if c.name in self.launched else c for c in self._engines]

    async def start(self) -> None:
        """Launch every engine with ``launch:`` concurrently; idempotent. All ready, or none left running."""
        if self._started:
            return
        self._started = True
        for cfg in self._engines:
            if cfg.launch is not None:
                launch = cfg.launch
                self.launched[cfg.name] = LaunchedEngine(
                    config=_for_launch(cfg), restart=launch.restart, grace_s=launch.stop_grace_s,
                    backoff=Backoff(launch.backoff_initial_s, launch.backoff_max_s, launch.backoff_reset_s))
        records = self._journal.launches()
        given = {c.name: c for c in self._engines}
        try:
            async with asyncio.TaskGroup() as group:  # the first failure cancels the other launches
                for engine in self.launched.values():
                    group.create_task(self._adopt_or_launch(engine, records.get(engine.name), given[engine.name]))
        except BaseExceptionGroup as failed:
            await self._stop_all()
            raise failed.exceptions[0] from None
        except BaseException:
            await self._stop_all()
            raise

    def supervise(self, on_relaunch: Callable[[str], Awaitable[None]]) -> None:
        """Watch every launched engine; after a relaunch, ``on_relaunch(name)`` reconciles it."""
        loop = asyncio.get_running_loop()
        for engine in self.launched.values():
            task = loop.create_task(self._watch(engine, on_relaunch), name=f"colocd-supervise-{engine.name}")
            self._watchers.add(task)
            task.add_done_callback(self._watchers.discard)

    async def aclose(self) -> None:
        """Stop watching (no relaunch from here on), then stop every launched process group; idempotent."""
        if self._closed:
            return
        self._closed = True
        for task in list(self._watchers):
            task.cancel()
        await asyncio.gather(*self._watchers, return_exceptions=True)
        await self._stop_all()
        await self._journal.drain()  # "stopped" is on disk: a next daemon adopts nothing

    def note_incarnation(self, name: str, incarnation: str | None) -> None:
        """The daemon observed ``name``'s incarnation: journal it with the process, once per change."""
        engine = self.launched.get(name)
        if (engine is None or engine.record is None or incarnation is None
                or engine.record.incarnation == incarnation):
            return
        engine.record = dataclasses.replace(engine.record, incarnation=incarnation)
        self._journal.record_launch(engine.record)

    async def _adopt_or_launch(self, engine: LaunchedEngine, record: LaunchRecord | None,
                               given: AnyEngineConfig) -> None:
        if record is None or not await self._adopt(engine, record, given):
            await self._launch(engine)

    async def _adopt(self, engine: LaunchedEngine, record: LaunchRecord, given: AnyEngineConfig) -> bool:
        """Adopt the recorded process if it is alive and answers where it should (True); else stop its group."""
        fixed_port = urlsplit(given.url).port if given.url else None
        if record.alive():
            why = None
            if fixed_port is not None and record.port != fixed_port:
                why = f"it listens on port {record.port}, the config says {fixed_port}"
            elif not await self._answers(record.url):
                why = f"it does not answer at {record.url}"
            if why is None:
                launch = _launch_of(engine.config)
                if record.log and _launch_of(given).log_file is None:  # its own log, not the one made for a launch
                    if launch.log_file is not None:
                        with contextlib.suppress(OSError):
                            os.unlink(launch.log_file)
                    launch = launch.model_copy(update={"log_file": record.log})
                engine.config = engine.config.model_copy(update={"url": record.url, "launch": launch})
                engine.process, engine.record, engine.adopted = AdoptedProcess(record), record, True
                engine.state, engine.up_since, engine.last_error = LaunchState.RUNNING, time.monotonic(), None
                emit("engine_adopted", logging.INFO, engine=engine.name, pid=record.pid, url=record.url,
                     launched_by="a previous daemon")
                return True
            emit("engine_orphan_stopped", logging.WARNING, engine=engine.name, pid=record.pid, pgid=record.pgid,
                 reason=f"launched by a previous daemon, alive but {why}; its process group is stopped before "
                        "another is launched")
            await AdoptedProcess(record).stop(engine.grace_s)
        elif record.leftovers():
            emit("engine_orphan_stopped", logging.WARNING, engine=engine.name, pgid=record.pgid,
                 reason="the process group of an engine a previous daemon launched outlived it; stopped before "
                        "another is launched")
            await stop_group(record.pgid, engine.grace_s)
        return False

    def _spawned(self, engine: LaunchedEngine, process: ManagedProcess) -> None:
        """A process exists: show its pid, and journal it before it is waited for (a daemon killed now finds it)."""
        engine.process = process
        if process.pid is None:
            return
        record = LaunchRecord.of(engine.name, process.pid, url=str(engine.config.url),
                                 log=str(process.log_path) if process.log_path else None)
        if record is not None:
            engine.record = record
            self._journal.record_launch(record)

    async def _launch(self, engine: LaunchedEngine) -> None:
        engine.state, engine.next_launch_at, engine.adopted = LaunchState.STARTING, None, False
        options = LaunchOptions(on_spawn=lambda process: self._spawned(engine, process))
        try:
            launched = await self._launcher(engine.config, options)
        except Exception as exc:  # its own error, or a misconfiguration it found (vLLM without model_path, ...)
            failed = exc if isinstance(exc, EngineLaunchError) else EngineLaunchError(
                engine.name, f"could not be launched: {exc}")
            engine.last_error = failed.summary
            self._metrics.engine_launch_failures.labels(engine.name).inc()
            if failed is exc:
                raise
            raise failed from exc
        if engine.process is not launched.process:  # a launcher that did not call the spawn hook (a plugin)
            self._spawned(engine, launched.process)
        await self._journal.drain()  # running means journaled: a daemon killed from here on finds it
        engine.up_since = time.monotonic()
        engine.launches += 1
        engine.state, engine.last_error = LaunchState.RUNNING, None
        self._metrics.engine_launches.labels(engine.name).inc()
        emit("engine_launched", logging.INFO, engine=engine.name, pid=launched.process.pid, url=launched.url)

    async def _watch(self, engine: LaunchedEngine, on_relaunch: Callable[[str], Awaitable[None]]) -> None:
        while True:
            assert engine.process is not None
            engine.last_exit = await self._until_exit(engine.process)
            if isinstance(engine.process, ManagedProcess):
                # What is left of the group (children of a crashed leader) goes, and the /dev/shm files it left.
                await engine.process.stop(engine.grace_s)
            uptime = time.monotonic() - engine.up_since if engine.up_since is not None else None
            engine.up_since = None
            emit("engine_exited", logging.WARNING, engine=engine.name, pid=engine.process.pid,
                 code=engine.last_exit,  # None: adopted, not this daemon's child, so its code is unknown
                 uptime_s=round(uptime or 0.0, 3), then="relaunch" if engine.restart else "left_down")
            if not engine.restart:
                engine.state = LaunchState.EXITED
                return
            await self._relaunch(engine, uptime)
            try:
                await on_relaunch(engine.name)
            except Exception:  # the health loop reconciles it again; the watcher must keep watching
                log.exception("engine %s: reconcile after relaunch failed", engine.name,
                              extra={"colocd": {"event": "reconcile", "engine": engine.name, "session": None}})

    @staticmethod
    async def _until_exit(process: ManagedProcess | AdoptedProcess) -> int | None:
        """Wait for the exit, noting the ``/dev/shm`` files its group maps meanwhile (a crash leaves no moment to)."""
        exited = asyncio.ensure_future(process.wait_exit())
        try:
            while not exited.done():
                if isinstance(process, ManagedProcess):
                    await asyncio.to_thread(process.note_shm)
                await asyncio.wait({exited}, timeout=SHM_NOTE_S)
            return exited.result()
        finally:
            exited.cancel()

    async def _relaunch(self, engine: LaunchedEngine, uptime: float | None) -> None:
        while True:
            engine.failures = engine.failures + 1 if engine.backoff.counts_as_failure(uptime) else 1
            delay = engine.backoff.delay(engine.failures)
            engine.state, engine.next_launch_at = LaunchState.BACKOFF, time.time() + delay
            await asyncio.sleep(delay)  # the backoff itself, not a wait for something to happen
            try:
                await self._launch(engine)
            except EngineLaunchError as exc:
                emit("engine_launch_failed", logging.WARNING, engine=engine.name, error=exc.summary)
                uptime = None
                continue
            engine.restarts += 1
            return

    async def _stop_all(self) -> None:
        async def stop(engine: LaunchedEngine) -> None:
            if engine.process is not None:
                with contextlib.suppress(ProcessLookupError):
                    await engine.process.stop(engine.grace_s)
            engine.state = LaunchState.STOPPED
            if engine.record is not None:
                self._journal.launch_ended(engine.name)  # nothing left for a next daemon to adopt
                engine.record = None
            emit("engine_stopped", logging.INFO, engine=engine.name,
                 pid=engine.process.pid if engine.process else None)

        await asyncio.gather(*(stop(e) for e in self.launched.values()))
