"""How a node's daemon actor is named in Ray's actor table: one name per node id, in one namespace."""

from __future__ import annotations

__all__ = ["NAMESPACE", "actor_name"]

NAMESPACE = "colocd"


def actor_name(node_id: str) -> str:
    return f"colocd-{node_id}"
