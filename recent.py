"""Bounded memories of recent things (ended sessions, manifests, layouts, open rings): one insert that evicts.

Every layer keeps a few: an ``OrderedDict`` ordered oldest first, where ``remember`` puts an entry last and
drops the oldest beyond its capacity, so a long-running daemon or engine holds a bounded number of them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

__all__ = ["remember"]

K = TypeVar("K")
V = TypeVar("V")


def remember(entries: OrderedDict[K, V], key: K, value: V, capacity: int) -> list[K]:
    """Set ``entries[key] = value`` as the most recent entry and drop the oldest beyond ``capacity``.

    Returns the dropped keys, oldest first, for a caller that keeps something else per key.
    """
    entries[key] = value
    entries.move_to_end(key)
    dropped: list[K] = []
    while len(entries) > capacity:
        dropped.append(entries.popitem(last=False)[0])
    return dropped
