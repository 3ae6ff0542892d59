"""Prometheus metrics owned by one daemon instance (its own registry: no global state), and the gauges set
from what the daemon sees: the node, its engines, NVML, the trainer ranks' IPC lease reports.

A scrape renders the text exposition (tens of KB, ~10-30 ms on a small CPU) in a worker thread, so the event
loop keeps serving.

Every event counter and histogram exists at 0 for each engine and label value from the start (``declare``):
Prometheus's ``increase()`` needs a sample before the first event, or the first engine restart reads as 0.
Without NVML (no driver, no package, a CPU node) there is no GPU series at all, and ``colocd_nvml_available 0``:
an absent series is honest, a zero would claim a reading that never happened.
"""

from __future__ import annotations

import asyncio
import logging
import platform
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from .. import __version__
from .memory import NvmlProbe, Settled
from .states import NodePhase, NodeState

__all__ = ["PARTS", "LeaseReport", "Metrics"]

log = logging.getLogger("colocd.daemon")

# The fixed vocabularies of the event counters' labels: each combination is exported at 0 from the start.
TRANSITION_PHASES = ("train", "sync", "rollout")
TRANSITION_OUTCOMES = ("ok", "rejected", "failed", "replayed")
SESSION_OUTCOMES = ("committed", "aborted", "failed", "expired")
RECONCILE_ACTIONS = ("adopt", "pause", "release", "end_engine_session", "fail_session")
ADAPTER_OUTCOMES = ("committed", "refused", "failed")
FALLBACK_KINDS = ("process_groups", "weight_sync")
# What a weight push ran as, against what the policy asked for: async falls back to sync, never the reverse.
WEIGHT_SYNC_MODES = (("sync", "sync"), ("async", "async"), ("async", "sync"))
# The trainer-side work a trainer agent reports: cleanup.<CleanupAction>, process groups, its weight push.
TRAINER_SUBSTEPS = ("cleanup.gc_collect", "cleanup.synchronize", "cleanup.empty_cache", "process_groups",
                    "weight_sync")
# The parts of a step's switch, in the order they happen (daemon/trace.py); ``total`` is their sum.
PARTS = ("sleep", "load_weights_memory", "update", "wake", "cleanup", "groups")

