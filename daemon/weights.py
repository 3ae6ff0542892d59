"""The weight stream: gather each chunk from the trainer ranks, load it into every engine, ack the ranks.

Data path: rank r POSTs chunk k's descriptor → as soon as the ranks one engine needs (its TP rank t
is fed by trainer rank ``sources[t]``) have sent chunk k, the chunk goes to that engine, in sequence
order and with at most ``depth`` chunks in flight per engine → when every engine that needed rank
r's part has consumed it, rank r's request returns, which is the rank's licence to free or refill
that buffer. SGLang replies to an update before its copy has finished (slime
update_weight_from_tensor.py:39-47), so buffer lifetime is tied to this ack, never to a timer.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

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
    """Returned to a rank once every engine that needed its part of a chunk has consumed it."""

    seq: int
    rank: int
    engines: tuple[str, ...]
    load_s: float


@dataclass
class _Chunk:
    """One chunk while it is being gathered and loaded; dropped once every engine consumed it."""

    seq: int
    consumed: dict[str, asyncio.Future[float]]  # per engine: seconds its load took
    parts: dict[int, RankPayload] = field(default_factory=dict)


@dataclass
class _Lane:
    """One engine's view of the stream: which ranks feed it, what it has been sent, what is in flight."""

    engine: EngineHandle
    sources: tuple[int, ...]  # trainer rank feeding each of the engine's TP ranks, in TP-rank order
    next_seq: int = 0  # chunks go to an engine strictly in sequence order
    in_flight: int = 0
    max_in_flight: int = 0

    @property
    def name(self) -> str:
        return self.engine.name


