"""One colocd daemon per Ray node: a Ray actor pinned to its node that runs ``colocd serve`` as a child.

    handle = start_node_daemon(node_id, NodeSpec(engines=[{"kind": "reference", "name": "ref0",
                                                           "launch": {}}]), detached=False)

The actor (``NodeDaemon``) is placed with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``, takes
no CPU of the node's (the trainer's actors keep them), and is named ``colocd-<node_id>`` in the
``colocd`` namespace (``registry``). ``detached=True`` keeps it, and so the daemon and engines, running
after the job that started it ends; otherwise it goes with the job.

Engines come from the spec, the same entries as a node config's ``engines:``. One with a ``url`` and
no ``launch`` is attached to (found); a reference engine with ``launch`` is started here, and restarted
here on the same URL when it exits (the daemon's health loop then sees the new incarnation and
reconciles it: issue 9). That is the ``launcher="actor"`` mode; ``launcher="daemon"`` hands the
``launch`` entries to the daemon unchanged, for a daemon that launches and supervises its engines itself.

Every child is tethered (``colocd.cluster.tether``): if the actor's process dies without stopping them
(``ray.kill``, the job ending, the node removed) the kernel kills them too, so no daemon or engine
outlives the actor that owns it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import ray
import yaml
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..engines.config import ReferenceEngineConfig
from ..engines.logtail import read_tail
from ..engines.reference.launcher import ReferenceEngineProcess
from .registry import NAMESPACE, actor_name
from .tether import tether_prefix

__all__ = ["NodeDaemon", "NodeSpec", "create_node_daemon", "start_node_daemon"]

log = logging.getLogger("colocd.cluster")


@dataclass(frozen=True)
class NodeSpec:
    """What each node runs.

    ``engines``: node-config engine entries. ``daemon``: the other node-config keys (``timeouts``,
    ``policy_file``, ``token``, ...). ``listen_host``: where the daemon listens, default this Ray node's
    IP, so the cluster client on another node reaches it (set a ``token`` then: mutating routes need it).
    """

    engines: list[dict[str, Any]] = field(default_factory=list)
    daemon: dict[str, Any] = field(default_factory=dict)
    listen_host: str | None = None
    launcher: Literal["actor", "daemon"] = "actor"
    supervise_s: float = 0.2  # how often the actor looks for an exited engine it launched
    ready_timeout_s: float = 120.0  # the daemon's own start


class _TetheredReferenceEngine(ReferenceEngineProcess):
    """A reference engine process that dies with the actor that started it."""

    def command(self, ready_file: str) -> list[str]:
        return tether_prefix() + super().command(ready_file)


@dataclass
class _LaunchedEngine:
    config: ReferenceEngineConfig
    process: ReferenceEngineProcess
    restarts: int = 0
    last_exit: int | None = None


class NodeDaemon:
    """The actor's body (``ray.remote`` is applied in ``start_node_daemon``); all methods run on one event loop."""

    def __init__(self, node_id: str, spec: NodeSpec) -> None:
        self.node_id = node_id
        self.spec = spec
        self.workdir = Path(tempfile.mkdtemp(prefix=f"colocd-node-{node_id[:12]}-"))
        self.url = ""
        self._daemon: asyncio.subprocess.Process | None = None
        self._daemon_log = self.workdir / "daemon.log"
        self._engines: dict[str, _LaunchedEngine] = {}
        self._supervisor: asyncio.Task[None] | None = None

    # --- lifecycle --------------------------------------------------------------------------------

    async def start(self) -> dict[str, Any]:
        """Start (or find) the engines, then the daemon; returns ``info()``. Idempotent."""
        if self._daemon is not None:
            return self.info()
        engines: list[dict[str, Any]] = []
        launch_here = [e for e in self.spec.engines if self.spec.launcher == "actor" and e.get("launch") is not None]
        for entry in self.spec.engines:
            if entry not in launch_here:
                engines.append(entry)
        started = await asyncio.gather(*(self._launch_engine(e) for e in launch_here), return_exceptions=True)
        errors = [s for s in started if isinstance(s, BaseException)]
        if errors:
            await self.stop()
            raise errors[0]
        # The daemon attaches to what was launched here, on the URL it bound.
        engines += [{k: v for k, v in e.items() if k != "launch"} | {"url": self._engines[e["name"]].process.url}
                    for e in launch_here]
        await self._start_daemon(engines)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())
        return self.info()

    async def stop(self) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL) and every engine launched here."""
        if self._supervisor is not None:
            self._supervisor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._supervisor
            self._supervisor = None
        proc = self._daemon
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        await asyncio.gather(*(e.process.aclose() for e in self._engines.values()), return_exceptions=True)

    def info(self) -> dict[str, Any]:
        """Where this node's daemon listens, its pid, and each engine launched here (url, pid, restarts)."""
        return {
            "node_id": self.node_id,
            "url": self.url,
            "daemon_pid": self._daemon.pid if self._daemon else None,
            "engines": {n: {"url": e.process.url, "pid": e.process.pid, "restarts": e.restarts,
                            "last_exit": e.last_exit} for n, e in self._engines.items()},
            "workdir": str(self.workdir),
        }

    def daemon_log(self, n: int = 4000) -> str:
        return read_tail(self._daemon_log, n)

    async def cleanup(self) -> None:
        """``stop()`` and remove the working directory (the journal and logs with it)."""
        await self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- engines ----------------------------------------------------------------------------------

    async def _launch_engine(self, entry: dict[str, Any]) -> None:
        if entry.get("kind", "reference") != "reference":
            raise ValueError(f"engine {entry.get('name')!r}: the node actor launches reference engines only; "
                             "give other engines a url (attach) or use launcher='daemon'")
        config = ReferenceEngineConfig.model_validate({"url": "http://127.0.0.1:0", **entry})
        process = _TetheredReferenceEngine(config, log_path=self.workdir / f"{config.name}.log")
        await process.astart()
        # Restarts bind the same port: the daemon's config names this URL.
        pinned = config.model_copy(update={"url": process.url})
        self._engines[config.name] = _LaunchedEngine(pinned, process)

    async def _supervise(self) -> None:
        """Restart any engine launched here that exited; the daemon reconciles the new incarnation."""
        while True:
            await asyncio.sleep(self.spec.supervise_s)  # supervision cadence, not synchronisation
            for name, engine in self._engines.items():
                code = engine.process.returncode
                if code is None:
                    continue
                log.warning("node %s: engine %s exited with %s; restarting it on %s",
                            self.node_id, name, code, engine.config.url)
                await engine.process.aclose()  # reaps it, drops its ready file
                engine.last_exit = code
                # Ready once it answers at all: the daemon may pause it before its first generation.
                fresh = _TetheredReferenceEngine(engine.config, log_path=self.workdir / f"{name}.log",
                                                 ready_path="/model_info")
                try:
                    await fresh.astart()
                except Exception:
                    log.exception("node %s: engine %s did not restart; trying again", self.node_id, name)
                engine.process = fresh
                engine.restarts += 1

    # --- the daemon -------------------------------------------------------------------------------

    async def _start_daemon(self, engines: list[dict[str, Any]]) -> None:
        ready = self.workdir / "daemon.ready.json"
        host = self.spec.listen_host or ray.util.get_node_ip_address()
        listen = {"host": host, "port": 0, **self.spec.daemon.get("listen", {}), "ready_file": str(ready)}
        config = {"journal": str(self.workdir / "journal.jsonl"), **self.spec.daemon,
                  "listen": listen, "engines": engines}
        config_path = self.workdir / "colocd.yaml"
        config_path.write_text(yaml.safe_dump(config))
        with open(self._daemon_log, "ab") as log_file:  # noqa: ASYNC230 (opening a log for the child)
            self._daemon = await asyncio.create_subprocess_exec(
                *tether_prefix(), sys.executable, "-m", "colocd.api.cli", "serve", "--config", str(config_path),
                "--log-level", "warning", stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + self.spec.ready_timeout_s
        while not ready.exists():
            if self._daemon.returncode is not None or time.monotonic() > deadline:
                what = (f"exited with {self._daemon.returncode}" if self._daemon.returncode is not None
                        else f"not ready within {self.spec.ready_timeout_s:g}s")
                await self.stop()
                raise RuntimeError(f"node {self.node_id}: colocd daemon {what}: {self.daemon_log()}")
            await asyncio.sleep(0.05)  # polling for the ready file the daemon writes once it listens
        self.url = str(json.loads(ready.read_text())["url"])


def create_node_daemon(node_id: str, spec: NodeSpec, *, detached: bool = False) -> Any:
    """Create the node's daemon actor, pinned to ``node_id`` (or get the one it has: the name is the lock);
    call ``handle.start.remote()`` to start it."""
    return ray.remote(NodeDaemon).options(
        name=actor_name(node_id), namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_restarts=0,
        lifetime="detached" if detached else None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, spec)


def start_node_daemon(node_id: str, spec: NodeSpec, *, detached: bool = False) -> Any:
    """``create_node_daemon`` and wait for its daemon to be ready; returns the actor handle."""
    handle = create_node_daemon(node_id, spec, detached=detached)
    ray.get(handle.start.remote())
    return handle
