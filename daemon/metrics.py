"""Prometheus metrics owned by one daemon instance (its own registry: no global state).

The text exposition (tens of KB, ~10-30 ms to render on a small CPU) is rendered once per change
and shared by every reader, in a worker thread so the event loop keeps serving: the owner calls
``changed()`` after it updates series, a scrape awaits ``current()``.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

__all__ = ["Metrics"]

_DURATION_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)

# NVML confirmation is meant to cost a few milliseconds (issue 12: <= 5 ms median per transition).
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
        # Trainer-side IPC leases (daemon/leases.py), as each trainer rank last reported them.
        self.ipc_exported_bytes = Gauge(
            "colocd_ipc_exported_bytes", "Bytes a trainer rank holds exported for engines (chunks in flight, "
            "ring slots, zero-copy storages, shm segments), as of its last report", ["rank"], registry=r)
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
        self.node_step = Gauge("colocd_node_step", "Current step of the node", registry=r)
        # -- the operator's view (issue 14): step breakdown, GPU memory detail, engine lifecycle ------------
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
        self._version = 1  # bumped by changed(); the rendering below is of _rendered_version
        self._rendered = b""
        self._rendered_version = 0
        self._rendering: asyncio.Future[None] | None = None

    def exposition(self) -> bytes:
        """Render now, on the calling thread (tests, tools); the daemon's route uses ``current()``."""
        return generate_latest(self.registry)

    def changed(self) -> None:
        """Series were updated: the next scrape renders once, for every reader waiting on it."""
        self._version += 1

    async def current(self) -> bytes:
        """The exposition as of this call: every update made before it is in it (read your writes).

        Concurrent scrapes share one render; a render runs in a thread, never on the event loop.
        """
        wanted = self._version
        while self._rendered_version < wanted:
            if self._rendering is None:
                self._rendering = asyncio.ensure_future(self._render())
            await asyncio.shield(self._rendering)
        return self._rendered

    async def _render(self) -> None:
        version = self._version
        try:
            text = await asyncio.to_thread(generate_latest, self.registry)
        finally:
            self._rendering = None
        if version > self._rendered_version:
            self._rendered, self._rendered_version = text, version
