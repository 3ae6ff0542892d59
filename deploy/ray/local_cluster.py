"""A multi-node Ray cluster on this machine, for the example beside it and the Ray tests (not part of the package).

    with local_cluster(nodes=3) as cluster:   # ray.init()-connected; cluster.add_node(...) adds one
        ...

Every node is a real raylet with its own node id (``ray.cluster_utils.Cluster``), sized for a small
box: one CPU each, a small object store, no dashboard. Ray is kept on loopback (127.0.0.1) for every
address it binds and dials: by default it picks the machine's outward address, which a test must not
send traffic to.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# Read by ray at import (ray._private.ray_constants): with it off, ray resolves "this node" to loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray
from ray.cluster_utils import Cluster

__all__ = ["NODE_ARGS", "local_cluster"]

NODE_ARGS: dict[str, Any] = {"num_cpus": 1, "object_store_memory": 80 * 2**20}


def _loopback_only() -> None:
    # The variable is read once at import: if ray was imported before this module, set what it decided.
    import ray._private.ray_constants as constants

    constants.ENABLE_RAY_CLUSTER = False


@contextmanager
def local_cluster(nodes: int = 3, *, namespace: str | None = None, **node_args: Any) -> Iterator[Cluster]:
    """Start ``nodes`` Ray nodes (the first is the head), connect this process, tear it all down after."""
    _loopback_only()
    args = {**NODE_ARGS, **node_args}
    cluster = Cluster(initialize_head=True, head_node_args={**args, "include_dashboard": False})
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**args)
        ray.init(address=cluster.address, namespace=namespace, include_dashboard=False,
                 logging_level=logging.WARNING, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()  # type: ignore[no-untyped-call]
