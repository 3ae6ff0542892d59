"""The node's weight sessions. The spine, as ``WeightSessions`` reads top down:

    open    admit (node free, engines paused) → declared manifest → ranks → begin on every engine (the worker)
    join    each rank declares its device and learns what it feeds
    chunks  each rank's parts gathered, loaded into every engine, acked (one session: daemon/weights.py)
    commit  drain → complete? → verify (daemon/verify.py) → land: every engine serves the version
    abort   (or failure, expiry) → close: quiesce, discard on every engine, withdraw the version

Beside it: the lease that expires an abandoned session, the one-shot update, broadcasts through a weight-update
group (daemon/distributed.py). Engines move only by the worker, toward a ``WeightsGoal``."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..engines.base import ChunkPart
from ..engines.segments import unlink_session_segments
from ..errors import NotFound, RequestInvalid, TransitionRejected, WeightSyncError
from ..policies import Budget
from ..recent import remember
from .distributed import BroadcastDescriptor, WeightGroups
from .journal import NodeJournal
from .lock import NodeLock
from .manifests import Manifest, ManifestBook, TensorMeta, manifest_from_json, manifest_to_json, misfits, reference_of
from .policy_runtime import PolicyRuntime
from .reconcile import WeightsGoal
from .staging import StagingMemory, staging_memory
from .states import (
    SessionState,
    WeightsState,
    check_can_open_session,
    check_partial_allowed,
    check_session_abortable,
    require_session_open,
)
from .trace import Span, Trace
from .verify import Verification, verify_engines
from .versions import VersionBook
from .weights import ChunkAck, WeightSession, device_key, name_some
from .worker import EngineWorker, late_loads

__all__ = ["SessionContext", "WeightSessions"]

log = logging.getLogger("colocd.daemon")


@dataclass(frozen=True, slots=True)
class SessionContext:
    """What the weight sessions use of the node."""

    worker: EngineWorker
    lock: NodeLock
    versions: VersionBook
    policies: PolicyRuntime
    journal: NodeJournal


class WeightSessions:
    """The node's current (or last) weight session, the ids of ended ones (410), and the reference a complete
    update is checked against."""

    def __init__(self, ctx: SessionContext, groups: WeightGroups, *, journal: str | None = None) -> None:
        self._ctx = ctx
        self.groups = groups  # separated GPUs: daemon/distributed.py
        self.current: WeightSession | None = None
        self._gone: OrderedDict[str, WeightSession] = OrderedDict()  # ended sessions: their ids get 410
        self._closing: dict[str, asyncio.Event] = {}  # sessions being closed now, set once closed
        # The last complete push's tensors: what a complete update must cover, since no engine lists its
        # parameters (kept beside the journal, so it survives a daemon restart).
        self._manifest_file = Path(journal + ".manifest.json") if journal else None
        self.complete_manifest: Manifest | None = None
        self.manifests = ManifestBook()

    def restore(self) -> None:
        """The last complete push's manifest, from beside the journal (an unreadable file is ignored)."""
        if self._manifest_file is None or not self._manifest_file.exists():
            return
        try:
            self.complete_manifest = manifest_from_json(json.loads(self._manifest_file.read_text())["tensors"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("ignoring unreadable %s: %s", self._manifest_file, exc)

    def staging(self) -> StagingMemory:
        w = self._ctx.worker
        return staging_memory(w.engines.values(), w.probe(), self.complete_manifest)

    def open_id(self) -> str | None:
        current = self.current
        return current.id if current is not None and current.state is SessionState.OPEN else None

    def get(self, session_id: str) -> WeightSession:
        if self.current is not None and self.current.id == session_id:
            return self.current
        if (gone := self._gone.get(session_id)) is not None:
            return gone
        raise NotFound(f"no weight session {session_id!r}"
                       + (f" (current: {self.current.id}, {self.current.state.value})" if self.current else ""))

    # -- the spine: open → join → chunks → commit (drain, check, verify, land) | abort ---------------------
    async def open(self, *, step: int | None, version: str, ranks: int | None, depth: int | None = None,
                   manifest: list[dict[str, Any]] | None = None, manifest_ref: str | None = None,
                   partial: bool = False) -> WeightSession:
        """Begin a weight update on every engine (each paused, its weights resident). ``manifest`` is what the
        trainer will send, or ``manifest_ref`` names one an earlier open declared; unless ``partial`` (on clean
        weights only) it must cover each engine's parameters where known. Refusals change nothing."""
        ctx = self._ctx
        trace = Trace(ctx.worker.node.step, "weights")  # before the lock: its spans cover the whole open
        async with ctx.lock.exclusive("open_weights"):
            _lock_span(trace, 0.0)
            trace.step = ctx.worker.node.step
            with trace.span("open_checks"):
                await self.lapse_if_idle()
                self._admit(step, partial)
                declared, ref = self._declared(manifest, manifest_ref)
                ranks = self._check_ranks(ranks)
            if declared is not None:
                with trace.span("manifest_check", tensors=len(declared)):
                    self._check_declared(declared, partial)
            session = self._new_session(trace, version, ranks, depth, declared, ref, partial)
            await self._begin(session)
            return session

    async def join(self, session_id: str, rank: int, device_id: str, pid: int | None = None) -> dict[str, Any]:
        """A rank declares its device (and ``pid``, whose shm segments the session may unlink); the reply lists
        the engine TP ranks it feeds (none: it must not stream)."""
        session = self.get(session_id)
        if pid is not None and session.state is SessionState.OPEN:
            session.trainer_pids.add(pid)
        joined = await session.join(rank, device_id)
        return joined.to_json()

    async def submit_chunk(self, session_id: str, seq: int, part: ChunkPart) -> ChunkAck:
        session = self.get(session_id)
        try:
            return await session.submit(seq, part)  # a rank outside the session is refused as it joins
        finally:
            if session.state not in (SessionState.OPEN, SessionState.COMMITTED):
                await self._finish_failed(session)

    async def commit(self, session_id: str, num_chunks: int | None) -> dict[str, Any]:
        session = self.get(session_id)
        require_session_open(session.id, session.state, error=session.error)
        trace, since = session.trace, session.trace.elapsed_s()
        async with self._ctx.lock.exclusive("commit_weights"):
            _lock_span(trace, since)
            session.touch()
            self.groups.check_settled(session)
            await self._drain(session, num_chunks)
            with trace.span("check_complete"):
                session.check_complete()
            with trace.span("verify", mode=session.verify):
                verification = await self._verify(session)
            await self._land(session)
            return {**session.stats(), "broadcasts": session.broadcast_stats,
                    "engines": {n: e.state.snapshot() for n, e in self._ctx.worker.engines.items()},
                    "verification": verification.to_json(), "trace": trace.to_json()}

    async def abort(self, session_id: str, reason: str = "aborted by trainer") -> dict[str, Any]:
        session = self.get(session_id)
        check_session_abortable(session.id, session.state, session.version, self._ctx.worker.node)
        await session.abort(reason)  # no-op if it already ended (aborted, failed, expired)
        await self._finish_failed(session)
        return session.stats()

    # -- open's steps ------------------------------------------------------------------------------------
    def _admit(self, step: int | None, partial: bool) -> None:
        """The node can take a session now: none open, engines paused with weights resident (clean, for a
        partial one), attached, none still loading an ended session's chunk."""
        ctx, current = self._ctx, self.current
        records = [e.state for e in ctx.worker.engines.values()]
        check_can_open_session(self.open_id(), records, ctx.worker.node,
                               idle_for=current.idle_for() if current is not None else 0.0,
                               idle_s=current.idle_s if current is not None else None)
        node = ctx.worker.node
        if step is not None and step != node.step:
            raise RequestInvalid(f"step {step} is not the node's step {node.step} (phase {node.phase.value}): "
                                 f"a session carries the weights of the node's step; send {node.step} or leave "
                                 "step out", field="step")
        if partial:
            check_partial_allowed(records, node)
        ctx.worker.require_attached()
        for engine in ctx.worker.engines.values():
            if (busy := late_loads(engine)) is not None:
                raise TransitionRejected(busy)

    def _new_session(self, trace: Trace, version: str, ranks: int, depth: int | None, declared: Manifest | None,
                     ref: str | None, partial: bool) -> WeightSession:
        ctx, t, policies = self._ctx, self._ctx.worker.timeouts(), self._ctx.policies
        if not depth:  # chunks in flight per engine: the pipeline policy decides
            # Not capped by the policy's chunk count: that counts its own buckets, and the ranks may send smaller.
            staging = replace(self.staging(), total_bytes=None)
            depth = int(policies.pipeline_plan(policies.active, ctx.worker.transports(), staging).depth)
        session = WeightSession(
            step=ctx.worker.node.step, version=version, ranks=ranks, engines=list(ctx.worker.engines.values()),
            depth=depth, chunk_timeout_s=t.budget(Budget.CHUNK),
            trace=trace, metrics=ctx.worker.metrics, manifest=declared, manifest_ref=ref,
            complete=self.complete_manifest, partial=partial, verify=policies.active.sync.verify,
            prior={n: e.state.weights for n, e in ctx.worker.engines.items()},
            idle_s=t.budget(Budget.SESSION_IDLE), start_timeout_s=t.budget(Budget.START),
            sources=self._feed_ranks())
        trace.attrs["session"] = session.id  # the session's log line and trace name it
        return session

    async def _begin(self, session: WeightSession) -> None:
        ctx = self._ctx
        try:
            await ctx.worker.weights({n: WeightsGoal(session=session.id) for n in ctx.worker.engines},
                                     session.trace, strict=True)
        except BaseException:
            await self._discard(session)
            raise
        if self.current is not None:
            remember(self._gone, self.current.id, self.current, 64)
        if session.manifest is not None and session.manifest_ref is not None:
            self.manifests.remember(session.manifest_ref, session.manifest)  # an open that succeeded names it
        self.current = session
        ctx.versions.opened(session.version, session.id)  # counts while open; engines lag it until commit
        session.touch()

    def _declared(self, manifest: list[dict[str, Any]] | None,
                  ref: str | None) -> tuple[Manifest | None, str | None]:
        """The session's manifest and its reference: parsed from ``manifest``, or the one ``ref`` names; both
        given, they must agree."""
        if manifest is None:
            return (None, None) if ref is None else (self.manifests.resolve(ref), ref)
        try:
            declared = manifest_from_json(manifest)
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestInvalid(f"manifest: {exc}", field="manifest") from None
        own = reference_of(declared)
        if ref is not None and ref != own:
            raise RequestInvalid(f"manifest_ref {ref!r} is not the reference of the manifest sent with it ({own!r}): "
                                 "send one of the two, or both agreeing", field="manifest_ref")
        return declared, own

    def _feed_ranks(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(e.config.feed_ranks) for name, e in self._ctx.worker.engines.items()
                if e.config.feed_ranks is not None}

    def _check_ranks(self, ranks: int | None) -> int:
        """The session's trainer ranks (default: as many as the layout needs: one per TP rank of the widest
        engine, one per engine device fed by device, one past every feed rank); fewer are refused."""
        engines = list(self._ctx.worker.engines.values())
        fixed = self._feed_ranks()
        devices = sorted({device_key(dev) for e in engines if e.name not in fixed and (devs := e.tp_devices)
                          for dev in devs})
        widest = max((int(e.config.tp_size) for e in engines), default=1)
        need = max(widest, len(devices), max((r + 1 for rs in fixed.values() for r in rs), default=1))
        if ranks is None:
            return need
        if ranks < widest:
            raise RequestInvalid(f"ranks={ranks} but engines need {widest} (their largest tp_size)", field="ranks")
        if ranks < len(devices):
            raise RequestInvalid(
                f"ranks={ranks} but the engines run on {len(devices)} devices ({name_some(devices, 8)}), each fed by "
                "the trainer rank on it: open with one rank per device, or map ranks with the engines' feed_ranks",
                field="ranks")
        return ranks

    def _check_declared(self, declared: Manifest, partial: bool) -> None:
        """Refuse a manifest that cannot make a complete (or, partial, a consistent) update."""
        params = self.complete_manifest
        if params is None or not self._ctx.worker.engines:
            return
        unknown, wrong = misfits(declared.items(), params, "the engine has")
        missing = [] if partial else [n for n in params if n not in declared]
        if not (unknown or wrong or missing):
            return
        clean = all(e.state.weights is WeightsState.CLEAN for e in self._ctx.worker.engines.values())
        name = next(iter(self._ctx.worker.engines))
        why = [f"missing {name_some(missing)}: " + (
                   "a session that updates only some tensors must say partial: true" if clean else
                   "weights were discarded (released, or an update was abandoned), so every tensor must be pushed")
               ] if missing else []
        why += [f"not parameters of engine {name!r}: {name_some(unknown)}"] if unknown else []
        why += [name_some(wrong, 3, show=str, sep="; ")] if wrong else []
        raise RequestInvalid(f"manifest does not fit engine {name!r} ({len(params)} parameters, {len(declared)} "
                             "declared): " + "; ".join(why), field="manifest")

    async def update(self, *, step: int | None, version: str, chunks: list[tuple[int, ChunkPart]]) -> dict[str, Any]:
        """The one-shot form: open a session, send every chunk, commit; abort on any failure."""
        known = max((int(e.config.tp_size) for e in self._ctx.worker.engines.values()), default=1)  # widest TP
        for i, (_, part) in enumerate(chunks):
            if part.rank >= known:
                raise RequestInvalid(f"chunks.{i}.rank {part.rank} is outside 0..{known - 1}: this node's engines "
                                     f"take {known} trainer rank(s) (their largest tp_size)", field=f"chunks.{i}.rank")
        ranks = max(part.rank for _, part in chunks) + 1
        session = await self.open(step=step, version=version, ranks=ranks)
        # Per rank, in order, at most `depth` outstanding: what a rank may send (a semaphore wakes in FIFO order).
        windows = {part.rank: asyncio.Semaphore(session.depth) for _, part in chunks}

        async def send(seq: int, part: ChunkPart) -> None:
            async with windows[part.rank]:
                await self.submit_chunk(session.id, seq, part)

        try:
            await asyncio.gather(*(send(seq, part) for seq, part in sorted(chunks, key=lambda c: c[0])))
            return await self.commit(session.id, len({seq for seq, _ in chunks}))
        except BaseException as exc:
            if session.state is SessionState.OPEN:
                await self.abort(session.id, f"one-shot update failed: {exc}")
            if isinstance(exc, WeightSyncError) and session.error:
                raise WeightSyncError(session.error) from exc
            raise

    # -- commit's steps ----------------------------------------------------------------------------------
    async def _drain(self, session: WeightSession, num_chunks: int | None) -> None:
        """Every chunk consumed: a gap or a wrong count (422) leaves the session open; any other failure fails it."""
        try:
            with session.trace.span("drain"):
                await session.drain(num_chunks)
        except RequestInvalid:
            raise
        except BaseException:
            await self._end(session, WeightSyncError("commit failed"))
            raise

    async def _land(self, session: WeightSession) -> None:
        """Every engine ends its update serving the session's version; the books and the journal say so."""
        ctx, trace = self._ctx, session.trace
        await ctx.worker.weights({n: WeightsGoal(version=session.version) for n in ctx.worker.engines}, trace,
                                 strict=True)
        with trace.span("commit_bookkeeping"):
            session.commit()
            ctx.versions.committed(session.version)
            if not session.partial:
                self._record_complete(session)
            ctx.worker.metrics.weight_sessions.labels("committed").inc()
        trace.finish("committed", bytes=session.bytes_loaded, chunks=session.chunks_loaded, version=session.version)
        ctx.worker.traces.put(trace)
        with trace.span("journal"):
            await ctx.journal.written("weights")

    async def _verify(self, session: WeightSession) -> Verification:
        """Each engine's digests against the trainer's; a mismatch, or an engine that cannot be asked, fails the
        session (the engines stay paused, their weights stale)."""
        worker, t0 = self._ctx.worker, time.perf_counter()
        try:
            verdicts = await verify_engines(list(worker.engines.values()), session.expected, session.verify,
                                            session.version, lambda e, names: worker.digests(e, names, session.trace))
        except BaseException:
            await self._end(session, WeightSyncError("commit failed: asking the engines for their weight digests "
                                                     "failed"))
            raise
        verification = Verification(session.verify, verdicts, time.perf_counter() - t0)
        if (error := verification.error()) is not None:
            log.error("weight session %s: %s", session.id, error)
            await self._end(session, error)
            raise error
        return verification

    def _record_complete(self, session: WeightSession) -> None:
        manifest = session.manifest if session.manifest is not None else (session.delivered or None)
        if manifest is None:
            return
        self.complete_manifest = dict(manifest)
        if self._manifest_file is not None:
            tmp = self._manifest_file.with_suffix(".tmp")
            tmp.write_text(json.dumps({"version": session.version, "step": session.step,
                                       "tensors": manifest_to_json(manifest)}))
            os.replace(tmp, self._manifest_file)

    # -- failure, expiry, close ----------------------------------------------------------------------
    async def fail_if_lost(self) -> None:
        """Fail and close the open session if the reconcile the caller just ran found an engine lost it."""
        session = self.current
        lost = [(e.name, e.lost_session) for e in self._ctx.worker.engines.values() if e.lost_session is not None]
        if session is None or session.state is not SessionState.OPEN or not lost:
            return
        name, why = lost[0]
        await self._end(session, WeightSyncError(f"engine {name!r} lost the weight session: {why}"), observe=False)

    async def _end(self, session: WeightSession, error: BaseException, *, observe: bool = True) -> None:
        """Fail the open session with ``error`` and close it (caller holds the lock)."""
        await session.fail(error)
        await self._close_session(session, observe=observe)

    async def _finish_failed(self, session: WeightSession) -> None:
        if session.closed:  # closed, or being closed (the lease loop): the caller's error waits for the close
            if (closing := self._closing.get(session.id)) is not None:
                await closing.wait()
            return
        async with self._ctx.lock.background(f"close_weights:{session.id}"):
            await self._close_session(session)

    async def _close_session(self, session: WeightSession, *, observe: bool = True) -> None:
        """Close an ended, uncommitted session once (caller holds the lock): wait for its engine calls, end the
        engines' updates, withdraw its version, unlink the trainer's shared-memory segments its chunks named."""
        if not session.close():
            return  # closed already
        ctx, budget = self._ctx, self._ctx.worker.timeouts().budget(Budget.QUIESCE)
        self._closing[session.id] = closing = asyncio.Event()
        try:
            session.tainted = await session.quiesce(budget)
            if session.tainted:
                log.warning("weight session %s: engine calls on %s did not return within %.1fs; marked stale",
                            session.id, session.tainted, budget)
            await self._discard(session)
            if observe and session.state is SessionState.FAILED:  # an engine may be gone: status says so now
                await ctx.worker.reconcile_all(f"after failed session {session.id}", keep_error=True)
            ctx.versions.withdrawn(session.version, session.id)  # it will never land: rollout must not wait for it
            # A dead trainer cannot release its segments; a live one finds them gone when it does. Only the
            # trainer's own segments go (engines/segments.py), never a file a chunk merely named.
            for seg in unlink_session_segments(session.shm_names, session.trainer_pids):
                log.info("unlinked shared-memory segment %s of weight session %s (%s, pid %d)", seg.name,
                         session.id, session.state.value, seg.pid)
            ctx.worker.metrics.weight_sessions.labels(session.state.value).inc()
            session.trace.finish(session.state.value, bytes=session.bytes_loaded, chunks=session.chunks_loaded,
                                 version=session.version)
            ctx.worker.traces.put(session.trace)
        finally:
            closing.set()
            del self._closing[session.id]

    async def _discard(self, session: WeightSession) -> None:
        """Every engine ends its update uncommitted, paused (best effort: its record already says what the session
        left it)."""
        await self._ctx.worker.weights({n: WeightsGoal(after=session.left(n)) for n in self._ctx.worker.engines},
                                       session.trace, strict=False)

    async def lapse_if_idle(self) -> None:
        """Fail the open session if a rank missed its start deadline, expire it if its lease ran out."""
        session = self.current
        if session is not None and (late := session.start_overdue()) is not None:
            log.warning("weight session %s failed: %s", session.id, late)
            await self._end(session, late)
        elif session is not None and session.expired():
            log.warning("weight session %s expired after %.1fs without a chunk", session.id, session.idle_for())
            await session.expire()
            await self._close_session(session)

    async def lease_loop(self) -> None:
        """Expire idle sessions and close failed ones nobody is waiting on, without any caller's help."""
        ctx = self._ctx
        while not ctx.lock.stopping.is_set():
            session = self.current
            idle_s = session.idle_s if session is not None and session.idle_s else 1.0
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(max(idle_s / 4, 0.05), 1.0)):
                    await ctx.lock.stopping.wait()
            session = self.current
            if ctx.lock.stopping.is_set() or session is None or session.closed or ctx.lock.busy:
                continue
            if session.state is SessionState.OPEN and not session.expired() and session.start_overdue() is None:
                continue
            try:
                async with ctx.lock.background(f"close_weights:{session.id}"):
                    await self.lapse_if_idle()
                    if session.state is not SessionState.OPEN:
                        await self._close_session(session)
            except Exception:  # keep the loop alive: the next round (or the next open) retries
                log.exception("closing weight session %s failed", session.id)

    # -- separated GPUs: broadcasts through a weight-update group (daemon/distributed.py) -------------
    async def broadcast(self, session_id: str, descriptor: BroadcastDescriptor) -> dict[str, Any]:
        """Forward one broadcast to every engine; returns once all loaded it (the trainer broadcasts meanwhile)."""
        ctx = self._ctx
        session = self.get(session_id)
        tensors = [(n, TensorMeta(dt, tuple(s)))
                   for n, dt, s in zip(descriptor.names, descriptor.dtypes, descriptor.shapes, strict=True)]
        session.check_broadcast(descriptor.seq, tensors)
        try:
            reply = await self.groups.broadcast(session, list(ctx.worker.engines.values()), descriptor)
            session.note_delivered(tensors)
            return reply
        finally:
            session.touch()
            if session.state is not SessionState.OPEN:
                await self._finish_failed(session)  # engines end their update, stay paused, weights stale


def _lock_span(trace: Trace, since: float) -> None:
    """``node_lock``: from ``since`` until now, waiting for the node and reconciling every engine."""
    trace.add(Span("node_lock", None, since, trace.elapsed_s() - since))
