"""Prometheus metrics owned by one daemon instance (its own registry: no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Every series colocd exports; names carry their units."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.phase_duration = Histogram(
            "colocd_phase_duration_seconds", "Wall time of one phase transition per engine ('all' = whole node)",
            ["phase", "engine"], buckets=_DURATION_BUCKETS, registry=r)
        self.step_duration = Histogram(
            "colocd_substep_duration_seconds", "Wall time of one sub-step of a transition",
            ["substep", "engine"], buckets=_DURATION_BUCKETS, registry=r)
        self.transitions = Counter(
            "colocd_transitions_total", "Phase transitions by outcome (ok, rejected, failed, replayed)",
            ["phase", "outcome"], registry=r)
        self.weight_bytes = Counter(
            "colocd_weight_bytes_total", "Weight bytes delivered to engines", ["engine", "transport"], registry=r)
        self.weight_chunks = Counter(
            "colocd_weight_chunks_total", "Weight chunks delivered to engines", ["engine"], registry=r)
        self.weight_sessions = Counter(
            "colocd_weight_sessions_total", "Weight sessions by outcome (committed, aborted, failed)",
            ["outcome"], registry=r)
        self.freed_bytes = Counter(
            "colocd_memory_freed_bytes_total", "Bytes confirmed freed by releases", ["engine", "source"], registry=r)
        self.gpu_memory = Gauge(
            "colocd_gpu_memory_bytes", "GPU memory by NVML (kind=used|free|total)", ["gpu", "kind"], registry=r)
        self.engine_healthy = Gauge("colocd_engine_healthy", "1 if the engine answered its last probe",
                                    ["engine"], registry=r)
        self.engine_tag_resident = Gauge("colocd_engine_tag_resident", "1 if the tag's memory is resident",
                                         ["engine", "tag"], registry=r)
        self.weight_version = Gauge("colocd_engine_weight_version_info",
                                    "Committed weight version of each engine (value 1)",
                                    ["engine", "version"], registry=r)
        self.policy_info = Gauge("colocd_policy_info", "Active policy (value 1)",
                                 ["version", "fingerprint", "process_groups", "pipeline", "cleanup"], registry=r)
        self.engine_restarts = Counter(
            "colocd_engine_restarts_total", "Engine restarts the daemon detected (incarnation changed, or unprovable)",
            ["engine"], registry=r)
        self.reconcile_actions = Counter(
            "colocd_reconcile_actions_total",
            "Reconciliation steps by engine and action (adopt, pause, release, end_engine_session, fail_session)",
            ["engine", "action"], registry=r)
        self.node_step = Gauge("colocd_node_step", "Current step of the node", registry=r)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