class WeightSession:
    """One weight update across the node's engines. Created after every engine began its update.

    ``sources`` maps an engine name to the trainer rank of each of its TP ranks; by default TP rank
    t is fed by trainer rank t.
    """

    def __init__(
        self,
        *,
        step: int,
        version: str,
        ranks: int,
        engines: list[EngineHandle],
        depth: int,
        chunk_timeout_s: float,
        trace: Trace,
        metrics: Metrics,
        sources: Mapping[str, tuple[int, ...]] | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
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
        self._lanes = [_Lane(e, self._sources_of(e, sources)) for e in engines]
        self._users: dict[int, tuple[_Lane, ...]] = {
            r: tuple(lane for lane in self._lanes if r in lane.sources) for r in range(ranks)
        }
        self._chunks: dict[int, _Chunk] = {}
        self._acked = 0  # chunks [0, _acked) are complete and consumed by every engine
        self._window = asyncio.Condition()
        self._in_flight: set[asyncio.Task[None]] = set()

    def _sources_of(self, engine: EngineHandle, sources: Mapping[str, tuple[int, ...]] | None) -> tuple[int, ...]:
        tp = int(engine.config.tp_size)
        chosen = tuple(sources[engine.name]) if sources and engine.name in sources else tuple(range(tp))
        if len(chosen) != tp or not all(0 <= r < self.ranks for r in chosen):
            raise TransitionRejected(
                f"engine {engine.name!r} has tp_size {tp} and needs that many trainer ranks "
                f"in 0..{self.ranks - 1}; got {list(chosen)}"
            )
        return chosen

    # -- the rank-facing side ----------------------------------------------------------------
    async def submit(self, seq: int, part: RankPayload) -> ChunkAck:
        """Accept one rank's part of chunk ``seq``; return once every engine that needs it consumed it."""
        self._check_open()
        if not 0 <= part.rank < self.ranks:
            raise TransitionRejected(f"session {self.id}: rank {part.rank} outside 0..{self.ranks - 1}")
        if seq < self._acked:
            raise TransitionRejected(f"session {self.id}: chunk {seq} was already consumed")
        # Backpressure: no rank runs more than `depth` chunks ahead of the slowest engine or the
        # slowest rank; the request just waits, bounded by the chunk timeout.
        try:
            async with asyncio.timeout(self.chunk_timeout_s), self._window:
                await self._window.wait_for(
                    lambda: seq < self._acked + self.depth or self.state is not SessionState.OPEN
                )
        except TimeoutError:
            error = ChunkTimeout(self._explain_window(seq))
            await self.fail(error)
            raise error from None
        self._check_open()
        chunk = self._chunks.get(seq)
        if chunk is None:
            loop = asyncio.get_running_loop()
            chunk = self._chunks[seq] = _Chunk(seq, {lane.name: loop.create_future() for lane in self._lanes})
        if part.rank in chunk.parts:
            raise TransitionRejected(f"session {self.id}: rank {part.rank} already sent chunk {seq}")
        users = self._users[part.rank]
        await self._check_device(seq, part, users)
        chunk.parts[part.rank] = part
        self._pump()
        try:
            async with asyncio.timeout(self.chunk_timeout_s):
                # shield: a rank that times out must not cancel the engines' shared result.
                loads = await asyncio.shield(asyncio.gather(*(chunk.consumed[lane.name] for lane in users)))
        except TimeoutError:
            error = ChunkTimeout(self._explain_stall(seq, users))
            await self.fail(error)
            raise error from None
        await self._advance()
        return ChunkAck(seq, part.rank, tuple(lane.name for lane in users), max(loads, default=0.0))

    def _check_open(self) -> None:
        if self.state is not SessionState.OPEN:
            raise WeightSyncError(
                f"session {self.id} is {self.state.value}" + (f": {self.error}" if self.error else "")
            )

    async def _check_device(self, seq: int, part: RankPayload, users: tuple[_Lane, ...]) -> None:
        """A GPU handle must land on the GPU of the engine TP rank it feeds: a mismatch is an error, never a
        silent cross-device copy. Only checked where both sides are known (handle and engine config)."""
        uuid = part.handle.get("device_uuid")
        if not isinstance(uuid, str):
            return
        for lane in users:
            expected = list(lane.engine.config.gpu_uuids or ())
            for tp_rank, rank in enumerate(lane.sources):
                if rank == part.rank and tp_rank < len(expected) and expected[tp_rank] != uuid:
                    error = WeightSyncError(
                        f"chunk {seq}: trainer rank {rank} exported it from GPU {uuid}, but engine "
                        f"{lane.name!r} TP rank {tp_rank} runs on GPU {expected[tp_rank]}; "
                        "CUDA IPC needs both on one GPU"
                    )
                    await self.fail(error)
                    raise error

    def _explain_window(self, seq: int) -> str:
        """Name why chunk ``seq`` may not enter the window: the oldest chunk lacks a rank, or an engine."""
        oldest = self._chunks.get(self._acked)
        missing = sorted(set(range(self.ranks)) - set(oldest.parts)) if oldest is not None else []
        budget = f"within {self.chunk_timeout_s:.1f}s"
        if oldest is None or missing:
            ranks = ", ".join(map(str, missing)) if missing else "every rank"
            return (
                f"chunk {seq}: the window is {self.depth} chunks past chunk {self._acked}, which "
                f"rank{'s' if len(missing) != 1 else ''} {ranks} never sent {budget}"
            )
        slow = [name for name, done in oldest.consumed.items() if not done.done()]
        return f"chunk {seq}: the window waits for chunk {self._acked}, which engines {slow} did not consume {budget}"

    def _explain_stall(self, seq: int, users: tuple[_Lane, ...]) -> str:
        """Name what chunk ``seq`` waits for: a rank's missing part (here or earlier), or an engine."""
        budget = f"within {self.chunk_timeout_s:.1f}s"
        for lane in users:
            blocking = self._chunks.get(lane.next_seq)
            if lane.next_seq <= seq and blocking is not None:
                missing = sorted(r for r in lane.sources if r not in blocking.parts)
                if missing:
                    return (
                        f"chunk {seq}: engine {lane.name!r} is waiting for chunk {blocking.seq} from "
                        f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, "
                        f"which never sent it {budget}"
                    )
        chunk = self._chunks.get(seq)
        slow = [lane.name for lane in users if chunk is not None and not chunk.consumed[lane.name].done()]
        return f"chunk {seq}: engines {slow} did not consume it {budget}"

    def _pump(self) -> None:
        """Start every load that is ready: in order per engine, its ranks' parts in, under its depth."""
        for lane in self._lanes:
            while (
                lane.in_flight < self.depth
                and (chunk := self._chunks.get(lane.next_seq)) is not None
                and all(r in chunk.parts for r in lane.sources)
            ):
                lane.next_seq += 1
                lane.in_flight += 1
                lane.max_in_flight = max(lane.max_in_flight, lane.in_flight)
                task = asyncio.get_running_loop().create_task(self._load(lane, chunk))
                self._in_flight.add(task)
                task.add_done_callback(self._in_flight.discard)

    async def _load(self, lane: _Lane, chunk: _Chunk) -> None:
        payloads = tuple(chunk.parts[r] for r in lane.sources)
        load = WeightsLoad(seq=chunk.seq, payloads=payloads, nbytes=sum(p.nbytes for p in payloads))
        done = chunk.consumed[lane.name]
        t0 = time.perf_counter()
        try:
            with self.trace.span("load_chunk", lane.name, seq=chunk.seq, nbytes=load.nbytes):
                await lane.engine.adapter.load_weights(load)
        except BaseException as exc:
            lane.in_flight -= 1
            if not done.done():
                done.set_exception(WeightSyncError(f"chunk {chunk.seq} on engine {lane.name!r}: {exc}"))
                done.exception()  # retrieved: the ranks waiting on it may already be gone
            if isinstance(exc, Exception):
                await self.fail(exc)
                return
            raise
        lane.in_flight -= 1
        self.bytes_loaded += load.nbytes
        self.chunks_loaded += 1
        self._metrics.weight_bytes.labels(lane.name, payloads[0].transport).inc(load.nbytes)
        self._metrics.weight_chunks.labels(lane.name).inc()
        if not done.done():
            done.set_result(time.perf_counter() - t0)
        if self.state is SessionState.OPEN:
            self._pump()
        await self._advance()

    async def _advance(self) -> None:
        """Drop chunks that every rank sent and every engine consumed, in order; wake waiting ranks."""
        moved = False
        while (
            (c := self._chunks.get(self._acked)) is not None
            and len(c.parts) == self.ranks
            and all(f.done() and not f.cancelled() and f.exception() is None for f in c.consumed.values())
        ):
            del self._chunks[self._acked]
            self._acked += 1
            moved = True
        if moved:
            async with self._window:
                self._window.notify_all()

    # -- the daemon-facing side --------------------------------------------------------------
    async def drain(self, num_chunks: int | None) -> None:
        """Wait until every chunk is complete and consumed; check the count the trainer says it sent.

        A rank that never sends its part of a chunk is waited for one chunk timeout, then named.
        """
        self._check_open()
        try:
            async with asyncio.timeout(self.chunk_timeout_s), self._window:
                await self._window.wait_for(lambda: not self._chunks or self.state is not SessionState.OPEN)
        except TimeoutError:
            incomplete = {
                s: sorted(set(range(self.ranks)) - set(c.parts))
                for s, c in sorted(self._chunks.items())
                if len(c.parts) < self.ranks
            }
            reason = (
                f"at commit: chunks missing ranks {incomplete} after {self.chunk_timeout_s:.1f}s"
                if incomplete
                else f"at commit: engines did not consume chunks {sorted(self._chunks)} "
                f"within {self.chunk_timeout_s:.1f}s"
            )
            await self.fail(ChunkTimeout(reason))
            raise ChunkTimeout(reason) from None
        self._check_open()
        if num_chunks is not None and num_chunks != self._acked:
            raise WeightSyncError(
                f"session {self.id}: trainer says {num_chunks} chunks, engines consumed {self._acked}"
            )

    async def fail(self, error: BaseException) -> None:
        """Stop the session: cancel in-flight loads, fail every waiting rank. Idempotent."""
        if self.state is not SessionState.OPEN:
            return
        self.state = SessionState.ABORTED if isinstance(error, _Abort) else SessionState.FAILED
        self.error = str(error)
        for task in list(self._in_flight):
            if task is not asyncio.current_task():
                task.cancel()
        for chunk in self._chunks.values():
            for done in chunk.consumed.values():
                if not done.done():
                    done.set_exception(WeightSyncError(f"session {self.id} {self.state.value}: {error}"))
                    done.exception()
        async with self._window:
            self._window.notify_all()

    async def abort(self, reason: str) -> None:
        """Abandon the session (trainer's request or shutdown); engines keep their old version."""
        await self.fail(_Abort(reason))

    def stats(self) -> dict[str, Any]:
        """What the session did so far; ``max_in_flight`` is the most chunks one engine had at once."""
        return {
            "id": self.id,
            "step": self.step,
            "version": self.version,
            "state": self.state.value,
            "ranks": self.ranks,
            "depth": self.depth,
            "chunks_consumed": self._acked,
            "bytes_loaded": self.bytes_loaded,
            "max_in_flight": {ln.name: ln.max_in_flight for ln in self._lanes},
            "sources": {ln.name: list(ln.sources) for ln in self._lanes},
            "open_chunks": sorted(self._chunks),
            "error": self.error,
        }


class _Abort(WeightSyncError):
    """The trainer (or shutdown) abandoned the session."""
