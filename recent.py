"""Bounded memories of recent things (ended sessions, manifests, layouts): an ``OrderedDict``, oldest first."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["remember"]

K = TypeVar("K")
V = TypeVar("V")


def remember(entries: OrderedDict[K, V], key: K, value: V, capacity: int) -> list[K]:
    """Set ``entries[key] = value`` as the most recent entry, drop the oldest beyond ``capacity``, and return the
    dropped keys, oldest first."""
    entries[key] = value
    entries.move_to_end(key)
    dropped: list[K] = []
    while len(entries) > capacity:
        dropped.append(entries.popitem(last=False)[0])
    return dropped
