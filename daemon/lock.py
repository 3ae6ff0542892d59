"""The node's one lock: one mutating operation at a time. A second request while one runs is refused with 409
naming the one in progress (the trainer drives phases sequentially; queueing would hide a trainer bug); work
nobody requested (a reconcile tick, closing an ended session) holds it too, and a reconcile is waited for."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

__all__ = ["NodeLock"]


class NodeLock:
    """Who holds the node now (``busy_with``), and ``stopping``, set once the daemon closes."""

    def __init__(self, *, can_start: Callable[[str, str | None], None], before: Callable[[str], Awaitable[None]],
                 after: Callable[[], None]) -> None:
        """``can_start(what, busy_with)`` refuses an operation (409); ``before(what)`` runs once it holds the node,
        before it acts; ``after()`` once the node is free again."""
        self._lock = asyncio.Lock()
        self._can_start, self._before, self._after = can_start, before, after
        self.busy_with: str | None = None
        self._reconciling = False  # a background reconcile holds it: operations wait instead of 409
        self.stopping = asyncio.Event()

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    @contextlib.asynccontextmanager
    async def exclusive(self, what: str) -> AsyncIterator[None]:
        """Hold the node for ``what``: refused while another operation holds it (a background reconcile is
        waited for), then every engine is reconciled before ``what`` acts."""
        self._can_start(what, self.busy_with if self._lock.locked() and not self._reconciling else None)
        async with self._lock:  # a background reconcile holding it finishes first
            self.busy_with = what
            try:
                await self._before(what)
                yield
            finally:
                self.busy_with = None
                self._after()

    @contextlib.asynccontextmanager
    async def background(self, what: str, *, reconciling: bool = False) -> AsyncIterator[None]:
        """Hold the node for work nobody requested; operations wait for a reconcile (``reconciling``), not 409."""
        async with self._lock:
            self.busy_with, self._reconciling = what, reconciling
            try:
                yield
            finally:
                self.busy_with, self._reconciling = None, False
                self._after()
