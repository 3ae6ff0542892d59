"""Separated-GPU weight updates: persistent weight-update groups, and broadcasts inside a weight session.

A broadcast's descriptor goes to every engine at once; each blocks in its receive while the trainer broadcasts,
and the daemon answers once all loaded it (research/engine-apis.md §6.3); opening a group is alike (§1.6). A group
whose collective sequence may be out of step (a failed broadcast or join) is destroyed on every engine and
forgotten, so the trainer can open it again under its name.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from ..engines.httpmap import caller_payload
from ..engines.tcpstore_probe import probe_tcpstore
from ..engines.weight_group_protocol import BACKEND_DEVICES, BroadcastDescriptor, SupportsWeightGroups
from ..errors import EngineError, NotFound, RequestInvalid, StageTimeout, TransitionRejected, WeightSyncError
from ..policies import Budget
from .fanout import OnFailure, fan_out
from .lock import NodeLock
from .states import SessionState
from .trace import Trace
from .weights import WeightSession
from .worker import EngineHandle, EngineWorker, group_verbs

__all__ = [
    "BroadcastDescriptor", "GroupState", "SupportsWeightGroups", "WeightGroupRecord", "WeightGroups", "rank_layout"
]


class GroupState(StrEnum):
    JOINING = "joining"
    READY = "ready"


@dataclass
class WeightGroupRecord:
    """One group as the daemon holds it: where its store is, each engine's first rank, what went through it."""

    name: str
    backend: str
    master_address: str
    master_port: int
    world_size: int
    rank_offsets: dict[str, int]
    state: GroupState = GroupState.JOINING
    opened_at: float = field(default_factory=time.time)
    broadcasts: int = 0
    nbytes: int = 0
    in_flight: int | None = None  # seq of the broadcast the engines are receiving
    session_id: str | None = None  # the session the next sequence number belongs to
    next_seq: int = 0

    def snapshot(self) -> dict[str, Any]:
        return {"group_name": self.name, "backend": self.backend, "state": self.state.value,
                "master_address": self.master_address, "master_port": self.master_port,
                "world_size": self.world_size, "rank_offsets": dict(self.rank_offsets),
                "opened_at": self.opened_at, "broadcasts": self.broadcasts, "nbytes": self.nbytes,
                "in_flight": self.in_flight}


def rank_layout(engines: list[EngineHandle], first_rank: int = 1) -> dict[str, int]:
    """Each engine's ``rank_offset``: the trainer is rank 0, engines follow in config order, one rank per TP rank."""
    offsets, rank = {}, first_rank
    for engine in engines:
        offsets[engine.name] = rank
        rank += int(engine.config.tp_size)
    return offsets


