"""The weight stream: gather each chunk from the trainer ranks, load it into every engine, ack the ranks.

Data path: rank r POSTs chunk k's descriptor → as soon as the ranks one engine needs (its TP rank t
is fed by trainer rank ``sources[t]``) have sent chunk k, the chunk goes to that engine, in sequence
order and with at most ``depth`` chunks in flight per engine → when every engine that needed rank
r's part has consumed it, rank r's request returns, which is the rank's licence to free or refill
that buffer. SGLang replies to an update before its copy has finished (slime
update_weight_from_tensor.py:39-47), so buffer lifetime is tied to this ack, never to a timer.

A session is leased: every chunk renews it, and the daemon expires it after an idle time (a trainer
that died mid-stream). It carries a manifest (names, dtypes, shapes) that every chunk's layout is
checked against, and never closes while an engine call it issued is still running: ``quiesce``
waits for them, and names the engines whose calls had to be abandoned (their weights are tainted).
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import RankPayload, WeightsLoad
from ..engines.chunks import ChunkLayout, HandleError, inspect_handle
from .engine_ops import EngineHandle
from .errors import (
    ChunkTimeout,
    PayloadRejected,
    RequestInvalid,
    SessionGone,
    TransitionRejected,
    WeightSyncError,
    refused_payload,
)
from .metrics import Metrics
from .states import (
    ENDED_AS,
    SessionLifecycle,
    SessionState,
    WeightsState,
    check_session_move,
    closed_from,
    require_session_open,
)
from .trace import Trace

__all__ = [
    "ChunkAck",
    "Manifest",
    "SessionLifecycle",
    "SessionState",
    "TensorMeta",
    "WeightSession",
    "manifest_from_json",
    "manifest_to_json",
    "name_some",
]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a manifest says of one tensor: its dtype (torch short name) and shape."""

    dtype: str
    shape: tuple[int, ...]

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


Manifest = dict[str, TensorMeta]


def manifest_from_json(items: Iterable[Mapping[str, Any]]) -> Manifest:
    """``[{name, dtype, shape}, ...]`` → Manifest; a name listed twice is a ValueError."""
    manifest: Manifest = {}
    for item in items:
        name = str(item["name"])
        if name in manifest:
            raise ValueError(f"tensor {name!r} is listed twice")
        manifest[name] = TensorMeta(str(item["dtype"]), tuple(int(d) for d in item["shape"]))
    return manifest


