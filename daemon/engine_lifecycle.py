"""Engine lifecycle: the engines as processes the daemon watches. The journal restore a restarted daemon starts
from, the first reconcile of every engine, the health loop's backoff and its reclaim of dead trainers' segments,
and why an engine cannot be driven now (``/readyz``). Reconciling is the engine worker's (daemon/worker.py); the
loops that hold the node's lock (the health tick, a relaunched engine's reconcile) are the daemon's
(daemon/node.py), which calls these."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

from ..engines.segments import reclaim_dead_segments
from .events import emit
from .fanout import OnFailure, fan_out
from .journal import Journal
from .metrics import Metrics
from .states import NodePhase, NodeState
from .supervision import EngineSupervision
from .worker import EngineHandle, EngineWorker

__all__ = ["EngineLifecycle"]

log = logging.getLogger("colocd.daemon")

RETRY_INITIAL_S = 0.1  # first retry of a failed reconcile; doubles per health tick up to the health interval


class EngineLifecycle:
    """The node's engines as processes the daemon watches: what it found at startup, what is unchecked.

    Owns the startup report and the health loop's retry count; reads the engines, their launches and the
    journal it is given, and drives engines only through ``worker``."""

    def __init__(self, engines: Mapping[str, EngineHandle], worker: EngineWorker, metrics: Metrics, *,
                 journal: Journal | None, launches: EngineSupervision, changed: Callable[[], None]) -> None:
        self._engines = engines
        self._worker = worker
        self._metrics = metrics
        self._journal = journal
        self._launches = launches
        self._changed = changed
        self._retries = 0  # health ticks in a row that found an engine unsettled or unreachable
        self.startup_report: dict[str, Any] | None = None

    def restore_journal(self) -> NodeState | None:
        """The node state the journal's last record holds, its engines' records restored (each to be re-verified
        before any mutating call); None without a journal or a record."""
        if self._journal is None or (record := self._journal.last()) is None:
            return None
        node = NodeState(NodePhase(record["node"]["phase"]), int(record["node"]["step"]))
        self._worker.restore(record.get("engines", {}))
        emit("journal_restored", logging.INFO, step=node.step, phase=node.phase.value)
        return node

    async def reconcile_at_startup(self, *, journal_restored: bool) -> None:
        """Reconcile every engine once before the daemon takes work (the node state already restored)."""
        engines, worker = self._engines, self._worker
        await fan_out(engines.values(), lambda e: worker.reconcile(e, "startup"), on_failure=OnFailure.SETTLE)
        self.startup_report = {"journal_restored": journal_restored, "unreconciled": sorted(worker.unreconciled),
                               "engines": {n: worker.reports.get(n) for n in engines}}
        emit("startup_reconcile", logging.INFO, journal_restored=journal_restored,
             unreconciled=sorted(worker.unreconciled), engines=sorted(engines))

    def health_interval(self, interval: float) -> float:
        """The wait before the next health tick: a failed reconcile is retried soon, backing off up to
        ``interval`` (the policy's health interval)."""
        if bool(self._worker.unsettled) or any(not e.state.healthy for e in self._engines.values()):
            self._retries += 1
            return min(interval, RETRY_INITIAL_S * 2.0 ** (self._retries - 1))
        self._retries = 0
        return interval

    async def reclaim_segments(self) -> int:
        """Unlink the shared-memory segments of dead trainers (a SIGKILLed trainer unlinks nothing); returns how
        many. Directory scans and flock probes are syscalls: off the event loop."""
        try:
            reclaimed = await asyncio.to_thread(reclaim_dead_segments)
        except OSError as exc:  # an unreadable /dev/shm must not stop the health loop
            log.warning("reclaiming dead trainers' shared-memory segments failed: %s", exc)
            return 0
        for seg in reclaimed:
            log.info("unlinked shared-memory segment %s of dead process %d (%d bytes)", seg.name, seg.pid, seg.nbytes)
        if reclaimed:
            self._metrics.shm_reclaimed.inc(len(reclaimed))
            self._metrics.shm_reclaimed_bytes.inc(sum(seg.nbytes for seg in reclaimed))
            self._changed()
        return len(reclaimed)

    def unready_reasons(self) -> list[str]:
        """Why the node cannot be driven now, one line per engine that cannot (``/readyz``)."""
        worker = self._worker
        reasons = []
        for name, engine in self._engines.items():
            launched = self._launches.launched.get(name)
            if launched is not None and (why := launched.unready_reason()) is not None:
                reasons.append(why)
            elif name in worker.unreconciled:
                error = engine.state.last_error
                reasons.append(f"engine {name!r}: not yet reconciled with the journal after the daemon restarted"
                               + (f": {error}" if error else ""))
            elif name in worker.unsettled:
                reasons.append(worker.unsettled[name])
            elif (why := engine.unready_reason()) is not None:
                reasons.append(why)
        return reasons
