"""One colocd daemon per Ray node: ``NodeDaemon``, a Ray actor pinned to its node that runs ``colocd serve``, found
by its name ``colocd-<node_id>`` in namespace ``colocd``. Ray's named-actor table (in the GCS) is the registry: it
lives as long as the cluster. The actor takes no CPU and only runs the daemon (``DaemonProcess``, tethered: the
kernel kills it, and then its engines, when the actor's process dies) with the spec's engines in its config
unchanged. How the driver and the trainer ranks use it: docs/deploy.md, "Ray"."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..api.client import AsyncColocdClient
from ..api.procs import DaemonProcess
from ..policies import Transport

if TYPE_CHECKING:
    import torch

__all__ = [
    "NAMESPACE", "NodeDaemon", "NodeDaemons", "NodeSpec", "adaemon_for_this_node", "daemon_for_this_node",
    "daemon_urls", "list_daemons", "push_to_this_node", "stop_daemons",
]

NAMESPACE = "colocd"


@dataclass(frozen=True)
class NodeSpec:
    """What each node runs: ``engines`` (node-config engine entries) and ``daemon`` (the other node-config keys).
    ``listen_host``: default this Ray node's IP, so a cluster client on another node reaches it (set a ``token``
    then: mutating routes need it)."""

    engines: list[dict[str, Any]] = field(default_factory=list)
    daemon: dict[str, Any] = field(default_factory=dict)
    listen_host: str | None = None
    ready_timeout_s: float = 300.0  # the daemon's start, its engines' launches included
    stop_grace_s: float = 30.0  # SIGTERM → SIGKILL; the daemon stops its engines in it (launch.stop_grace_s)


class NodeDaemon:
    """The actor's body (``ray.remote`` is applied in ``NodeDaemons.ensure``); all methods run on one event loop."""

    def __init__(self, node_id: str, spec: NodeSpec) -> None:
        self.node_id = node_id
        self.spec = spec
        self.workdir = Path(tempfile.mkdtemp(prefix=f"colocd-node-{node_id[:12]}-"))
        self._daemon: DaemonProcess | None = None
        self._starting = asyncio.Lock()  # concurrent start() calls (two drivers' ensure()) start one daemon

    async def start(self) -> dict[str, Any]:
        """Start the daemon (which launches or attaches to the engines); returns ``info()``. Idempotent."""
        async with self._starting:
            if self._daemon is None:
                host = self.spec.listen_host or ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
                config = {"journal": str(self.workdir / "journal.jsonl"), **self.spec.daemon,
                          "listen": {"host": host, "port": 0, **self.spec.daemon.get("listen", {})},
                          "engines": self.spec.engines}
                daemon = DaemonProcess(config, workdir=str(self.workdir), ready_timeout_s=self.spec.ready_timeout_s,
                                       tether=True)
                try:
                    await daemon.__aenter__()  # stops what it started if it fails
                except Exception as exc:
                    raise RuntimeError(f"node {self.node_id}: {exc}") from exc
                self._daemon = daemon
        return self.info()

    def info(self) -> dict[str, Any]:
        """Where this node's daemon listens and its pid; its engines are in the daemon's ``/v1/status``."""
        daemon = self._daemon
        return {"node_id": self.node_id, "url": daemon.url if daemon else "",
                "daemon_pid": daemon.pid if daemon else None, "workdir": str(self.workdir)}

    async def cleanup(self) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL after ``stop_grace_s``; it stops the engines it launched) and remove
        the working directory (the journal and logs with it)."""
        if self._daemon is not None:
            await self._daemon.stop(self.spec.stop_grace_s)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _alive_nodes() -> list[str]:
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))  # type: ignore[no-untyped-call]


def _find(node_id: str) -> Any | None:
    try:
        return ray.get_actor(f"colocd-{node_id}", namespace=NAMESPACE)
    except ValueError:  # Ray's answer for "no actor of that name"
        return None


class NodeDaemons:
    """The driver's hold on the node daemons it started: ``ensure()`` on every alive node, ``stop()`` at the end. A
    job-scoped named actor is garbage-collected with its last handle, so whoever starts the daemons keeps their
    handles: this object. ``detached=True``: daemons that outlive the job (a cluster shared by several jobs)."""

    def __init__(self, spec: NodeSpec, *, detached: bool = False) -> None:
        self.spec = spec
        self.detached = detached
        self.handles: dict[str, Any] = {}

    def ensure(self, nodes: list[str] | None = None, timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
        """Start a daemon on every alive node (or ``nodes``) that has none; returns their ``info()``. A daemon
        started elsewhere is adopted, a running one answers at once: safe to call again after nodes joined."""
        targets = nodes if nodes is not None else _alive_nodes()
        for node in (n for n in targets if n not in self.handles):
            # Pinned to its node, or the one the node has: the name is the lock.
            self.handles[node] = ray.remote(NodeDaemon).options(
                name=f"colocd-{node}", namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_restarts=0,
                lifetime="detached" if self.detached else None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
            ).remote(node, self.spec)
        infos = ray.get([self.handles[n].start.remote() for n in targets], timeout=timeout_s)
        return dict(zip(targets, infos, strict=True))

    def stop(self, timeout_s: float = 60.0) -> list[str]:
        """Stop every daemon held here and its engines, and remove the actors (detached ones too)."""
        handles, self.handles = self.handles, {}
        return _stop(handles, timeout_s)


def _found() -> dict[str, Any]:
    return {n: h for n in _alive_nodes() if (h := _find(n)) is not None}


def _stop(handles: dict[str, Any], timeout_s: float) -> list[str]:
    ray.get([h.cleanup.remote() for h in handles.values()], timeout=timeout_s)
    for handle in handles.values():
        ray.kill(handle)
    return sorted(handles)


def list_daemons(timeout_s: float = 60.0) -> dict[str, dict[str, Any]]:
    """``info()`` of the daemon on each alive node that has one."""
    handles = _found()
    return dict(zip(handles, ray.get([h.info.remote() for h in handles.values()], timeout=timeout_s), strict=True))


def daemon_urls(timeout_s: float = 60.0) -> dict[str, str]:
    """``{node_id: daemon url}``: what ``ClusterClient`` takes."""
    return {n: str(i["url"]) for n, i in list_daemons(timeout_s).items()}


def _this_node() -> Any:
    node_id = ray.get_runtime_context().get_node_id()
    if (handle := _find(node_id)) is None:
        raise LookupError(f"no colocd daemon on node {node_id}: start one with "
                          "colocd.cluster.registry.NodeDaemons(spec).ensure()")
    return handle


def daemon_for_this_node(timeout_s: float = 60.0) -> dict[str, Any]:
    """This node's daemon ``info()`` (url, pid), from inside any task or actor on the node."""
    info: dict[str, Any] = ray.get(_this_node().info.remote(), timeout=timeout_s)
    return info


