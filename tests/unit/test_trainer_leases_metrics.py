"""The daemon's view of the trainer ranks' IPC leases: gauges are each rank's last report, counters add what the
reported totals grew by, and a new trainer process (totals back at 0) counts from zero."""

from __future__ import annotations

from prometheus_client import generate_latest

from colocd.daemon.metrics import LeaseReport, Metrics


def series(metrics: Metrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(metrics.registry).decode().splitlines():
        if line.startswith("colocd_ipc_") and "_created" not in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_gauges_are_the_last_report_per_rank_and_counters_add_what_the_totals_grew_by() -> None:
    metrics = Metrics()
    metrics.record_leases(LeaseReport(rank=0, exported_bytes=300, retained_bytes=200))
    metrics.record_leases(LeaseReport(rank=1, exported_bytes=7, retained_bytes=0))
    metrics.record_leases(LeaseReport(rank=0, exported_bytes=0, retained_bytes=0, reclaimed=2, reclaimed_bytes=200))
    metrics.record_leases(LeaseReport(rank=0, exported_bytes=0, retained_bytes=0, reclaimed=3, reclaimed_bytes=250))
    got = series(metrics)
    assert got['colocd_ipc_exported_bytes{rank="0"}'] == 0 and got['colocd_ipc_exported_bytes{rank="1"}'] == 7
    assert got['colocd_ipc_retained_bytes{rank="0"}'] == 0
    assert got['colocd_ipc_leases_reclaimed_total{rank="0"}'] == 3
    assert got['colocd_ipc_reclaimed_bytes_total{rank="0"}'] == 250
    assert got['colocd_ipc_retained_bytes{rank="1"}'] == 0 and 'colocd_ipc_leases_reclaimed_total{rank="1"}' not in got


def test_a_new_trainer_process_on_a_rank_counts_its_reclaims_from_zero() -> None:
    metrics = Metrics()
    metrics.record_leases(LeaseReport(rank=0, exported_bytes=0, retained_bytes=0, reclaimed=5, reclaimed_bytes=500))
    metrics.record_leases(LeaseReport(rank=0, exported_bytes=0, retained_bytes=0, reclaimed=1, reclaimed_bytes=100))
    got = series(metrics)
    assert got['colocd_ipc_leases_reclaimed_total{rank="0"}'] == 6
    assert got['colocd_ipc_reclaimed_bytes_total{rank="0"}'] == 600