class WeightGroups:
    """The node's weight-update groups and the broadcasts that go through them."""

    def __init__(self, worker: EngineWorker, lock: NodeLock) -> None:
        self._groups: dict[str, WeightGroupRecord] = {}
        self._worker, self._lock, self._metrics = worker, lock, worker.metrics

    def snapshot(self) -> dict[str, Any]:
        """The rank layout a trainer needs before it builds its side, and every open group."""
        engines = list(self._worker.engines.values())
        offsets = rank_layout(engines)
        ranks = sum(int(e.config.tp_size) for e in engines)
        return {"layout": {"world_size": 1 + ranks, "engine_ranks": ranks,
                           "engines": {e.name: {"rank_offset": offsets[e.name], "tp_size": int(e.config.tp_size)}
                                       for e in engines}},
                "groups": {name: g.snapshot() for name, g in self._groups.items()}}

    def check_settled(self, session: WeightSession) -> None:
        """Refuse to end ``session`` while one of its broadcasts is still being received."""
        busy = [g for g in self._groups.values() if g.session_id == session.id and g.in_flight is not None]
        if busy:
            raise TransitionRejected(f"session {session.id}: broadcast {busy[0].in_flight} on group "
                                     f"{busy[0].name!r} is still in flight; wait for its answer")

    async def open(self, *, group_name: str, master_address: str, master_port: int, backend: str,
                   world_size: int | None = None, first_rank: int = 1) -> dict[str, Any]:
        """Every engine joins the trainer's group; returns once all joined (the trainer joins meanwhile)."""
        async with self._lock.exclusive("open_weight_group"):
            self._worker.require_attached()
            engines = list(self._worker.engines.values())
            if (existing := self._groups.get(group_name)) is not None:
                raise TransitionRejected(f"weight-update group {group_name!r} is already {existing.state.value}; "
                                         f"DELETE /v1/weights/groups/{group_name} first")
            if not engines:
                raise TransitionRejected("this node has no engines to join a weight-update group")
            # All checked before any engine joins: one that joins a group that cannot form waits out its budget.
            for engine in engines:
                group_verbs(engine)  # every engine must speak the routes before any joins
                device = engine.device_type
                if BACKEND_DEVICES[backend] == "cuda" and device != "cuda":
                    raise RequestInvalid(f"backend {backend!r} needs CUDA, but engine {engine.name!r} runs on "
                                         f"{device}; use 'gloo' with CPU engines", field="backend")
            offsets = rank_layout(engines, first_rank)
            needed = first_rank + sum(int(e.config.tp_size) for e in engines)
            world = needed if world_size is None else world_size
            if world < needed:
                raise RequestInvalid(f"world_size {world} is too small: the trainer, ranks before {first_rank} and "
                                     f"this node's {needed - first_rank} engine ranks need {needed}",
                                     field="world_size")
            # Frameworks that start the store while the POST is in flight need a moment (timeouts.master_reach_s).
            await _check_reachable(master_address, master_port, self._worker.timeouts().budget(Budget.MASTER_REACH))
            record = self._groups[group_name] = WeightGroupRecord(
                group_name, backend, master_address, master_port, world, offsets)
            trace = Trace(self._worker.node.step, "weight_group")

            async def join(engine: EngineHandle) -> None:
                # The group spec is the caller's: an engine refusing it (SGLang: 400) is the caller's 422.
                with caller_payload("group"):
                    await self._worker.join_group(engine, trace, group_name=group_name,
                                                  master_address=master_address, master_port=master_port,
                                                  rank_offset=offsets[engine.name], world_size=world, backend=backend)

            try:
                with trace.timed():
                    try:
                        await fan_out(engines, join, on_failure=OnFailure.CANCEL)
                    except BaseException:
                        # Engines that joined would wait on the others forever: leave nothing half-built.
                        del self._groups[group_name]
                        await self._destroy_everywhere(engines, group_name, trace)
                        raise
            finally:
                self._worker.traces.put(trace)
            record.state = GroupState.READY
            return {**record.snapshot(), "trace": trace.to_json()}

    async def close(self, group_name: str) -> dict[str, Any]:
        """Destroy the group on every engine and forget it; per-engine failures are reported, not raised."""
        async with self._lock.exclusive("close_weight_group"):
            record = self._groups.get(group_name)
            if record is None:
                raise NotFound(f"no weight-update group {group_name!r}; open ones: {sorted(self._groups)}")
            if record.in_flight is not None:
                raise TransitionRejected(f"broadcast {record.in_flight} is in flight on group {group_name!r}")
            del self._groups[group_name]
            errors = await self._destroy_everywhere(list(self._worker.engines.values()), group_name,
                                                    Trace(self._worker.node.step, "weight_group"))
            return {**record.snapshot(), "state": "destroyed", "errors": errors}

    async def _destroy_everywhere(self, engines: list[EngineHandle], group_name: str, trace: Trace) -> dict[str, str]:
        """Best effort on every engine: a failure here must not hide the error that led here."""
        results = await fan_out(engines, lambda e: self._worker.leave_group(e, group_name, trace),
                                on_failure=OnFailure.COLLECT)
        return {name: str(r) for name, r in results.items() if isinstance(r, Exception)}

    async def broadcast(self, session: WeightSession, engines: list[EngineHandle],
                        desc: BroadcastDescriptor) -> dict[str, Any]:
        """Forward one broadcast to every engine at once, until all loaded it; a failure fails the session too."""
        record = self._groups.get(desc.group_name)
        if record is None:
            raise NotFound(f"no weight-update group {desc.group_name!r}; open it with POST /v1/weights/groups")
        if record.state is not GroupState.READY:
            raise TransitionRejected(f"weight-update group {record.name!r} is {record.state.value}")
        if record.in_flight is not None:
            # One collective sequence per group: a second receive would interleave with the first.
            raise TransitionRejected(f"broadcast {record.in_flight} is still in flight on group {record.name!r}; "
                                     "a group carries one broadcast at a time")
        expected = record.next_seq if record.session_id == session.id else 0
        if desc.seq != expected:
            raise TransitionRejected(f"broadcast {desc.seq} is out of order on group {record.name!r} in session "
                                     f"{session.id}: expected {expected}")
        if record.session_id != session.id:
            record.session_id, record.next_seq = session.id, 0  # numbering restarts with each session
        record.in_flight = desc.seq
        nbytes, t0 = desc.nbytes, time.perf_counter()
        try:
            await fan_out(engines, lambda e: self._worker.receive_broadcast(e, desc, session.trace),
                          on_failure=OnFailure.CANCEL)
        except Exception as exc:
            error = _explain(exc, record.name, desc.seq)
            await session.fail(error)
            del self._groups[record.name]
            await self._destroy_everywhere(engines, record.name, session.trace)
            raise error from exc
        finally:
            record.in_flight = None
        if session.state is not SessionState.OPEN:
            raise WeightSyncError(f"session {session.id} was {session.state.value} while broadcast {desc.seq} "
                                  "was received; nothing of it counts")
        record.next_seq += 1
        record.broadcasts += 1
        record.nbytes += nbytes
        for engine in engines:
            self._metrics.weight_bytes.labels(engine.name, record.backend).inc(nbytes)
            self._metrics.weight_chunks.labels(engine.name).inc()
        session.broadcast_stats = stats = session.broadcast_stats or {"broadcasts": 0, "nbytes": 0}
        stats["broadcasts"] += 1
        stats["nbytes"] += nbytes
        return {"seq": desc.seq, "group_name": record.name, "engines": [e.name for e in engines],
                "nbytes": nbytes, "load_s": time.perf_counter() - t0}