_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# NVML confirmation is meant to cost a few milliseconds (target: <= 5 ms median per transition).
_CONFIRM_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1, 5, 30)


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
            "colocd_weight_sessions_total", "Weight sessions by outcome (committed, aborted, failed, expired)",
            ["outcome"], registry=r)
        self.shm_reclaimed = Counter(
            "colocd_shm_segments_reclaimed", "Shared-memory segments (colocd-<pid>-*) of dead trainer processes "
            "the health loop unlinked", registry=r)
        self.shm_reclaimed_bytes = Counter(
            "colocd_shm_reclaimed_bytes", "Bytes the reclaimed segments of dead trainers held", registry=r)
        # Trainer-side IPC leases (``record_leases``), as each trainer rank last reported them.
        self.ipc_exported_bytes = Gauge(
            "colocd_ipc_exported_bytes", "Bytes a trainer rank holds exported for engines (chunks in flight, "
            "shm segments), as of its last report", ["rank"], registry=r)
        self.ipc_retained_bytes = Gauge(
            "colocd_ipc_retained_bytes", "Bytes a trainer rank released that torch still keeps for a consumer's "
            "CUDA IPC count, as of its last report", ["rank"], registry=r)
        self.ipc_reclaimed = Counter(
            "colocd_ipc_leases_reclaimed", "IPC leases a trainer rank reclaimed (zeroed a consumer's count that "
            "never came down: a dead or gone engine)", ["rank"], registry=r)
        self.ipc_reclaimed_bytes = Counter(
            "colocd_ipc_reclaimed_bytes", "Bytes of the IPC leases a trainer rank reclaimed", ["rank"], registry=r)
        self.freed_bytes = Counter(
            "colocd_memory_freed_bytes_total", "Bytes confirmed freed by releases", ["engine", "source"], registry=r)
        self.memory_confirm = Histogram(
            "colocd_memory_confirm_seconds", "Time from a release's reply until NVML showed the memory free, "
            "by the criterion that ended the wait (expected bytes back, or a drop that stayed put)",
            ["engine", "criterion"], buckets=_CONFIRM_BUCKETS, registry=r)
        # One metric per quantity (never a kind label): a sum over a metric's series must mean something.
        self.gpu_memory_used = Gauge("colocd_gpu_memory_used_bytes", "GPU memory in use, by NVML",
                                     ["gpu", "uuid"], registry=r)
        self.gpu_memory_free = Gauge("colocd_gpu_memory_free_bytes", "GPU memory free, by NVML",
                                     ["gpu", "uuid"], registry=r)
        self.gpu_memory_total = Gauge("colocd_gpu_memory_total_bytes", "GPU memory in all, by NVML",
                                      ["gpu", "uuid"], registry=r)
        self.engine_healthy = Gauge("colocd_engine_healthy", "1 if the engine answered its last probe",
                                    ["engine"], registry=r)
        self.engine_tag_resident = Gauge("colocd_engine_tag_resident", "1 if the tag's memory is resident",
                                         ["engine", "tag"], registry=r)
        self.weight_version = Gauge("colocd_engine_weight_version_info",
                                    "Committed weight version of each engine (value 1)",
                                    ["engine", "version"], registry=r)
        self.policy_info = Gauge("colocd_policy_info", "Active policy (value 1)",
                                 ["version", "fingerprint", "process_groups", "pipeline", "cleanup"], registry=r)
        self.node_step = Gauge("colocd_node_step", "Current step of the node", registry=r)
        self.node_phase = Gauge("colocd_node_phase", "1 for the node's current phase (train, sync, rollout), "
                                "0 for the others", ["phase"], registry=r)
        self.node_phase_entered = Gauge(
            "colocd_node_phase_entered_timestamp_seconds", "Unix time at which the node entered its current "
            "(step, phase), or the daemon started: time() minus this is how long it has been there", registry=r)
        self.node_busy = Gauge("colocd_node_busy", "1 while a transition, weight-session call or reconcile "
                               "holds the node", registry=r)
        self.session_open = Gauge("colocd_weight_session_open", "1 while a weight session is open", registry=r)
        self.session_idle = Gauge(
            "colocd_weight_session_idle_seconds", "Seconds since the open weight session last saw the trainer "
            "(0 when none is open); it expires at timeouts.session_idle_s", registry=r)
        self.build_info = Gauge("colocd_build_info", "colocd's version and the Python it runs on (value 1)",
                                ["version", "python"], registry=r)
        self.build_info.labels(__version__, platform.python_version()).set(1)
        ProcessCollector(registry=r)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        PlatformCollector(registry=r)  # python_info
        self.last_phase_duration = Gauge(
            "colocd_last_phase_duration_seconds", "The last transition's wall time per engine ('all' = whole "
            "node), by phase: stays put between steps, where a rate over the histogram has nothing", 
            ["phase", "engine"], registry=r)
        self.last_substep_duration = Gauge(
            "colocd_last_substep_duration_seconds", "The last call of each sub-step on each engine",
            ["substep", "engine"], registry=r)
        self.step_switch = Histogram(
            "colocd_step_switch_seconds", "Daemon-side switch time of one step: train + sync + weight update + "
            "rollout, not counting the trainer's own training", buckets=_DURATION_BUCKETS, registry=r)
        self.step_part_duration = Histogram(
            "colocd_step_part_duration_seconds", "Where one step's switch time went, by part (sleep, "
            "load_weights_memory, update, wake, cleanup, groups)", ["part"], buckets=_DURATION_BUCKETS, registry=r)
        self.last_step_part = Gauge(
            "colocd_last_step_part_seconds", "The last finished step's switch time by part (part=total is the sum)",
            ["part"], registry=r)
        self.last_step = Gauge("colocd_last_step", "Number of the last step whose rollout finished", registry=r)
        self.weight_session_duration = Histogram(
            "colocd_weight_session_duration_seconds", "Wall time of a weight session, open to commit or failure",
            ["outcome"], buckets=_DURATION_BUCKETS, registry=r)
        self.chunk_load_duration = Histogram(
            "colocd_weight_chunk_load_seconds", "Time one engine took to load one weight chunk", ["engine"],
            buckets=_DURATION_BUCKETS, registry=r)
        self.trainer_substep_duration = Histogram(
            "colocd_trainer_substep_duration_seconds", "Trainer-side work reported with a transition "
            "(cleanup.gc_collect, cleanup.empty_cache, process_groups, ...)", ["substep"],
            buckets=_DURATION_BUCKETS, registry=r)
        self.trainer_groups_kept_bytes = Gauge(
            "colocd_trainer_groups_kept_bytes", "GPU memory the trainer's process groups kept through the last "
            "pause, as the trainer measured it, by the action taken (absent until a trainer reports it)",
            ["action"], registry=r)
        self.fallbacks = Counter(
            "colocd_fallbacks_total", "A policy decision replaced by its fallback (kind=process_groups, ...)",
            ["kind"], registry=r)
        self.rollout_staleness = Gauge(
            "colocd_rollout_weight_staleness_versions", "How many started weight versions were newer than the one "
            "each engine served when the last rollout began (0: the latest)", ["engine"], registry=r)
        self.weight_syncs = Counter(
            "colocd_trainer_weight_syncs_total", "Weight pushes the trainer reported, by the mode the policy asked "
            "for and the mode that ran (async falls back to sync when the second buffer does not fit)",
            ["requested", "mode"], registry=r)
        self.nvml_available = Gauge(
            "colocd_nvml_available", "1 if NVML reads the engines' GPUs; 0 means no GPU memory series exist",
            registry=r)
        self.gpu_process_memory = Gauge(
            "colocd_gpu_process_memory_bytes", "GPU memory NVML attributes to each compute process on a GPU "
            "(series of exited processes are dropped)", ["gpu", "pid"], registry=r)
        self.engine_memory = Gauge(
            "colocd_engine_memory_bytes", "Memory an engine reports for each tag (its own accounting; "
            "reference engine only)", ["engine", "tag"], registry=r)
        self.engine_gpu = Gauge("colocd_engine_gpu_info", "Which GPUs an engine runs on (value 1)", ["engine", "gpu"],
                                registry=r)
        self.engine_generation_state = Gauge(
            "colocd_engine_generation_state", "1 for the engine's current generation state (serving, paused), "
            "0 for the other", ["engine", "state"], registry=r)
        self.engine_weights_state = Gauge(
            "colocd_engine_weights_state", "1 for the engine's current weights state (clean, updating, stale), "
            "0 for the others", ["engine", "state"], registry=r)
        self.engine_restarts = Counter(
            "colocd_engine_restarts",
            "Engine restarts the daemon observed (a new incarnation, or one it could not rule out)",
            ["engine"], registry=r)
        self.engine_launches = Counter(
            "colocd_engine_launches", "Engine processes the daemon launched and saw ready (the first start and "
            "every relaunch; engines with a 'launch' section only)", ["engine"], registry=r)
        self.engine_launch_failures = Counter(
            "colocd_engine_launch_failures", "Engine launches that exited or missed launch.ready_timeout_s before "
            "they were ready", ["engine"], registry=r)
        self.reconcile_actions = Counter(
            "colocd_reconcile_actions", "Actions the reconcile loop took to drive an engine to its desired state "
            "(adopt, pause, release, end_engine_session, fail_session)",
            ["engine", "action"], registry=r)
        # LoRA adapters (daemon/adapters.py)
        self.adapter_info = Gauge("colocd_adapter_info", "The LoRA adapter the node serves now (value 1)", ["name"],
                                  registry=r)
        self.adapter_load = Histogram("colocd_adapter_load_seconds", "One engine's load of one adapter version",
                                      ["engine"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
                                      registry=r)
        self.adapter_unloads = Counter("colocd_adapter_unloads_total", "Adapter versions an engine unloaded",
                                       ["engine"], registry=r)
        self.adapter_pushes = Counter("colocd_adapter_pushes_total",
                                      "Adapter pushes by outcome (committed, refused, failed)", ["outcome"], registry=r)
        self.adapter_disk_bytes = Gauge("colocd_adapter_disk_bytes",
                                        "Bytes of the adapter folders the loaded versions keep", registry=r)
        self.declare(())
        self._leases: dict[int, LeaseReport] = {}
        self._node: NodeState | None = None

    def declare(self, engines: Iterable[str], launched: Iterable[str] = ()) -> None:
        """Every event counter and histogram at 0 for each of ``engines`` (``launched``: those colocd launches) and
        label value, so the first event is an increase Prometheus can see."""
        for phase in TRANSITION_PHASES:
            self.phase_duration.labels(phase, "all")
            for outcome in TRANSITION_OUTCOMES:
                self.transitions.labels(phase, outcome)
        self.phase_duration.labels("weights", "all")
        for outcome in SESSION_OUTCOMES:
            self.weight_session_duration.labels(outcome)
            self.weight_sessions.labels(outcome)
        for part in PARTS:
            self.step_part_duration.labels(part)
        for substep in TRAINER_SUBSTEPS:
            self.trainer_substep_duration.labels(substep)
        for outcome in ADAPTER_OUTCOMES:
            self.adapter_pushes.labels(outcome)
        for kind in FALLBACK_KINDS:
            self.fallbacks.labels(kind)
        for requested, mode in WEIGHT_SYNC_MODES:
            self.weight_syncs.labels(requested, mode)
        for engine in engines:
            for phase in (*TRANSITION_PHASES, "sleep", "resume"):  # a manual sleep or resume: per engine only
                self.phase_duration.labels(phase, engine)
            self.chunk_load_duration.labels(engine)
            self.adapter_load.labels(engine)
            self.adapter_unloads.labels(engine)
            self.engine_restarts.labels(engine)
            for action in RECONCILE_ACTIONS:
                self.reconcile_actions.labels(engine, action)
        for engine in launched:
            self.engine_launches.labels(engine)
            self.engine_launch_failures.labels(engine)

    def declare_engine(self, engine: str, *, transports: Iterable[str], gpus: Iterable[str] | None) -> None:
        """``engine``'s weight and memory series at 0 (freed bytes by each of ``gpus`` NVML reads, else by the
        engine's own report); repeated as engines attach."""
        self.weight_chunks.labels(engine)
        for transport in transports:
            self.weight_bytes.labels(engine, transport)
        for source in ["engine"] if gpus is None else [f"gpu:{gpu}" for gpu in gpus]:
            self.freed_bytes.labels(engine, source)
        for criterion in Settled:
            self.memory_confirm.labels(engine, criterion.value)

    def watch_node(self, engines: Iterable[str], launched: Iterable[str], *, busy: Callable[[], bool],
                   session_idle_s: Callable[[], float | None]) -> None:
        """Every event series at 0 for the node's engines, and the gauges read at each scrape (a scrape during a
        long transition says the node is busy). ``session_idle_s()``: the open session's idle age, None if none."""
        self.declare(engines, launched)
        self.node_busy.set_function(lambda: 1.0 if busy() else 0.0)
        self.session_open.set_function(lambda: 0.0 if session_idle_s() is None else 1.0)
        self.session_idle.set_function(lambda: session_idle_s() or 0.0)

    def set_node(self, node: NodeState) -> None:
        """The phase gauges; a new (step, phase) restarts the clock of ``colocd_node_phase_entered_...``."""
        if node is self._node:  # NodeState is replaced, never edited, on every move
            return
        if self._node is None or (node.phase, node.step) != (self._node.phase, self._node.step):
            self.node_phase_entered.set(time.time())
        self._node = node
        for phase in NodePhase:
            self.node_phase.labels(phase.value).set(1 if node.phase is phase else 0)
        self.node_step.set(node.step)

    def set_gpus(self, probe: NvmlProbe | None, engines: Mapping[str, Sequence[int | str]]) -> None:
        """NVML's reading of every engine's GPUs (``engines``: name → GPUs), each GPU once (labelled by index and
        UUID, as dcgm-exporter's series are), and per compute process; a failed read leaves the last values."""
        self.nvml_available.set(1 if probe is not None else 0)
        self.engine_gpu.clear()
        for name, gpus in engines.items():
            for gpu in gpus:
                self.engine_gpu.labels(name, str(gpu)).set(1)
        if probe is None:
            return
        gpus = list(dict.fromkeys(g for each in engines.values() for g in each))
        try:
            readings = probe.read_all(gpus)
            per_process = {str(g): probe.processes(g) for g in gpus}
            uuids = {str(g): probe.uuid(g) for g in gpus}
        except Exception as exc:  # NVML errors (a GPU fell off the bus) must not break a transition
            log.warning("NVML read failed; GPU memory gauges keep their last values: %s", exc)
            return
        for gpu, reading in readings.items():
            self.gpu_memory_used.labels(gpu, uuids[gpu]).set(reading.used_bytes)
            self.gpu_memory_free.labels(gpu, uuids[gpu]).set(reading.free_bytes)
            self.gpu_memory_total.labels(gpu, uuids[gpu]).set(reading.total_bytes)
        self.gpu_process_memory.clear()  # processes come and go; keep only the live ones
        for gpu, procs in per_process.items():
            for pid, nbytes in procs.items():
                self.gpu_process_memory.labels(gpu, str(pid)).set(nbytes)

    def record_leases(self, report: LeaseReport) -> None:
        """A trainer rank's lease report (``colocd.trainer.leases``): the gauges are its last report, the counters
        add what its totals grew by (totals that went down are a new trainer process, counted from zero)."""
        rank = str(report.rank)
        previous = self._leases.get(report.rank)
        grew_leases, grew_bytes = report.reclaimed, report.reclaimed_bytes
        if previous is not None and report.reclaimed >= previous.reclaimed:
            grew_leases -= previous.reclaimed
            grew_bytes = max(report.reclaimed_bytes - previous.reclaimed_bytes, 0)
        self._leases[report.rank] = report
        self.ipc_exported_bytes.labels(rank).set(report.exported_bytes)
        self.ipc_retained_bytes.labels(rank).set(report.retained_bytes)
        if grew_leases:
            self.ipc_reclaimed.labels(rank).inc(grew_leases)
            self.ipc_reclaimed_bytes.labels(rank).inc(grew_bytes)
            log.warning("trainer rank %d reclaimed %d IPC lease(s), %d bytes, that a consumer never let go "
                        "(now exported %d, retained %d bytes)", report.rank, grew_leases, grew_bytes,
                        report.exported_bytes, report.retained_bytes)

    def observe_phase(self, phase: str, engine: str, seconds: float) -> None:
        """One transition's time on ``engine`` ('all': the node)."""
        self.phase_duration.labels(phase, engine).observe(seconds)
        self.last_phase_duration.labels(phase, engine).set(seconds)

    def observe_call(self, substep: str, engine: str, seconds: float) -> None:
        self.step_duration.labels(substep, engine).observe(seconds)
        self.last_substep_duration.labels(substep, engine).set(seconds)

    async def current(self) -> bytes:
        """The exposition as of this call, rendered in a worker thread."""
        return await asyncio.to_thread(generate_latest, self.registry)


@dataclass(frozen=True, slots=True)
class LeaseReport:
    """One trainer rank's IPC leases: bytes exported and retained now, reclaims so far."""

    rank: int
    exported_bytes: int
    retained_bytes: int
    reclaimed: int = 0
    reclaimed_bytes: int = 0
