"""A writer-preferring asyncio reader/writer lock: SGLang's ``model_update_lock`` in miniature.

Generation requests are readers for their whole lifetime; a weight update that arrives while the
engine is not paused is a writer, so it waits for the requests in flight to finish and new ones
wait behind it (SGLang tokenizer_control_mixin.py:471-633).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

__all__ = ["ReaderWriterLock"]


class ReaderWriterLock:
    """Many readers or one writer; once a writer waits, new readers queue behind it."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers, self._writers_waiting, self._writer_active = 0, 0, False

    @contextlib.asynccontextmanager
    async def reader(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer_active and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @contextlib.asynccontextmanager
    async def writer(self) -> AsyncIterator[None]:
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer_active and self._readers == 0)
            finally:
                self._writers_waiting -= 1
                self._cond.notify_all()  # a cancelled writer must not leave readers parked
            self._writer_active = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer_active = False
                self._cond.notify_all()