async def adaemon_for_this_node() -> dict[str, Any]:
    """``daemon_for_this_node`` for async actors (awaits instead of blocking their event loop)."""
    info: dict[str, Any] = await _this_node().info.remote()
    return info


async def push_to_this_node(named: Iterable[tuple[str, torch.Tensor]], *, version: str, step: int | None = None,
                            token: str | None = None, transport: Transport | str = "auto",
                            bucket_mb: float | None = None, depth: int | None = None) -> dict[str, Any]:
    """One whole push from a trainer rank to this node's daemon (``WeightPusher``'s defaults); returns a summary the
    driver keeps. A failure raises ``ColocdHTTPError``, which pickles with the daemon's error body: the driver's
    ``ClusterClient`` names the node, engine and reason from it."""
    from ..trainer.push import DEFAULT_DEPTH, WeightPusher  # torch: only trainer ranks push

    info = await adaemon_for_this_node()
    depth = DEFAULT_DEPTH if depth is None else depth
    async with AsyncColocdClient(info["url"], token=token) as client, \
            WeightPusher(client, transport=transport, bucket_mb=bucket_mb, depth=depth) as pusher:
        report = await pusher.push(named, version=version, step=step)
    return {"node_id": info["node_id"], "session_id": report.session_id, "version": report.version,
            "chunks": report.chunks, "nbytes": report.nbytes, "seconds": report.seconds}


def stop_daemons(timeout_s: float = 60.0) -> list[str]:
    """Stop every node's daemon and engines and remove the actors, found by name (detached ones too)."""
    return _stop(_found(), timeout_s)
