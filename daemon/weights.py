"""One weight session: gather each chunk from the trainer ranks, load it into every engine, ack the ranks.

Layout: each engine TP rank is fed by one trainer rank: the one that joined on the TP rank's device (a GPU UUID,
or ``cpu:<n>``), or the engine's ``feed_ranks``, or, where its devices are unknown, trainer rank t for TP rank t.
A layout that leaves an engine device unfed is refused at the last join, naming the device.

Data path: once the ranks one engine needs have sent chunk k, it goes to that engine, in sequence order, at most
``depth`` in flight per engine; a rank's request returns once every engine that needed its part consumed it: its
licence to reuse that buffer (SGLang answers before its copy finished, slime update_weight_from_tensor.py:39-47,
so buffer lifetime follows this ack, never a timer).

Deadlines: a rank has until the start deadline (``start_timeout_s``) to join and send a first chunk, then each
chunk must complete within ``chunk_timeout_s``; every chunk renews the lease (``idle_s``). A session never closes
while an engine call it issued runs: ``quiesce`` waits, and names the engines whose calls it had to abandon.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from ..engines.base import ChunkLoad, ChunkPart
from ..engines.chunks import ChunkLayout
from ..engines.handles import ShmRoute
from ..engines.httpmap import refused_payload
from ..errors import ChunkTimeout, PayloadRejected, RequestInvalid, SessionGone, TransitionRejected, WeightSyncError
from ..policies import Transport, VerifyMode
from .manifests import Manifest, TensorMeta, misfits
from .metrics import Metrics
from .states import SessionState, WeightsState, check_session_end, require_session_open
from .trace import Trace
from .verify import ExpectedDigests
from .worker import EngineHandle, load_chunk

__all__ = ["ChunkAck", "RankJoin", "WeightSession", "counted", "device_key", "name_some"]


def name_some(names: Collection[str], limit: int = 5, *, show: Callable[[str], str] = repr, sep: str = ", ") -> str:
    """The first few names (sorted) and how many there are in all: messages stay short for big models."""
    ordered = sorted(names)
    shown = sep.join(show(n) for n in ordered[:limit])
    return shown + (f" and {len(ordered) - limit} more ({len(ordered)} in all)" if len(ordered) > limit else "")


def counted(noun: str, items: Sequence[object], show: Callable[[object], str] = str) -> str:
    """``rank 1`` or ``ranks 1, 2``: the noun, plural where there are several, and the items."""
    return f"{noun}{'s' if len(items) > 1 else ''} {', '.join(map(show, items))}"


@dataclass(frozen=True, slots=True)
class ChunkAck:
    """Returned to a rank once every engine that needed its part of a chunk has consumed it."""

    seq: int
    rank: int
    engines: tuple[str, ...]
    load_s: float


def device_key(device_id: str) -> str:
    """A device identity as compared: NVML spells a GPU UUID ``GPU-<uuid>``, torch (and SGLang) ``<uuid>``."""
    return device_id[4:].lower() if device_id[:4].lower() == "gpu-" else device_id


def is_host_device(device_id: str | None) -> bool:
    return bool(device_id) and str(device_id).lower().split(":", 1)[0] == "cpu"


@dataclass(frozen=True, slots=True)
class RankJoin:
    """What a rank learns when it joins: the engine TP ranks it feeds (none: it must not stream)."""

    session_id: str
    rank: int
    device_id: str
    feeds: tuple[tuple[str, int], ...]  # (engine, TP rank)
    verify: VerifyMode = "off"  # the commit's check (daemon/verify.py): unless off, send digests with each chunk
    transports: tuple[Transport, ...] = ()  # what every engine this rank feeds loads (its chunks must use one)
    depth: int = 1  # the session's window: chunks this rank may have outstanding

    def to_json(self) -> dict[str, Any]:
        return {"session_id": self.session_id, "rank": self.rank, "device_id": self.device_id,
                "streams": bool(self.feeds), "feeds": [{"engine": e, "tp_rank": t} for e, t in self.feeds],
                "verify": self.verify, "transports": [t.value for t in self.transports], "depth": self.depth}


@dataclass
class _Chunk:
    """One chunk while it is being gathered and loaded; dropped once every engine consumed it."""

    seq: int
    consumed: dict[str, asyncio.Future[float]]  # per engine: seconds its load took
    parts: dict[int, ChunkPart] = field(default_factory=dict)
    layouts: dict[int, ChunkLayout] = field(default_factory=dict)


@dataclass
class _Lane:
    """One engine's view of the stream: which ranks feed it, what it has been sent, what is in flight."""

    engine: EngineHandle
    sources: list[int | None]  # the trainer rank feeding each TP rank; None: not joined yet (``by_device``)
    devices: tuple[str, ...] | None  # each TP rank's device identity, where the engine reported it
    by_device: bool  # sources follow the devices the ranks declare (else fixed: feed_ranks, or positional)
    next_seq: int = 0  # chunks go to an engine strictly in sequence order
    in_flight: int = 0
    max_in_flight: int = 0
    loads_started: int = 0  # zero: the engine's weights were never touched by this session
    rank_names: list[set[str]] = field(default_factory=list)  # per TP rank: the tensors it consumed

    @property
    def name(self) -> str:
        return self.engine.name

    @property
    def resolved(self) -> bool:
        return None not in self.sources

    @property
    def names(self) -> set[str]:
        """Tensors every TP rank of this engine consumed."""
        return set.intersection(*self.rank_names) if self.rank_names else set()

    def device(self, tp_rank: int) -> str:
        return self.devices[tp_rank] if self.devices is not None else f"(TP rank {tp_rank})"