def manifest_to_json(manifest: Mapping[str, TensorMeta]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": m.dtype, "shape": list(m.shape)} for n, m in sorted(manifest.items())]


def name_some(names: Collection[str], limit: int = 5) -> str:
    """The first few names (sorted) and how many there are in all: messages stay short for big models."""
    ordered = sorted(names)
    shown = ", ".join(repr(n) for n in ordered[:limit])
    return shown + (f" and {len(ordered) - limit} more ({len(ordered)} in all)" if len(ordered) > limit else "")


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
    layouts: dict[int, ChunkLayout | None] = field(default_factory=dict)


@dataclass
class _Lane:
    """One engine's view of the stream: which ranks feed it, what it has been sent, what is in flight."""

    engine: EngineHandle
    sources: tuple[int, ...]  # trainer rank feeding each of the engine's TP ranks, in TP-rank order
    next_seq: int = 0  # chunks go to an engine strictly in sequence order
    in_flight: int = 0
    max_in_flight: int = 0
    loads_started: int = 0  # zero: the engine's weights were never touched by this session
    names: set[str] = field(default_factory=set)  # tensors this engine consumed (from layouts)

    @property
    def name(self) -> str:
        return self.engine.name


class WeightSession:
    """One weight update across the node's engines. Created after every engine began its update.

    ``sources`` maps an engine name to the trainer rank of each of its TP ranks; by default TP rank
    t is fed by trainer rank t. ``manifest`` is what the trainer declared it will send (None: not
    declared; then what the chunks' layouts carried is what was sent); ``partial`` says the trainer
    means to update only some tensors, on top of intact weights.

    Its lifecycle (``states.SessionLifecycle``) is its own: it ends once (``commit``, ``abort``, ``fail``,
    ``expire``) and is closed once (``close``), each move checked by ``states.check_session_move``.
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
        manifest: Manifest | None = None,
        partial: bool = False,
        idle_s: float | None = None,
        session_id: str | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self.id = session_id or secrets.token_hex(8)
        self.step = step
        self.version = version
        self.ranks = ranks
        self.engines = engines
        self.depth = depth
        self.chunk_timeout_s = chunk_timeout_s
        self.trace = trace
        self.manifest = manifest
        self.partial = partial
        self.idle_s = idle_s
        self._lifecycle = SessionLifecycle.OPEN
        self.error: str | None = None
        self.tainted: list[str] = []  # engines whose calls had to be abandoned when it closed
        # Set by the daemon at open: each engine's full parameter set (None: unknown) and weights state.
        self.required: dict[str, Manifest | None] = {}
        self.prior: dict[str, WeightsState] = {}
        self.bytes_loaded = 0
        self.chunks_loaded = 0
        self.shm_names: set[str] = set()  # segments the trainer named: unlinked if the session expires
        self.delivered: Manifest = {}  # every tensor a chunk layout carried, with its dtype and shape
        self._layoutless = False  # some part had no visible layout (cuda_ipc, disk)
        self._metrics = metrics
        self._lanes = [_Lane(e, self._sources_of(e, sources)) for e in engines]
        self._users: dict[int, tuple[_Lane, ...]] = {
            r: tuple(lane for lane in self._lanes if r in lane.sources) for r in range(ranks)
        }
        self._chunks: dict[int, _Chunk] = {}
        self._acked = 0  # chunks [0, _acked) are complete and consumed by every engine
        self._rank_next = dict.fromkeys(range(ranks), 0)  # per rank: the first chunk not received from it
        self._rank_ahead: dict[int, set[int]] = {r: set() for r in range(ranks)}  # received, past _rank_next
        self._window = asyncio.Condition()
        self._in_flight: dict[asyncio.Task[None], str] = {}  # load task → engine name
        self._requests = 0  # rank requests being served: a session with one is never idle
        self.last_activity = time.monotonic()

    def _sources_of(self, engine: EngineHandle, sources: Mapping[str, tuple[int, ...]] | None) -> tuple[int, ...]:
        tp = int(engine.config.tp_size)
        chosen = tuple(sources[engine.name]) if sources and engine.name in sources else tuple(range(tp))
        if len(chosen) != tp or not all(0 <= r < self.ranks for r in chosen):
            raise TransitionRejected(
                f"engine {engine.name!r} has tp_size {tp} and needs that many trainer ranks "
                f"in 0..{self.ranks - 1}; got {list(chosen)}"
            )
        return chosen

    # -- the lifecycle -----------------------------------------------------------------------
    @property
    def lifecycle(self) -> SessionLifecycle:
        return self._lifecycle

    @property
    def state(self) -> SessionState:
        """How the session stands for its callers: open, or how it ended."""
        return self._lifecycle.state

    @property
    def closed(self) -> bool:
        """The engines' update sessions were ended for this one (as it committed, or after it ended)."""
        return self._lifecycle.closed

    def _move(self, target: SessionLifecycle) -> None:
        check_session_move(self.id, self._lifecycle, target)
        self._lifecycle = target

    def commit(self) -> None:
        """Record the commit: the daemon has ended every engine's update at this session's version."""
        self._move(SessionLifecycle.COMMITTED)

    def close(self) -> bool:
        """Record that the daemon is ending the engines' updates for this ended session; False if it already
        did (closing is done once). An open session is refused: it must end first."""
        target = closed_from(self.id, self._lifecycle)
        if target is None:
            return False
        self._move(target)
        return True

    # -- the lease ---------------------------------------------------------------------------
    def idle_for(self) -> float:
        """Seconds since the last sign of the trainer; 0 while a rank request or an engine load runs."""
        if self._requests or self._in_flight:
            return 0.0
        return time.monotonic() - self.last_activity

    def touch(self) -> None:
        self.last_activity = time.monotonic()

    def expired(self) -> bool:
        return self.idle_s is not None and self.state is SessionState.OPEN and self.idle_for() > self.idle_s

    # -- the rank-facing side ----------------------------------------------------------------
    async def submit(self, seq: int, part: RankPayload) -> ChunkAck:
        """Accept one rank's part of chunk ``seq``; return once every engine that needs it consumed it."""
        self._check_open()
        self._requests += 1
        self.touch()
        try:
            return await self._submit(seq, part)
        finally:
            self._requests -= 1
            self.touch()

    async def _submit(self, seq: int, part: RankPayload) -> ChunkAck:
        # Everything the caller could have got wrong is refused here, before the part is accepted,
        # and leaves the session as it was (the rank may send a corrected part).
        if not 0 <= part.rank < self.ranks:
            raise RequestInvalid(f"session {self.id}: rank {part.rank} outside 0..{self.ranks - 1}", field="rank")
        if seq < self._acked or seq < self._rank_next[part.rank] or seq in self._rank_ahead[part.rank]:
            raise TransitionRejected(f"session {self.id}: rank {part.rank} already sent chunk {seq}")
        first_missing = self._rank_next[part.rank]
        if seq >= first_missing + self.depth:
            raise RequestInvalid(
                f"session {self.id}: chunk {seq} from rank {part.rank} skips ahead: rank {part.rank} has not "
                f"sent chunk {first_missing}, and a rank may have at most depth={self.depth} chunks outstanding "
                f"(chunks {first_missing}..{first_missing + self.depth - 1}); chunk sequence numbers are "
                "0, 1, 2, ... without gaps", field="seq")
        layout = self._inspect(seq, part)
        self._mark_sent(part.rank, seq)  # received: counts for the gap rule even while it waits below
        # Backpressure: no rank runs more than `depth` chunks ahead of the slowest engine or the
        # slowest rank; the request just waits, bounded by the chunk timeout.
        try:
            async with asyncio.timeout(self.chunk_timeout_s), self._window:
                await self._window.wait_for(
                    lambda: seq < self._acked + self.depth or self.state is not SessionState.OPEN
                )
        except TimeoutError:
            window_error = self._window_timeout(seq)
            await self.fail(window_error)
            raise window_error from None
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
        chunk.layouts[part.rank] = layout
        if part.transport == "shm":
            self.shm_names.add(str(part.handle["shm_name"]))
        self._pump()
        try:
            async with asyncio.timeout(self.chunk_timeout_s):
                # shield: a rank that times out must not cancel the engines' shared result.
                loads = await asyncio.shield(asyncio.gather(*(chunk.consumed[lane.name] for lane in users)))
        except TimeoutError:
            error = self._stall_timeout(seq, users)
            await self.fail(error)
            raise error from None
        await self._advance()
        return ChunkAck(seq, part.rank, tuple(lane.name for lane in users), max(loads, default=0.0))

    def _mark_sent(self, rank: int, seq: int) -> None:
        ahead = self._rank_ahead[rank]
        ahead.add(seq)
        while self._rank_next[rank] in ahead:
            ahead.discard(self._rank_next[rank])
            self._rank_next[rank] += 1

    def _inspect(self, seq: int, part: RankPayload) -> ChunkLayout | None:
        """The handle is readable on this node and its layout agrees with the manifest; else 422."""
        where = f"session {self.id}: chunk {seq} from rank {part.rank}"
        try:
            layout = inspect_handle(part.transport, part.nbytes, part.handle)
        except HandleError as exc:
            raise RequestInvalid(f"{where}: {exc}", field=exc.field) from None
        if layout is None:
            self._layoutless = True
            return None
        if self.manifest is not None:
            unknown = [t.name for t in layout.tensors if t.name not in self.manifest]
            if unknown:
                raise RequestInvalid(f"{where}: tensors not in the session's manifest: {name_some(unknown)}",
                                     field="handle.layout")
            wrong = [f"{t.name!r} is {t.dtype}{list(t.shape)}, the manifest says {self.manifest[t.name].describe()}"
                     for t in layout.tensors
                     if (t.dtype, t.shape) != (self.manifest[t.name].dtype, self.manifest[t.name].shape)]
            if wrong:
                raise RequestInvalid(f"{where}: layout disagrees with the manifest: {'; '.join(wrong[:3])}"
                                     + (f" (and {len(wrong) - 3} more)" if len(wrong) > 3 else ""),
                                     field="handle.layout")
        return layout

    def _check_open(self) -> None:
        require_session_open(self.id, self.state, error=self.error, advise_new=True)

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

    def _window_timeout(self, seq: int) -> ChunkTimeout:
        """Name why chunk ``seq`` may not enter the window: the oldest chunk lacks a rank, or an engine."""
        oldest = self._chunks.get(self._acked)
        missing = sorted(set(range(self.ranks)) - set(oldest.parts)) if oldest is not None else []
        budget = f"within {self.chunk_timeout_s:.1f}s"
        if oldest is None or missing:
            ranks = ", ".join(map(str, missing)) if missing else "any rank"
            return ChunkTimeout(
                f"chunk {seq}: the window is {self.depth} chunks past chunk {self._acked}, which "
                f"rank{'s' if len(missing) != 1 else ''} {ranks} never sent {budget}",
                step="gather", budget_s=self.chunk_timeout_s, rank=missing[0] if missing else None)
        slow = [name for name, done in oldest.consumed.items() if not done.done()]
        return ChunkTimeout(
            f"chunk {seq}: the window waits for chunk {self._acked}, which engine{'s' if len(slow) > 1 else ''} "
            f"{', '.join(map(repr, slow)) or '(none)'} did not consume {budget}",
            step="load_chunk", budget_s=self.chunk_timeout_s, engine=slow[0] if slow else None)

    def _stall_timeout(self, seq: int, users: tuple[_Lane, ...]) -> WeightSyncError | RequestInvalid:
        """Name what chunk ``seq`` waits for: a rank's missing part (here or earlier), a gap in the trainer's
        sequence (the caller's mistake: 422), or an engine that did not consume it."""
        budget = f"within {self.chunk_timeout_s:.1f}s"
        for lane in users:
            if lane.next_seq > seq:
                continue  # this engine already has chunk seq in flight
            blocking = self._chunks.get(lane.next_seq)
            if blocking is None:
                return RequestInvalid(
                    f"chunk {seq}: engine {lane.name!r} is waiting for chunk {lane.next_seq}, which no rank sent "
                    f"{budget}: the trainer's chunk sequence has a gap (sequence numbers are 0, 1, 2, ...)",
                    field="seq")
            missing = sorted(r for r in lane.sources if r not in blocking.parts)
            if missing:
                return ChunkTimeout(
                    f"chunk {seq}: engine {lane.name!r} is waiting for chunk {blocking.seq} from "
                    f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}, "
                    f"which never sent it {budget}", step="gather", budget_s=self.chunk_timeout_s,
                    engine=lane.name, rank=missing[0])
        chunk = self._chunks.get(seq)
        slow = [lane.name for lane in users if chunk is None or not chunk.consumed[lane.name].done()]
        return ChunkTimeout(
            f"chunk {seq}: engine{'s' if len(slow) > 1 else ''} {', '.join(map(repr, slow))} did not consume "
            f"it {budget}", step="load_chunk", budget_s=self.chunk_timeout_s, engine=slow[0] if slow else None)

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
                lane.loads_started += 1
                lane.max_in_flight = max(lane.max_in_flight, lane.in_flight)
                task = asyncio.get_running_loop().create_task(self._load(lane, chunk))
                self._in_flight[task] = lane.name
                task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task, None)
        self.touch()

    async def _load(self, lane: _Lane, chunk: _Chunk) -> None:
        payloads = tuple(chunk.parts[r] for r in lane.sources)
        load = WeightsLoad(seq=chunk.seq, payloads=payloads, nbytes=sum(p.nbytes for p in payloads),
                           session_id=self.id)
        done = chunk.consumed[lane.name]
        t0 = time.perf_counter()
        try:
            with self.trace.span("load_chunk", lane.name, seq=chunk.seq, nbytes=load.nbytes):
                await lane.engine.adapter.load_weights(load)
        except BaseException as exc:
            lane.in_flight -= 1
            error = _load_error(lane.name, chunk.seq, exc)
            if not done.done():
                done.set_exception(error)
                done.exception()  # retrieved: the ranks waiting on it may already be gone
            if isinstance(exc, Exception):
                await self.fail(error)
                return
            raise
        lane.in_flight -= 1
        for r in lane.sources:
            layout = chunk.layouts.get(r)
            if layout is not None:
                for t in layout.tensors:
                    lane.names.add(t.name)
                    self.delivered.setdefault(t.name, TensorMeta(t.dtype, t.shape))
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

    def note_delivered(self, names: Iterable[str], metas: Iterable[TensorMeta] | None = None) -> None:
        """Tensors that reached every engine by another path (a broadcast): they count as sent."""
        listed = list(names)
        for lane in self._lanes:
            lane.names.update(listed)
        if metas is not None:
            for name, meta in zip(listed, metas, strict=False):
                self.delivered.setdefault(name, meta)

    # -- the daemon-facing side --------------------------------------------------------------
    async def drain(self, num_chunks: int | None = None) -> None:
        """Wait until every chunk is complete and consumed; check the count the trainer says it sent.

        A rank that never sends its part of a chunk is waited for one chunk timeout, then named (504). A gap
        in the sequence or a wrong count is the trainer's mistake (422) and leaves the session open.
        """
        self._check_open()
        gap = self._gap()
        if gap is not None:
            raise RequestInvalid(gap, field="num_chunks")
        try:
            async with asyncio.timeout(self.chunk_timeout_s), self._window:
                await self._window.wait_for(lambda: not self._chunks or self.state is not SessionState.OPEN)
        except TimeoutError:
            incomplete = {
                s: sorted(set(range(self.ranks)) - set(c.parts))
                for s, c in sorted(self._chunks.items())
                if len(c.parts) < self.ranks
            }
            if incomplete:
                first_missing = next(iter(incomplete.values()))
                error = ChunkTimeout(f"at commit: chunks missing ranks {incomplete} after {self.chunk_timeout_s:.1f}s",
                                     step="gather", budget_s=self.chunk_timeout_s, rank=first_missing[0])
            else:
                slow = sorted({lane.name for lane in self._lanes if lane.in_flight})
                error = ChunkTimeout(
                    f"at commit: engine{'s' if len(slow) > 1 else ''} {', '.join(map(repr, slow)) or '(none)'} did "
                    f"not consume chunks {sorted(self._chunks)} within {self.chunk_timeout_s:.1f}s",
                    step="load_chunk", budget_s=self.chunk_timeout_s, engine=slow[0] if slow else None)
            await self.fail(error)
            raise error from None
        self._check_open()
        if num_chunks is not None and num_chunks != self._acked:
            raise RequestInvalid(
                f"session {self.id}: the trainer says {num_chunks} chunks, the engines consumed {self._acked} "
                f"(chunks 0..{self._acked - 1}); nothing committed, the session stays open", field="num_chunks")

    def _gap(self) -> str | None:
        """A chunk below the highest one received that no rank ever sent: the trainer skipped it."""
        if not self._chunks:
            return None
        top = max(self._chunks)
        missing = [s for s in range(self._acked, top) if s not in self._chunks]
        if not missing:
            return None
        return (f"session {self.id}: chunk{'s' if len(missing) > 1 else ''} {missing[:5]} never sent, though chunk "
                f"{top} was: the trainer's chunk sequence has a gap (sequence numbers are 0, 1, 2, ...)")

    @property
    def chunks_consumed(self) -> int:
        return self._acked

    def sent_names(self, engine: str) -> set[str] | None:
        """Tensors this engine received, where the daemon can tell (layouts, broadcasts); None if it cannot."""
        lane = next(ln for ln in self._lanes if ln.name == engine)
        if self._layoutless:
            return None if self.manifest is None else set(self.manifest) | lane.names
        return set(lane.names)

    def touched(self, engine: str) -> bool:
        """Whether any load of this session ever started on the engine (its weights may be mixed)."""
        return any(ln.loads_started for ln in self._lanes if ln.name == engine)

    def _lifecycle_state(self) -> SessionState:
        return self.state

    async def fail(self, error: BaseException) -> None:
        """Stop the session: fail every waiting rank; loads already running are left to ``quiesce``."""
        if self.state is not SessionState.OPEN:
            return  # it ended already: the first ending is the one that counts
        self._move(ENDED_AS[SessionState.ABORTED if isinstance(error, _Abort)
                            else SessionState.EXPIRED if isinstance(error, _Expired) else SessionState.FAILED])
        self.error = str(error)
        ended: SessionState = self._lifecycle_state()  # _move changed it; a call keeps mypy from narrowing
        message = f"session {self.id} {ended.value}: {error}"
        for chunk in self._chunks.values():
            for done in chunk.consumed.values():
                if not done.done():
                    # Abandoned on purpose (abort, expiry): 410 to every rank still waiting; failed: 502.
                    done.set_exception(
                        WeightSyncError(message) if ended is SessionState.FAILED
                        else SessionGone(message, session_id=self.id, state=ended.value))
                    done.exception()
        async with self._window:
            self._window.notify_all()

    async def quiesce(self, budget_s: float) -> list[str]:
        """Wait for every engine call this session issued to return, up to ``budget_s``; cancel the rest
        and return the engines they ran on: nothing can be said of those engines' weights."""
        pending = {t: name for t, name in self._in_flight.items() if t is not asyncio.current_task()}
        if not pending:
            return []
        _, still = await asyncio.wait(pending, timeout=budget_s)
        for task in still:
            task.cancel()
        await asyncio.gather(*still, return_exceptions=True)
        return sorted({pending[t] for t in still})

    async def abort(self, reason: str) -> None:
        """Abandon the session (trainer's request or shutdown); engines keep their old version."""
        await self.fail(_Abort(reason))

    async def expire(self) -> None:
        await self.fail(_Expired(f"no chunk for more than its {self.idle_s:.1f}s idle limit (trainer gone?)"))

    def stats(self) -> dict[str, Any]:
        """What the session did so far; ``max_in_flight`` is the most chunks one engine had at once."""
        return {
            "id": self.id,
            "step": self.step,
            "version": self.version,
            "state": self.state.value,
            "ranks": self.ranks,
            "depth": self.depth,
            "partial": self.partial,
            "manifest_tensors": None if self.manifest is None else len(self.manifest),
            "chunks_consumed": self._acked,
            "bytes_loaded": self.bytes_loaded,
            "max_in_flight": {ln.name: ln.max_in_flight for ln in self._lanes},
            "sources": {ln.name: list(ln.sources) for ln in self._lanes},
            "open_chunks": sorted(self._chunks),
            "idle_s": self.idle_s,
            "idle_for_s": round(self.idle_for(), 3) if self.state is SessionState.OPEN else None,
            "tainted": self.tainted,
            "error": self.error,
        }


def _load_error(engine: str, seq: int, exc: BaseException) -> WeightSyncError | PayloadRejected:
    """An engine's 4xx to a chunk is the caller's payload at fault (422 with the engine's words)."""
    refusal = refused_payload(exc, field="handle", describe=lambda e: f"chunk {seq}: engine {engine!r} refused it: "
                              f"{e.detail}")
    return refusal or WeightSyncError(f"chunk {seq} on engine {engine!r}: {exc or type(exc).__name__}")


class _Abort(WeightSyncError):
    """The trainer (or shutdown) abandoned the session."""


class _Expired(WeightSyncError):
    """The session's lease ran out: no chunk within its idle time."""
