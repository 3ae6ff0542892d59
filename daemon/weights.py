"""The weight stream: gather each chunk from the trainer ranks, load it into every engine, ack the ranks.

Data path: rank r POSTs chunk k's descriptor → once every rank an engine needs has sent chunk k,
the chunk goes to each engine (at most ``depth`` chunks in flight per engine) → when every engine
has consumed it, each rank's request returns, which is the rank's licence to free or refill that
buffer. SGLang replies to an update before its copy has finished (slime update_weight_from_tensor.py
:39-47), so buffer lifetime is tied to this ack, never to a timer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from enum import StrEnum

from ..engines.base import RankPayload, WeightsLoad
from .engine_ops import EngineHandle
from .errors import ChunkTimeout, TransitionRejected, WeightSyncError
from .metrics import Metrics
from .trace import Trace

__all__ = ["ChunkAck", "SessionState", "WeightSession"]


class SessionState(StrEnum):
    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class ChunkAck:
    """Returned to a rank once every engine that needed its chunk has consumed it."""

    seq: int
    rank: int
    engines: tuple[str, ...]
    load_s: float


@dataclass
class _Chunk:
    seq: int
    parts: dict[int, RankPayload] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.perf_counter)
    done: asyncio.Future[float] = field(default_factory=lambda: asyncio.get_running_loop().create_future())


class WeightSession:
    """One weight update across the node's engines. Created after every engine began its update."""

    def __init__(self, *, step: int, version: str, ranks: int, engines: list[EngineHandle], depth: int,
                 chunk_timeout_s: float, trace: Trace, metrics: Metrics,
                 on_finish: Callable[[WeightSession], Awaitable[None]] | None = None) -> None:
        self.id = secrets.token_hex(8)
        self.step = step
        self.version = version
        self.ranks = ranks
        self.engines = engines
        self.depth = depth
        self.chunk_timeout_s = chunk_timeout_s
        self.trace = trace
        self.state = SessionState.OPEN
        self.error: str | None = None
        self.closed = False  # the daemon has ended the engines' update sessions for this one
        self.bytes_loaded = 0
        self.chunks_loaded = 0
        self._metrics = metrics
        self._chunks: dict[int, _Chunk] = {}
        self._next_dispatch = 0
        self._acked = 0  # chunks [0, _acked) are consumed by every engine
        self._window = asyncio.Condition()
        self._in_flight: set[asyncio.Task[None]] = set()
        self._engine_slots = {e.name: asyncio.Semaphore(depth) for e in engines}
        self._max_in_flight = {e.name: 0 for e in engines}
        self._current_in_flight = {e.name: 0 for e in engines}

    # -- the rank-facing side ----------------------------------------------------------------
    async def submit(self, seq: int, part: RankPayload) -> ChunkAck:
        """Accept one rank's part of chunk ``seq``; return once every engine consumed the chunk."""
        self._check_open()
        if not 0 <= part.rank < self.ranks:
            raise TransitionRejected(f"session {self.id}: rank {part.rank} outside 0..{self.ranks - 1}")
        if seq < self._acked:
            raise TransitionRejected(f"session {self.id}: chunk {seq} was already consumed")
        # Backpressure: a rank may not run more than `depth` chunks ahead of the slowest engine.
        async with self._window:
            await self._window.wait_for(lambda: seq < self._acked + self.depth or self.state is not SessionState.OPEN)
        self._check_open()
        chunk = self._chunks.setdefault(seq, _Chunk(seq))
        if part.rank in chunk.parts:
            raise TransitionRejected(f"session {self.id}: rank {part.rank} already sent chunk {seq}")
        chunk.parts[part.rank] = part
        self._dispatch_ready()
        try:
            async with asyncio.timeout(self.chunk_timeout_s):
                load_s = await asyncio.shield(chunk.done)
        except TimeoutError:
            missing = sorted(set(range(self.ranks)) - set(chunk.parts))
            reason = (f"chunk {seq}: ranks {missing} never sent their part within {self.chunk_timeout_s:.1f}s"
                      if missing else f"chunk {seq}: engines did not consume it within {self.chunk_timeout_s:.1f}s")
            await self.fail(ChunkTimeout(reason))
            raise ChunkTimeout(reason) from None
        return ChunkAck(seq, part.rank, tuple(e.name for e in self.engines), load_s)

    def _check_open(self) -> None:
        if self.state is not SessionState.OPEN:
            raise WeightSyncError(f"session {self.id} is {self.state.value}" + (f": {self.error}" if self.error else ""))

    def _dispatch_ready(self) -> None:
        # Chunks go to engines in sequence order, each once all ranks' parts are in.
        while (chunk := self._chunks.get(self._next_dispatch)) is not None and len(chunk.parts) == self.ranks:
            self._next_dispatch += 1
            task = asyncio.get_running_loop().create_task(self._load_everywhere(chunk))
            self._in_flight.add(task)
            task.add_done_callback(self._in_flight.discard)

    async def _load_everywhere(self, chunk: _Chunk) -> None:
        t0 = time.perf_counter()
        try:
            async with asyncio.TaskGroup() as tg:
                for engine in self.engines:
                    tg.create_task(self._load_one(engine, chunk))
        except BaseException as exc:
            error = exc.exceptions[0] if isinstance(exc, BaseExceptionGroup) else exc
            if not chunk.done.done():
                chunk.done.set_exception(WeightSyncError(f"chunk {chunk.seq}: {error}"))
                chunk.done.exception()  # mark retrieved: ranks may already have gone
            if isinstance(error, Exception):
                await self.fail(error)
            if not isinstance(exc, Exception):
                raise
            return
        chunk.done.set_result(time.perf_counter() - t0)
        async with self._window:
            # Acks advance in order; a later chunk finishing first waits for its predecessors.
            while (c := self._chunks.get(self._acked)) is not None and c.done.done():
                del self._chunks[self._acked]
                self._acked += 1
            self._window.notify_all()

    async def _load_one(self, engine: EngineHandle, chunk: _Chunk) -> None:
        tp = engine.config.tp_size
        payloads = tuple(chunk.parts[r] for r in range(tp))
        load = WeightsLoad(seq=chunk.seq, payloads=payloads, nbytes=sum(p.nbytes for p in payloads))
        async with self._engine_slots[engine.name]:
            self._current_in_flight[engine.name] += 1
            self._max_in_flight[engine.name] = max(self._max_in_flight[engine.name],
                                                   self._current_in_flight[engine.name])
            try:
                with self.trace.span("load_chunk", engine.name, seq=chunk.seq, nbytes=load.nbytes):
                    await engine.adapter.load_weights(load)
            finally:
                self._current_in_flight[engine.name] -= 1
        self.bytes_loaded += load.nbytes
        self.chunks_loaded += 1
        self._metrics.weight_bytes.labels(engine.name, payloads[0].transport).inc(load.nbytes)
        self._metrics.weight_chunks.labels(engine.name).inc()

    # -- the daemon-facing side --------------------------------------------------------------
    async def drain(self, num_chunks: int | None) -> None:
        """Wait until every dispatched chunk is consumed; check the count the trainer says it sent."""
        self._check_open()
        if self._chunks:
            pending = sorted(self._chunks)
            incomplete = {s: sorted(set(range(self.ranks)) - set(c.parts)) for s, c in self._chunks.items()
                          if len(c.parts) < self.ranks}
            if incomplete:
                raise WeightSyncError(f"session {self.id}: chunks missing ranks at commit: {incomplete}")
            await asyncio.gather(*(self._chunks[s].done for s in pending if s in self._chunks),
                                 return_exceptions=True)
        if self._in_flight:
            await asyncio.gather(*self._in_flight, return_exceptions=True)
        self._check_open()
        if num_chunks is not None and num_chunks != self._acked:
            raise WeightSyncError(f"session {self.id}: trainer says {num_chunks} chunks, engines consumed {self._acked}")

    async def fail(self, error: BaseException) -> None:
        """Stop the session: cancel in-flight loads, fail every waiting rank. Idempotent."""
        if self.state is not SessionState.OPEN:
            return
        self.state = SessionState.FAILED if not isinstance(error, _Abort) else SessionState.ABORTED
        self.error = str(error)
        for task in list(self._in_flight):
            if task is not asyncio.current_task():
                task.cancel()
        for chunk in self._chunks.values():
            if not chunk.done.done():
                chunk.done.set_exception(WeightSyncError(f"session {self.id} {self.state.value}: {error}"))
                chunk.done.exception()
        async with self._window:
            self._window.notify_all()

    async def abort(self, reason: str) -> None:
        await self.fail(_Abort(reason))

    def stats(self) -> dict[str, object]:
        return {"id": self.id, "step": self.step, "version": self.version, "state": self.state.value,
                "ranks": self.ranks, "depth": self.depth, "chunks_consumed": self._acked,
                "bytes_loaded": self.bytes_loaded, "max_in_flight": dict(self._max_in_flight),
                "error": self.error}


class _Abort(WeightSyncError):
    """The trainer (or shutdown) abandoned the session."""


