"""Finding each node's daemon by Ray node id: a named actor per node, ``colocd-<node_id>`` in namespace ``colocd``.

    daemons = NodeDaemons(spec)     # the driver holds them; they go with the job (detached=True: they stay)
    daemons.ensure()                # start one on every alive node that has none (again after nodes join)
    daemon_urls()                   # {node_id: url} for the cluster client
    daemon_for_this_node()          # inside a trainer actor: this node's daemon (its url and pid)

No registry actor of our own: Ray's named-actor table (in the GCS) is the registry, so it lives as
long as the cluster and has no single actor to lose. Lookups by name cost one GCS round trip each.
"""

from __future__ import annotations

from typing import Any

import ray

from .daemon_actor import NAMESPACE, actor_name, create_node_daemon

__all__ = [
    "NodeDaemons",
    "adaemon_for_this_node",
    "alive_nodes",
    "daemon_for_this_node",
    "daemon_urls",
    "find_daemon",
    "list_daemons",
    "stop_daemons",
]


def alive_nodes() -> list[str]:
    """Node ids of the cluster's alive nodes."""
    return sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))  # type: ignore[no-untyped-call]


def find_daemon(node_id: str) -> Any | None:
    """The node's daemon actor handle, or None if it has none."""
    try:
        return ray.get_actor(actor_name(node_id), namespace=NAMESPACE)
    except ValueError:  # Ray's answer for "no actor of that name"
        return None


class NodeDaemons:
    """The driver's hold on the node daemons it started: ``ensure()`` on every alive node, ``stop()`` at the end.

    A job-scoped named actor is garbage-collected with its last handle, so whoever starts the daemons
    keeps their handles: this object. ``detached=True``: daemons that stay up after the job (a long-lived
    cluster shared by several jobs), found again by name.
    """

    def __init__(self, spec: Any, *, detached: bool = False) -> None:
        self.spec = spec
        self.detached = detached
        self.handles: dict[str, Any] = {}

    def ensure(self, nodes: list[str] | None = None, timeout_s: float = 300.0) -> dict[str, dict[str, Any]]:
        """Start a daemon on every alive node (or ``nodes``) that has none; returns their ``info()``.

        Safe to call again after nodes joined: existing daemons are found, not restarted.
        """
        targets = nodes if nodes is not None else alive_nodes()
        for node in targets:  # get-or-create by name: a daemon started elsewhere is adopted
            self.handles.setdefault(node, create_node_daemon(node, self.spec, detached=self.detached))
        # start() is idempotent: a running daemon answers at once with its info.
        infos = ray.get([self.handles[n].start.remote() for n in targets], timeout=timeout_s)
        return dict(zip(targets, infos, strict=True))

    def urls(self) -> dict[str, str]:
        return daemon_urls()

    def stop(self, timeout_s: float = 60.0) -> list[str]:
        """Stop every daemon held here and its engines, and remove the actors (detached ones too)."""
        handles, self.handles = self.handles, {}
        return _stop(handles, timeout_s)


def _found() -> dict[str, Any]:
    """The daemon actor of each alive node that has one."""
    return {n: h for n in alive_nodes() if (h := find_daemon(n)) is not None}


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
    if (handle := find_daemon(node_id)) is None:
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


def stop_daemons(timeout_s: float = 60.0) -> list[str]:
    """Stop every node's daemon and engines and remove the actors, found by name (detached ones too)."""
    return _stop(_found(), timeout_s)
