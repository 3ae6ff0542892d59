"""One colocd daemon per Ray node: ``NodeDaemon``, a Ray actor pinned to its node that runs ``colocd serve``.

The actor is placed with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``, takes no CPU of the node's,
and is named ``colocd-<node_id>`` in the ``colocd`` namespace (``registry``); ``detached=True`` keeps it, and so
the daemon and engines, after the job that started it ends. It only runs the daemon (``api/procs.DaemonProcess``,
tethered: the kernel kills it, and then its engines, when the actor's process dies); the spec's engines go into
the daemon's config unchanged (attached by ``url``, or launched by ``launch:``). docs/deploy.md, "Ray".
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..api.procs import DaemonProcess

__all__ = ["NAMESPACE", "NodeDaemon", "NodeSpec", "actor_name", "create_node_daemon"]

NAMESPACE = "colocd"  # Ray's actor table: one name per node id, in one namespace


def actor_name(node_id: str) -> str:
    return f"colocd-{node_id}"


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
    ready_timeout_s: float = 300.0  # the daemon's start, its engines' launches included
    stop_grace_s: float = 30.0  # SIGTERM → SIGKILL; the daemon stops its engines in it (launch.stop_grace_s)


class NodeDaemon:
    """The actor's body (``ray.remote`` is applied in ``create_node_daemon``); all methods run on one event loop."""

    def __init__(self, node_id: str, spec: NodeSpec) -> None:
        self.node_id = node_id
        self.spec = spec
        self.workdir = Path(tempfile.mkdtemp(prefix=f"colocd-node-{node_id[:12]}-"))
        self._daemon: DaemonProcess | None = None
        self._starting = asyncio.Lock()  # concurrent start() calls (two drivers' ensure()) start one daemon

    # --- lifecycle --------------------------------------------------------------------------------

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

    async def stop(self) -> None:
        """Stop the daemon (SIGTERM, then SIGKILL after ``stop_grace_s``); it stops the engines it launched."""
        if self._daemon is not None:
            await self._daemon.stop(self.spec.stop_grace_s)

    def info(self) -> dict[str, Any]:
        """Where this node's daemon listens and its pid; its engines are in the daemon's ``/v1/status``."""
        daemon = self._daemon
        return {"node_id": self.node_id, "url": daemon.url if daemon else "",
                "daemon_pid": daemon.pid if daemon else None, "workdir": str(self.workdir)}

    async def cleanup(self) -> None:
        """``stop()`` and remove the working directory (the journal and logs with it)."""
        await self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def create_node_daemon(node_id: str, spec: NodeSpec, *, detached: bool = False) -> Any:
    """Create the node's daemon actor, pinned to ``node_id`` (or get the one it has: the name is the lock);
    call ``handle.start.remote()`` to start it."""
    return ray.remote(NodeDaemon).options(
        name=actor_name(node_id), namespace=NAMESPACE, get_if_exists=True, num_cpus=0, max_restarts=0,
        lifetime="detached" if detached else None,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
    ).remote(node_id, spec)