class WeightSession:
    """One weight update across the node's engines. ``sources``: engine → the trainer rank of each TP rank, where
    fixed (``feed_ranks``). ``manifest``: what the trainer declared it will send (None: what the layouts carried
    counts). ``complete``: the parameters a complete update covers (None: unknown); ``prior``: each engine's weights
    at open; ``partial``: only some tensors, on intact weights. It ends and is closed once (``check_session_end``)."""

    def __init__(self, *, step: int, version: str, ranks: int, engines: list[EngineHandle], depth: int,
                 chunk_timeout_s: float, trace: Trace, metrics: Metrics,
                 sources: Mapping[str, tuple[int, ...]] | None = None, manifest: Manifest | None = None,
                 manifest_ref: str | None = None, complete: Manifest | None = None, partial: bool = False,
                 prior: Mapping[str, WeightsState] | None = None, verify: VerifyMode = "off",
                 idle_s: float | None = None, start_timeout_s: float | None = None) -> None:
        self.id = secrets.token_hex(8)
        self.step, self.version, self.ranks, self.engines, self.depth = step, version, ranks, engines, depth
        self.chunk_timeout_s, self.idle_s, self.start_timeout_s = chunk_timeout_s, idle_s, start_timeout_s
        self.trace, self.partial, self.verify, self.complete = trace, partial, verify, complete
        self.manifest = manifest  # shared with later sessions that name it by reference: never changed
        self.manifest_ref = manifest_ref
        self.opened_at = time.monotonic()
        self.start_deadline = None if start_timeout_s is None else self.opened_at + start_timeout_s
        self._state, self._closed = SessionState.OPEN, False
        self.error: str | None = None
        self._ended_by: str | None = None  # "failed: ChunkTimeout: ..." once it ended
        self.tainted: list[str] = []  # engines whose calls had to be abandoned when it closed
        self.prior = dict(prior or {})  # each engine's weights at open: what a close leaves an untouched one
        self.expected = ExpectedDigests()  # the digests the trainer sent beside its chunks
        self.bytes_loaded = self.chunks_loaded = 0
        self.shm_names: set[str] = set()  # segments the trainer named: unlinked if the session expires
        self.trainer_pids: set[int] = set()  # the trainer's processes, as proven (engines/segments.py)
        self.delivered: Manifest = {}  # every tensor a chunk layout carried, with its dtype and shape
        self._metrics = metrics
        self._lanes = [self._lane_of(e, sources) for e in engines]
        self._devices: dict[int, str] = {}  # rank → the device it declared when it joined
        self._broadcasting = False  # a broadcast fed every engine: no rank is late to start
        self.broadcast_stats: dict[str, int] | None = None  # broadcasts that every engine loaded, and their bytes
        self._plans: dict[int, tuple[int, tuple[tuple[str, str, tuple[int, ...]], ...]]] = {}  # seq → first rank's
        self._chunks: dict[int, _Chunk] = {}
        self._acked = 0  # chunks [0, _acked) are complete and consumed by every engine
        self._received: dict[int, set[int]] = {r: set() for r in range(ranks)}  # per rank: the chunks it sent
        self._rank_next = dict.fromkeys(range(ranks), 0)  # per rank: the first chunk not received from it
        self._window = asyncio.Condition()
        self._in_flight: dict[asyncio.Task[None], str] = {}  # load task → engine name
        self._requests = 0  # rank requests being served: a session with one is never idle
        self.last_activity = time.monotonic()

    def _lane_of(self, engine: EngineHandle, sources: Mapping[str, tuple[int, ...]] | None) -> _Lane:
        tp = int(engine.config.tp_size)
        devices = engine.tp_devices
        fixed = sources.get(engine.name) if sources else None
        if fixed is None and devices is None:
            fixed = tuple(range(tp))  # devices unknown: TP rank t is fed by trainer rank t
        if fixed is not None and (len(fixed) != tp or not all(0 <= r < self.ranks for r in fixed)):
            raise RequestInvalid(
                f"engine {engine.name!r} has tp_size {tp} and is fed by trainer ranks {list(fixed)}, which must be "
                f"{tp} rank(s) in 0..{self.ranks - 1}: open the session with more ranks, or fix its feed_ranks",
                field="ranks")
        return _Lane(engine, list(fixed) if fixed is not None else [None] * tp, devices, by_device=fixed is None,
                     rank_names=[set() for _ in range(tp)])

    # -- the layout: who feeds whom ------------------------------------------------------------
    async def join(self, rank: int, device_id: str) -> RankJoin:
        """Rank ``rank`` declares its device: it feeds the engine TP ranks on that device (and any whose
        ``feed_ranks`` name it); joining twice alike is a no-op. The last join is refused (422 naming the device)
        when it would leave an engine TP rank unfed; like every refusal it changes nothing."""
        self._check_open()
        if not 0 <= rank < self.ranks:
            raise self._refuse(f"rank {rank} outside 0..{self.ranks - 1}", field="rank")
        if not device_id or len(device_id) > 256:
            raise self._refuse(f"rank {rank}: device_id must be 1..256 characters", field="device_id")
        known = self._devices.get(rank)
        if known is not None and known != device_id:
            raise TransitionRejected(f"session {self.id}: rank {rank} joined on device {known!r}, not {device_id!r}")
        if known is None:
            slots = [(lane, t) for lane in self._lanes if lane.by_device
                     for t in range(len(lane.sources)) if device_key(lane.device(t)) == device_key(device_id)]
            taken = next((lane.sources[t] for lane, t in slots if lane.sources[t] is not None), None)
            if taken is not None:
                raise self._refuse(
                    f"rank {rank} declares device {device_id!r}, which rank {taken} declared "
                    "already; each engine device is fed by one trainer rank (declare each rank's own device)",
                    field="device_id")
            before = self._lane_sources()
            self._devices[rank] = device_id
            for lane, t in slots:
                lane.sources[t] = rank
            if len(self._devices) == self.ranks:
                self._feed_gpus_from_host_ranks()
                if unserved := self._unserved():
                    declared = ", ".join(f"rank {r}: {d!r}" for r, d in sorted(self._devices.items()))
                    self._unjoin(rank, before)
                    raise self._refuse(
                        f"layout cannot be served: {unserved}, with every rank joined "
                        f"({declared}); rank {rank}'s join is refused and the session stays open: join it on that "
                        "device (CPU: WeightPusher(device_id=...), matching the engine's device_ids), map the "
                        "ranks in the node config (the engine's feed_ranks), or abort the session",
                        field="device_id")
            self.touch()
        feeds = tuple((lane.name, t) for lane in self._lanes for t, r in enumerate(lane.sources) if r == rank)
        return RankJoin(self.id, rank, device_id, feeds, self.verify,
                        self.transports(self._users_of(rank)), self.depth)

    def _lane_sources(self) -> list[list[int | None]]:
        return [list(lane.sources) for lane in self._lanes]

    def _unjoin(self, rank: int, sources: list[list[int | None]]) -> None:
        del self._devices[rank]
        for lane, before in zip(self._lanes, sources, strict=True):
            lane.sources[:] = before

    def _feed_gpus_from_host_ranks(self) -> None:
        """Once every rank joined: an engine TP rank t on a GPU no rank declared is fed by trainer rank t when that
        rank is on the host (``cpu``): host bytes travel by shared memory or disk, which any GPU engine reads."""
        for lane in self._lanes:
            if not lane.by_device:
                continue
            for t, source in enumerate(lane.sources):
                if source is None and not is_host_device(lane.device(t)) and t < self.ranks \
                        and is_host_device(self._devices.get(t, "")):
                    lane.sources[t] = t

    def _unserved(self) -> str:
        """The engine TP ranks no trainer rank feeds yet, described by device; empty when every one is fed."""
        gaps = [f"engine {lane.name!r} TP rank {t} on device {lane.device(t)!r} has no trainer rank on it"
                for lane in self._lanes for t, r in enumerate(lane.sources) if r is None]
        return name_some(gaps, 4, show=str, sep="; ")

    def transports(self, lanes: Sequence[_Lane] | None = None) -> tuple[Transport, ...]:
        lanes = self._lanes if lanes is None else lanes
        return tuple(t for t in Transport if all(t in lane.engine.transports for lane in lanes))

    def _check_transport(self, seq: int, part: ChunkPart, users: tuple[_Lane, ...]) -> None:
        """A chunk goes only to engines that load its transport, else 422 before any engine sees it: SGLang
        unpickles whatever it is sent in its scheduler, and one it cannot load kills the whole server."""
        for lane in users:
            accepted = lane.engine.transports
            if part.transport not in {t.wire for t in accepted}:
                names = ", ".join(t.value for t in Transport if t in accepted) or "none"
                raise self._refuse(
                    f"chunk {seq} from rank {part.rank} travels by {part.transport}, which engine "
                    f"{lane.name!r} does not load (it accepts: {names}); nothing was sent to any engine: send it by "
                    "one of those (the join reply's transports)", field="transport")

    def _users_of(self, rank: int) -> tuple[_Lane, ...]:
        return tuple(lane for lane in self._lanes if rank in lane.sources)

    def _unjoined(self) -> list[int]:
        return [r for r in range(self.ranks) if r not in self._devices]

    def _late(self) -> list[int]:
        """Ranks the session waits on to start: sources that sent no chunk yet, and, while an engine TP rank is
        unfed, the ranks that have not joined."""
        if self._broadcasting:
            return []
        late = {r for lane in self._lanes for r in lane.sources if r is not None and not self._received[r]}
        if not all(lane.resolved for lane in self._lanes):
            late.update(self._unjoined())
        return sorted(late)

    def start_overdue(self) -> ChunkTimeout | None:
        deadline = self.start_deadline
        if deadline is None or self.state is not SessionState.OPEN or time.monotonic() <= deadline:
            return None
        late = self._late()
        return self._start_timeout(late) if late else None

    def _start_timeout(self, late: list[int]) -> ChunkTimeout:
        budget = self.start_timeout_s or 0.0
        unserved = self._unserved()
        return ChunkTimeout(
            f"session {self.id}: {counted('rank', late)} did not start (join "
            f"and send a first chunk) within start_s={budget:.1f}s of the session's open"
            + (f"; {unserved}" if unserved else ""),
            stage="start", budget_s=budget, rank=late[0])

    # -- the lifecycle (states.check_session_end) -----------------------------------------------
    @property
    def state(self) -> SessionState:
        return self._state

    @property
    def closed(self) -> bool:
        return self._closed

    def _end(self, target: SessionState) -> None:
        check_session_end(self.id, self._state, self._closed, target)
        self._state, self._closed = target, target is SessionState.COMMITTED

    def commit(self) -> None:
        self._end(SessionState.COMMITTED)

    def close(self) -> bool:
        """The daemon is ending the engines' updates for this ended session; False if it already did."""
        if not check_session_end(self.id, self._state, self._closed, None):
            return False
        self._closed = True
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
        """The lease ran out; never while a rank is within its start deadline (it is late, not gone)."""
        if self.idle_s is None or self.state is not SessionState.OPEN or self.idle_for() <= self.idle_s:
            return False
        deadline = self.start_deadline
        return deadline is None or time.monotonic() > deadline or not self._late()

    # -- the rank-facing side ----------------------------------------------------------------
    async def submit(self, seq: int, part: ChunkPart) -> ChunkAck:
        """Accept one rank's part of chunk ``seq``; return once every engine that needs it consumed it. A refused
        part leaves the session as it was: a rank that did not join joins with its first chunk (on the GPU its
        handle names, else cpu:<rank>) and is unjoined again if that part is refused."""
        self._check_open()
        self._requests += 1
        self.touch()
        sources = None
        try:
            if part.rank not in self._devices:
                sources = self._lane_sources()
                await self.join(part.rank, part.route.device_uuid or f"cpu:{part.rank}")
            return await self._accept(seq, part)
        except BaseException:
            if sources is not None and part.rank in self._devices and not self._received[part.rank]:
                self._unjoin(part.rank, sources)  # refused before it was accepted
            raise
        finally:
            self._requests -= 1
            self.touch()

    async def _accept(self, seq: int, part: ChunkPart) -> ChunkAck:
        users = self._users_of(part.rank)
        if not users:
            raise self._refuse(
                f"rank {part.rank} (device {self._devices[part.rank]!r}) feeds no engine TP rank, "
                "so nobody would load its chunks: it must not stream (its join reply says streams: false)",
                field="rank")
        declared, exported_on = self._devices[part.rank], part.route.device_uuid
        if exported_on is not None and not is_host_device(declared) and device_key(declared) != device_key(exported_on):
            # A CUDA IPC handle opens only on the GPU it was exported from; the engine fed by this rank runs there.
            raise self._refuse(
                f"chunk {seq} from rank {part.rank} was exported on GPU {exported_on}, but the "
                f"rank joined on {declared}: a CUDA IPC handle opens only on its own GPU", field="handle.device_uuid")
        received = self._received[part.rank]
        if seq < self._acked or seq in received:
            raise TransitionRejected(f"session {self.id}: rank {part.rank} already sent chunk {seq}")
        first_missing = self._rank_next[part.rank]
        if seq >= first_missing + self.depth:
            raise self._refuse(
                f"chunk {seq} from rank {part.rank} skips ahead: rank {part.rank} has not "
                f"sent chunk {first_missing}, and a rank may have at most depth={self.depth} chunks outstanding "
                f"(chunks {first_missing}..{first_missing + self.depth - 1}); chunk sequence numbers are "
                "0, 1, 2, ... without gaps", field="seq")
        self._check_transport(seq, part, users)
        layout = self._inspect(seq, part)
        self._check_plan(seq, part.rank, layout)
        received.add(seq)  # from here on a second copy is refused; it counts as the rank's start while it waits
        while self._rank_next[part.rank] in received:
            self._rank_next[part.rank] += 1

        def in_window() -> bool:
            return seq < self._acked + self.depth or self.state is not SessionState.OPEN

        # Backpressure: no rank runs more than `depth` chunks ahead of the slowest engine or the
        # slowest rank; the request just waits, bounded by the chunk timeout.
        if error := await self._wait(lambda: self._held_up(f"chunk {seq} waits for the window ({self.depth} chunks "
                                                           f"from chunk {self._acked})", self._acked, self._lanes),
                                     in_window):
            return await self._fail_with(error)
        self._check_open()
        chunk = self._chunks.get(seq)
        if chunk is None:
            loop = asyncio.get_running_loop()
            chunk = self._chunks[seq] = _Chunk(seq, {lane.name: loop.create_future() for lane in self._lanes})
        await self._check_device(seq, part, users)
        chunk.parts[part.rank] = part
        chunk.layouts[part.rank] = layout
        self.expected.record(part.digests, (t.name for t in layout.tensors))
        if isinstance(part.route, ShmRoute) and part.route.shm_name is not None:
            self.shm_names.add(part.route.shm_name)
        self._pump()
        consumed = [chunk.consumed[lane.name] for lane in users]
        if error := await self._wait(lambda: self._held_up(f"chunk {seq}", seq, users), lambda: _settled(consumed)):
            return await self._fail_with(error)
        loads = [f.result() for f in consumed]
        await self._advance()
        return ChunkAck(seq, part.rank, tuple(lane.name for lane in users), max(loads, default=0.0))

    async def _fail_with(self, error: WeightSyncError | RequestInvalid) -> NoReturn:
        await self.fail(error)
        raise error

    async def _wait(self, blame: Callable[[], WeightSyncError | RequestInvalid],
                    done: Callable[[], bool]) -> WeightSyncError | RequestInvalid | None:
        """Wait until ``done()`` holds (it may raise a load's error; the window's condition wakes it after every
        load and ending) within the chunk budget, or the start deadline while a late rank holds it up. None, or
        the error naming what held it up (``blame``, or the start error)."""
        if done():  # already there (the usual case for the window): no timer and no lock
            return None
        loop = asyncio.get_running_loop()
        until = loop.time() + self.chunk_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(until):
                    async with self._window:
                        await self._window.wait_for(done)
                return None
            except TimeoutError:
                if done():
                    return None
            error = blame()
            deadline = self.start_deadline
            rank = error.rank if isinstance(error, ChunkTimeout) and error.stage == "gather" else None
            late = self._late()
            if deadline is None or rank is None or rank not in late:
                return error
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return self._start_timeout(late)
            until = max(until, loop.time() + remaining)  # a late rank: it has until the start deadline

    def _check_plan(self, seq: int, rank: int, layout: ChunkLayout) -> None:
        """Chunk ``seq`` carries the same tensors (names, dtypes, shapes, in order) from every rank; else 422."""
        plan = tuple((t.name, t.dtype, tuple(t.shape)) for t in layout.tensors)
        first = self._plans.setdefault(seq, (rank, plan))
        if first[0] == rank or first[1] == plan:
            return
        ours, theirs = {p[0]: p for p in plan}, {p[0]: p for p in first[1]}
        missing, extra = sorted(theirs.keys() - ours.keys()), sorted(ours.keys() - theirs.keys())
        if missing or extra:
            why = (f"missing {name_some(missing) if missing else 'none'}, extra {name_some(extra) if extra else 'none'}"
                   f" compared with rank {first[0]}'s")
        else:
            why = f"the same tensors as rank {first[0]}'s, in another order or shape"
        raise self._refuse(
            f"chunk {seq} from rank {rank} carries other tensors than rank {first[0]}'s chunk "
            f"{seq} ({why}): every rank sends the same chunk plan, the full tensors in the same order with the "
            "same bucket size, so each engine TP rank gets every tensor", field="handle.layout")

    def _inspect(self, seq: int, part: ChunkPart) -> ChunkLayout:
        """The handle is readable on this node and its layout agrees with the manifest; else 422."""
        where = f"session {self.id}: chunk {seq} from rank {part.rank}"
        try:
            layout = part.handle.inspect(part.nbytes)
        except RequestInvalid as exc:
            raise RequestInvalid(f"{where}: {exc}", field=exc.field) from None
        self._check_manifest(where, [(t.name, TensorMeta(t.dtype, t.shape)) for t in layout.tensors],
                             field="handle.layout")
        return layout

    def check_broadcast(self, seq: int, tensors: Sequence[tuple[str, TensorMeta]]) -> None:
        """A broadcast's layout agrees with the session's manifest, else 422 before any engine joins it; weights
        then travel by broadcast (separated GPUs): every engine is fed from the group, no rank is late."""
        self._check_open()
        self._check_manifest(f"session {self.id}: broadcast {seq}", tensors, field="names")
        self._broadcasting = True
        self.touch()

    def _check_manifest(self, where: str, tensors: Sequence[tuple[str, TensorMeta]], *, field: str) -> None:
        if self.manifest is None:
            return
        unknown, wrong = misfits(tensors, self.manifest, "the manifest says")
        if unknown:
            raise RequestInvalid(f"{where}: tensors not in the session's manifest: {name_some(unknown)}", field=field)
        if wrong:
            said = name_some(wrong, 3, show=str, sep="; ")
            raise RequestInvalid(f"{where}: layout disagrees with the manifest: {said}", field=field)

    def _refuse(self, message: str, *, field: str) -> RequestInvalid:
        return RequestInvalid(f"session {self.id}: {message}", field=field)

    def _check_open(self) -> None:
        require_session_open(self.id, self.state, error=self.error, advise_new=True)

    async def _check_device(self, seq: int, part: ChunkPart, users: tuple[_Lane, ...]) -> None:
        """A GPU handle lands on the GPU of the engine TP rank it feeds (where both are known), never copied
        across devices behind the trainer's back."""
        uuid = part.route.device_uuid
        if uuid is None:
            return
        for lane in users:
            expected = list(lane.engine.config.gpu_uuids or ())
            for tp_rank, rank in enumerate(lane.sources):
                if rank == part.rank and tp_rank < len(expected) and device_key(expected[tp_rank]) != device_key(uuid):
                    await self._fail_with(WeightSyncError(
                        f"chunk {seq}: trainer rank {rank} exported it from GPU {uuid}, but engine {lane.name!r} TP "
                        f"rank {tp_rank} runs on GPU {expected[tp_rank]}; CUDA IPC needs both on one GPU"))

    def _held_up(self, head: str, seq: int, lanes: Sequence[_Lane]) -> WeightSyncError | RequestInvalid:
        """Why ``lanes`` have not all consumed chunk ``seq`` within the chunk budget, after ``head``: the chunk one
        of them loads next lacks a rank's part, or its trainer rank has not joined, or no rank sent it (a gap in the
        sequence, 422); else the engines that are still loading it."""
        budget = f"within {self.chunk_timeout_s:.1f}s"
        for lane in lanes:
            if lane.next_seq > seq:
                continue  # this engine already has chunk seq in flight
            waiting = f"{head}: engine {lane.name!r} is waiting for chunk {lane.next_seq}"
            blocking = self._chunks.get(lane.next_seq)
            if blocking is None:
                return RequestInvalid(f"{waiting}, which no rank sent {budget}: the trainer's chunk sequence has a "
                                      "gap (sequence numbers are 0, 1, 2, ...)", field="seq")
            missing = sorted(r for r in lane.sources if r is not None and r not in blocking.parts)
            unjoined = self._unjoined() if not lane.resolved else []
            if missing or unjoined:
                who = (f"{counted('rank', missing)}, which never sent it" if missing else
                       f"the trainer rank on device {lane.device(lane.sources.index(None))!r}, which has not joined "
                       f"(not joined yet: {counted('rank', unjoined)})")
                return ChunkTimeout(f"{waiting} from {who} {budget}", stage="gather", budget_s=self.chunk_timeout_s,
                                    engine=lane.name, rank=(missing or unjoined)[0])
        chunk = self._chunks.get(seq)
        slow = [lane.name for lane in lanes if chunk is None or not chunk.consumed[lane.name].done()]
        return ChunkTimeout(f"{head}: {counted('engine', slow, repr) if slow else 'engine (none)'} did not consume "
                            f"it {budget}", stage="load_chunk", budget_s=self.chunk_timeout_s,
                            engine=slow[0] if slow else None)

    def _pump(self) -> None:
        """Start every load that is ready: in order per engine, its ranks' parts in, under its depth."""
        for lane in self._lanes:
            while (
                lane.in_flight < self.depth
                and lane.resolved
                and (chunk := self._chunks.get(lane.next_seq)) is not None
                and all(r in chunk.parts for r in lane.sources)
            ):
                lane.next_seq += 1
                lane.in_flight += 1
                lane.loads_started += 1
                lane.max_in_flight = max(lane.max_in_flight, lane.in_flight)
                task = asyncio.create_task(self._load(lane, chunk))
                self._in_flight[task] = lane.name
                task.add_done_callback(self._forget)

    def _forget(self, task: asyncio.Task[None]) -> None:
        self._in_flight.pop(task, None)
        self.touch()

    async def _load(self, lane: _Lane, chunk: _Chunk) -> None:
        sources = [r for r in lane.sources if r is not None]  # all of them: _pump loads resolved lanes only
        payloads = tuple(chunk.parts[r] for r in sources)
        load = ChunkLoad(seq=chunk.seq, payloads=payloads, nbytes=sum(p.nbytes for p in payloads))
        done = chunk.consumed[lane.name]
        t0 = time.perf_counter()
        try:
            with self.trace.span("load_chunk", lane.name, seq=chunk.seq, nbytes=load.nbytes) as span:
                try:
                    await load_chunk(lane.engine, load, self.id)
                except asyncio.CancelledError:
                    if self._ended_by is not None:  # the session ended first: say how, not "CancelledError"
                        span.attrs["error"] = f"cancelled, the session {self._ended_by}"[:500]
                    raise
        except BaseException as exc:
            lane.in_flight -= 1
            error = _load_error(lane.name, chunk.seq, exc, ended=self._ended_by)
            if not done.done():
                done.set_exception(error)
                done.exception()  # retrieved: the ranks waiting on it may already be gone
            if isinstance(exc, Exception):
                await self.fail(error)
                return
            raise
        lane.in_flight -= 1
        for tp_rank, r in enumerate(sources):
            layout = chunk.layouts.get(r)
            if layout is not None:
                for t in layout.tensors:
                    lane.rank_names[tp_rank].add(t.name)
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
        """Drop the chunks every engine consumed, in order; wake the waiting ranks (a load ended)."""
        while (
            (c := self._chunks.get(self._acked)) is not None
            and all(f.done() and not f.cancelled() and f.exception() is None for f in c.consumed.values())
        ):
            del self._chunks[self._acked]
            self._plans.pop(self._acked, None)
            self._acked += 1
        async with self._window:
            self._window.notify_all()

    def note_delivered(self, tensors: Sequence[tuple[str, TensorMeta]]) -> None:
        """Tensors that reached every engine by a broadcast: they count as sent."""
        for lane in self._lanes:
            for names_of_rank in lane.rank_names:
                names_of_rank.update(name for name, _ in tensors)
        for name, meta in tensors:
            self.delivered.setdefault(name, meta)

    # -- the daemon-facing side --------------------------------------------------------------
    async def drain(self, num_chunks: int | None = None) -> None:
        """Wait until every chunk is complete and consumed (a missing part: one chunk timeout, or the start
        deadline, then 504 naming the rank); a gap or a wrong count is 422 and leaves the session open."""
        self._check_open()
        top = max(self._chunks, default=self._acked)
        if missing := [s for s in range(self._acked, top) if s not in self._chunks]:
            raise self._refuse(f"chunk{'s' if len(missing) > 1 else ''} {missing[:5]} never sent, though chunk {top} "
                               "was: the trainer's chunk sequence has a gap (sequence numbers are 0, 1, 2, ...)",
                               field="num_chunks")

        # With no chunk at all, the completeness check names what each engine lacks.
        if error := await self._wait(lambda: self._held_up(f"at commit: chunk {self._acked}", self._acked, self._lanes),
                                     lambda: not self._chunks or self.state is not SessionState.OPEN):
            await self._fail_with(error)
        self._check_open()
        if num_chunks is not None and num_chunks != self._acked:
            raise self._refuse(
                f"the trainer says {num_chunks} chunks, the engines consumed {self._acked} "
                f"(chunks 0..{self._acked - 1}); nothing committed, the session stays open", field="num_chunks")

    def check_complete(self) -> None:
        """Refuse a commit that would leave an engine serving mixed weights (422; the session stays open)."""
        for lane in self._lanes:
            sent = lane.names
            if self.manifest is not None and (unsent := [n for n in self.manifest if n not in sent]):
                raise RequestInvalid(
                    f"cannot commit session {self.id}: engine {lane.name!r} never received {name_some(unsent)}, "
                    f"declared in the manifest ({self._unsent_by_tp_rank(lane, unsent)}); every TP rank must "
                    "receive every tensor: send them or abort", field="manifest")
            missing = [] if self.complete is None or self.partial else [n for n in self.complete if n not in sent]
            if missing:
                discarded = self.prior.get(lane.name) is not WeightsState.CLEAN
                raise RequestInvalid(
                    f"cannot commit session {self.id}: engine {lane.name!r} has {len(self.complete or ())} "
                    f"parameters and {'its weights were discarded, so ' if discarded else ''}a complete update must "
                    f"cover them all on every TP rank; missing {name_some(missing)} "
                    f"({self._unsent_by_tp_rank(lane, missing)}). Send them, or abort "
                    + ("(a partial update needs intact weights)" if discarded
                       else "(open with partial: true to update only some tensors)"), field="manifest")

    def left(self, engine: str) -> WeightsState:
        """The engine's weights once its update ends uncommitted: stale, unless this session never loaded there."""
        lane = next(ln for ln in self._lanes if ln.name == engine)
        untouched = lane.loads_started == 0 and engine not in self.tainted
        return self.prior.get(engine, WeightsState.STALE) if untouched else WeightsState.STALE

    def _unsent_by_tp_rank(self, lane: _Lane, wanted: Collection[str]) -> str:
        """Which of the engine's TP ranks lack which of ``wanted``, and the trainer rank feeding each."""
        gaps = []
        for t, got in enumerate(lane.rank_names):
            lacking = [n for n in wanted if n not in got]
            if lacking:
                source = lane.sources[t]
                fed = f"trainer rank {source}" if source is not None else "no trainer rank"
                gaps.append(f"TP rank {t} (device {lane.device(t)!r}, fed by {fed}) lacks {name_some(lacking, 3)}")
        return "; ".join(gaps)

    async def fail(self, error: BaseException, ended: SessionState = SessionState.FAILED) -> None:
        """End the session (failed, aborted or expired): fail every waiting rank; loads already running are left
        to ``quiesce``. The first ending is the one that counts."""
        if self.state is not SessionState.OPEN:
            return
        self._end(ended)
        self.error = str(error)
        self._ended_by = f"{ended.value}: {type(error).__name__}: {error}"  # what a cancelled load says
        message = f"session {self.id} {ended.value}: {error}"
        for chunk in self._chunks.values():
            for done in chunk.consumed.values():
                if not done.done():
                    # Abandoned on purpose (abort, expiry): 410 to every rank still waiting; failed: 502, or
                    # the caller's 422 where the caller's data failed it (an engine refused a chunk's payload).
                    done.set_exception(
                        RequestInvalid(message, field=error.field) if isinstance(error, RequestInvalid)
                        else WeightSyncError(message) if ended is SessionState.FAILED
                        else SessionGone(message, session_id=self.id, state=ended.value))
                    done.exception()
        async with self._window:
            self._window.notify_all()

    async def quiesce(self, budget_s: float) -> list[str]:
        """Wait up to ``budget_s`` for every engine call this session issued; cancel the rest and return the
        engines they ran on: nothing can be said of those engines' weights."""
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
        await self.fail(WeightSyncError(reason), SessionState.ABORTED)

    async def expire(self) -> None:
        await self.fail(WeightSyncError(f"no chunk for more than its {self.idle_s:.1f}s idle limit (trainer gone?)"),
                        SessionState.EXPIRED)

    def stats(self) -> dict[str, Any]:
        """What the session did so far; ``max_in_flight`` is the most chunks one engine had at once."""
        is_open = self.state is SessionState.OPEN
        return {"id": self.id, "step": self.step, "version": self.version, "state": self.state.value,
                "ranks": self.ranks, "depth": self.depth, "partial": self.partial,
                "manifest_tensors": None if self.manifest is None else len(self.manifest),
                "chunks_consumed": self._acked, "bytes_loaded": self.bytes_loaded,
                "max_in_flight": {ln.name: ln.max_in_flight for ln in self._lanes},
                "sources": {ln.name: list(ln.sources) for ln in self._lanes},  # per TP rank; null: not joined yet
                "devices": {str(r): d for r, d in sorted(self._devices.items())},  # what each joined rank declared
                "late_ranks": self._late() if is_open else [], "start_s": self.start_timeout_s,
                "open_chunks": sorted(self._chunks), "idle_s": self.idle_s,
                "idle_for_s": round(self.idle_for(), 3) if is_open else None,
                "tainted": self.tainted, "error": self.error}


def _load_error(engine: str, seq: int, exc: BaseException, *, ended: str | None = None
                ) -> WeightSyncError | PayloadRejected:
    """An engine's 4xx to a chunk is the caller's payload at fault (422 with the engine's words); a load cancelled
    because the session ended says how it ended (``ended``)."""
    refusal = refused_payload(exc, field="handle", describe=lambda e: f"chunk {seq}: engine {engine!r} refused it: "
                              f"{e.detail}")
    if isinstance(exc, asyncio.CancelledError) and ended is not None:
        return WeightSyncError(f"chunk {seq} on engine {engine!r}: cancelled, the session {ended}")
    return refusal or WeightSyncError(f"chunk {seq} on engine {engine!r}: {exc or type(exc).__name__}")


def _settled(futures: Sequence[asyncio.Future[Any]]) -> bool:
    """Whether every future is done; raises the first error (or cancellation) among those that are."""
    for future in futures:
        if future.done() and (future.cancelled() or future.exception() is not None):
            future.result()
    return all(future.done() for future in futures)
