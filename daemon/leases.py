"""What the trainer ranks report of their IPC leases (``colocd.trainer.leases``), as metrics.

A trainer rank sends ``LeaseBook.report()`` after each stream, each reclaim and its pusher's close: the bytes
it has exported now, the bytes torch retains for a consumer's count, and its running totals of reclaimed
leases. The gauges are the last report per rank; the counters add what each report's totals grew by (a rank
whose totals go down is a new trainer process, counted from zero).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .metrics import Metrics

__all__ = ["LeaseReport", "TrainerLeases"]

log = logging.getLogger("colocd.daemon.leases")


@dataclass(frozen=True, slots=True)
class LeaseReport:
    rank: int
    exported_bytes: int
    retained_bytes: int
    reclaimed: int = 0
    reclaimed_bytes: int = 0


class TrainerLeases:
    """The last lease report of each trainer rank, and the ``colocd_ipc_*`` series it sets."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics
        self.last: dict[int, LeaseReport] = {}

    def record(self, report: LeaseReport) -> None:
        m, rank = self._metrics, str(report.rank)
        previous = self.last.get(report.rank)
        grew_leases, grew_bytes = report.reclaimed, report.reclaimed_bytes
        if previous is not None and report.reclaimed >= previous.reclaimed:
            grew_leases -= previous.reclaimed
            grew_bytes = max(report.reclaimed_bytes - previous.reclaimed_bytes, 0)
        self.last[report.rank] = report
        m.ipc_exported_bytes.labels(rank).set(report.exported_bytes)
        m.ipc_retained_bytes.labels(rank).set(report.retained_bytes)
        if grew_leases:
            m.ipc_reclaimed.labels(rank).inc(grew_leases)
            m.ipc_reclaimed_bytes.labels(rank).inc(grew_bytes)
            log.warning("trainer rank %d reclaimed %d IPC lease(s), %d bytes, that a consumer never let go "
                        "(now exported %d, retained %d bytes)", report.rank, grew_leases, grew_bytes,
                        report.exported_bytes, report.retained_bytes)

    def view(self) -> dict[str, dict[str, int]]:
        return {str(rank): {"exported_bytes": r.exported_bytes, "retained_bytes": r.retained_bytes,
                            "reclaimed": r.reclaimed, "reclaimed_bytes": r.reclaimed_bytes}
                for rank, r in sorted(self.last.items())}