async def _check_reachable(host: str, port: int, within_s: float) -> None:
    """Fail fast, naming the field, when the trainer's TCPStore cannot be reached from this node: an unresolvable
    host, nothing accepting connections within ``within_s``, or something that does not answer as a TCPStore."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(within_s):
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError) as exc:  # UnicodeError: not a valid IDNA host name
        reason = ("lookup timed out" if isinstance(exc, TimeoutError)
                  else getattr(exc, "strerror", None) or str(exc) or "not found")
        raise RequestInvalid(f"master_address {host!r} does not resolve from this node: {reason}",
                             field="master_address") from None
    deadline = loop.time() + within_s
    last = "no address"
    while True:
        for family, _, proto, _, address in infos:
            try:
                async with asyncio.timeout(max(deadline - loop.time(), 0.05)):
                    reader, writer = await asyncio.open_connection(host=str(address[0]), port=int(address[1]),
                                                                   family=family, proto=proto)
            except (OSError, TimeoutError) as exc:
                last = "timed out" if isinstance(exc, TimeoutError) else (exc.strerror or type(exc).__name__)
                continue
            try:
                # Something listens; is it a TCPStore? (An HTTP port would leave the engines in their rendezvous.)
                problem = await probe_tcpstore(reader, writer, max(deadline - loop.time(), 1.0))
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            if problem is not None:
                raise RequestInvalid(
                    f"master_address:master_port {host}:{port} accepts connections but is not a torch TCPStore "
                    f"({problem}); point it at the trainer's store (group rank 0's MASTER_PORT)", field="master_port")
            return
        if loop.time() >= deadline:
            raise RequestInvalid(
                f"nothing accepts connections at master_address:master_port {host}:{port} from this node "
                f"within {within_s:.1f}s ({last}); start the trainer's TCPStore (group rank 0) before POSTing",
                field="master_port")
        await asyncio.sleep(0.05)  # the store may be a moment from listening; retry until the deadline


def _explain(exc: Exception, group_name: str, seq: int) -> Exception:
    """The error for the trainer: what failed where, and that the group is gone and must be reopened."""
    tail = f"; group {group_name!r} was destroyed on every engine: open it again to continue"
    if isinstance(exc, StageTimeout):
        return StageTimeout(f"{exc} (the trainer's broadcast never arrived, or the engine is stuck){tail}",
                           engine=exc.engine or "", stage=exc.stage or "", budget_s=exc.budget_s)
    if isinstance(exc, EngineError | WeightSyncError):
        return WeightSyncError(f"broadcast {seq}: {exc}{tail}")
    return WeightSyncError(f"broadcast {seq}: {type(exc).__name__}: {exc}{tail}")
