"""``python3 -m benchmarks.switch``: the full colocated handoff, step after step, per preset, against the floor.

    python3 -m benchmarks.switch --model qwen3-8b --device cuda --rollout-s 2 \
        --out benchmarks/results/switch-qwen3-8b-h200.json
    python3 -m benchmarks.switch --model tiny --device cpu --steps 1 --warmup 0 --groups 2   # CPU smoke run
    python3 -m benchmarks.switch --model qwen3-8b --device cuda --presets tuned --sync sync,async   # sync vs async

Three processes, as in ``python3 -m benchmarks.weights``: this one is a training rank, a reference engine
holds the checkpoint's shapes plus a KV cache (``benchmarks.sink_engine``), and a real
``colocd serve`` sits between them. The rank holds what a Megatron rank with a distributed optimizer
holds (``offload.RankState``: bf16 weights, a bf16 grad buffer, an fp32 master + Adam
shard) and the Megatron set of process groups (world size 1 on one GPU: every group is a one-rank
communicator). Every step runs the whole handoff through the ``TrainerAgent``:

    resume   POST train (engine releases all tags, NVML confirms), groups resumed/rebuilt, state onloaded
    train    real optimizer work on the shard (plus a token-sized forward/backward)
    sleep    optimizer offloaded, grads dropped, groups paused per policy, cleanup, POST sync (weights back)
    update   WeightPusher push shaped by the sync reply's pipeline plan (checksum-verified afterwards)
    wake     weights offloaded, cleanup, POST rollout (KV back)
    rollout  real generation on the engine; memory of both processes read from NVML meanwhile

``--sync async`` runs the same step with ``sync: {mode: async}`` through ``AsyncWeightSync``: the update
is only the snapshot of the weights into a second buffer (on the device when it fits), and the push runs
in the background while the trainer does its post-step work (offloading its weights, cleanup); the wake
joins it before the rollout. ``--sync sync,async`` runs both per preset in one run (``<preset>+async``),
and the summary's ``step_s`` (train + switch) compares them (``targets.async_step_speedup``).

A preset is a policy document applied to the daemon (``PUT /v1/policies``) plus the trainer-side
settings the policy does not carry (the export format). The floor is measured in the same run: the
bytes the switch must move over the pinned and device copy rates, plus allocating and releasing the
memory both sides must give back, each timed in this process.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch
import torch.distributed as dist

from colocd.api.client import AsyncColocdClient
from colocd.api.procs import DaemonProcess
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.policies import CleanupPlan
from colocd.trainer.agent import TrainerAgent
from colocd.trainer.async_push import AsyncWeightSync
from colocd.trainer.cleanup import run_cleanup
from colocd.trainer.groups import GroupLifecycle, GroupSpec
from colocd.trainer.push import WeightPusher

from . import ShowDefaults
from .offload import OffloadReport, RankState
from .onload import onloader
from .records import write_record
from .sink import MODEL_SHAPES, device_checksum, hf_shapes
from .sink_engine import sink_launch
from .weights import measure_floor
from .window_memory import PeakSampler

__all__ = ["PRESETS", "Preset", "SwitchSettings", "main", "run_switch_bench"]

GIB = 1 << 30

# Megatron's per-rank groups (parallel_state.py), as in benchmarks/groups.py.
MEGATRON_GROUPS = ("tp", "pp", "dp", "dp_cp", "cp", "tp_pp", "tp_dp", "tp_dp_cp", "ep", "tp_ep", "expert_dp",
                   "embedding", "position_embedding", "mp")

WORLD_SIZE_1 = (
    "World size 1 on one GPU: every process group is a one-rank communicator, so group costs are the "
    "fixed ones (init/destroy, waits, canaries, per-communicator memory), not NVLink buffers or "
    "cross-rank skew. The optimizer shard is 1/--optimizer-shards of the parameters (Megatron's "
    "distributed optimizer over that many data-parallel ranks); the other shards' updates, which an "
    "all-gather would bring, are not simulated."
)


@dataclass(frozen=True, slots=True)
class Preset:
    """A policy document for the daemon plus the trainer-side export format."""

    name: str
    groups: str  # process_groups document (YAML flow mapping)
    pipeline: str  # pipeline document; {transport} is filled per device
    cleanup: str
    export: str | None  # WeightPusher transport overriding the plan's (None: the plan's)
    about: str
    overlap_groups: bool = False  # TrainerAgent(overlap_groups=...): group pause/resume off the critical path
    # The trainer's offloads run while it posts sync / rollout and pushes (TrainerAgent's ``freeing``): the
    # daemon's headroom check lets the engines resume at once when NVML shows the room, else they wait.
    overlap_copies: bool = False
    onload: str = "bulk"  # how the rank's state comes back (benchmarks/onload.py: bulk, interleaved, interleaved2)
    # Strictly memory-neutral: rollout is posted only once the weights offload, its cleanup and the background
    # group pause have all ended, so the engines' KV resume and generation start beside a settled trainer.
    settle_before_rollout: bool = False
    # The weights' copies to the host start beside the push (both only read them); their storage goes once
    # the push has ended. With settle_before_rollout only (the rollout waits for the whole offload anyway).
    offload_weights_during_push: bool = False

    def policy_yaml(self, transport: str) -> str:
        return (
            "apiVersion: colocd/v1\n"
            f"process_groups: {self.groups}\n"
            f"pipeline: {self.pipeline.replace('{transport}', transport)}\n"
            f"cleanup: {self.cleanup}\n"
        )


_SEED_GROUPS = "{policy: destroy, post_destroy_wait_s: 2.0}"
_AUTO_GROUPS = "{policy: auto, max_resident_gib: 0.25, post_destroy_wait_s: 2.0}"


def _overlap_pipeline(depth: int, bucket_mb: int) -> str:
    return f"{{policy: overlap, depth: {depth}, bucket_mb: {bucket_mb}, transport: {{transport}}}}"


_FAST_PIPELINE = _overlap_pipeline(2, 4096)

PRESETS: dict[str, Preset] = {
    "seed-baseline": Preset(
        "seed-baseline",
        _SEED_GROUPS,
        "{policy: serial, bucket_mb: 512, transport: {transport}}",
        "{policy: aggressive, max_retries: 3, min_freed_gib: 1.0}",
        "per_tensor",
        "slime/Relax defaults: groups destroyed with a 2 s wait, serial 512 MiB buckets of per-tensor "
        "IPC handles, gc + synchronize + empty_cache (retried while >= 1 GiB freed)",
    ),
    "tuned": Preset(
        "tuned",
        _AUTO_GROUPS,
        _FAST_PIPELINE,
        "{policy: empty_cache}",
        None,
        "groups kept only while they hold <= 0.25 GiB, else destroyed (every group at once) with the 2 s "
        "wait deferred to the next rebuild, and both the destroy and the rebuild run off the critical path "
        "(overlapped with the weight push and the state onload); 2 fresh 4 GiB buckets in flight "
        "(overlap2@4096, the fastest transport that keeps no trainer memory through the rollout); "
        "empty_cache only; the optimizer offload runs beside the sync and the push; rollout is posted once "
        "the weights offload, its cleanup and the group destroy have ended (memory-neutral)",
        overlap_groups=True,
        overlap_copies=True,
        settle_before_rollout=True,
    ),
    "tuned-serial-groups": Preset(
        "tuned-serial-groups",
        _AUTO_GROUPS,
        _FAST_PIPELINE,
        "{policy: empty_cache}",
        None,
        "as tuned, but the group destroy and rebuild run in line (before sync, after train)",
        overlap_copies=True,
    ),
    "tuned-keep": Preset(
        "tuned-keep",
        "{policy: keep_alive}",
        _FAST_PIPELINE,
        "{policy: empty_cache}",
        None,
        "as tuned, but the groups are kept alive through the rollout (no rebuild; their memory stays)",
        overlap_copies=True,
    ),
}
PRESETS["tuned-onload"] = dataclasses.replace(
    PRESETS["tuned"], name="tuned-onload", onload="interleaved",
    about="as tuned, with the state onload interleaved: each copy queued as soon as its destination exists, "
          "optimizer shard first, so the allocations run while the copy engine moves bytes (benchmarks/onload.py)")
PRESETS["tuned-onload2"] = dataclasses.replace(
    PRESETS["tuned"], name="tuned-onload2", onload="interleaved2",
    about="as tuned-onload, with the copies dealt over two copy streams (benchmarks/onload.py)")
PRESETS["tuned-3x2048"] = dataclasses.replace(
    PRESETS["tuned"], name="tuned-3x2048",
    pipeline=_overlap_pipeline(3, 2048),
    about="as tuned, with 3 fresh 2 GiB buckets in flight instead of 2 of 4 GiB (twice the chunks, each "
          "bucket's IPC handle opened and closed in the engine; 6 GiB staged during the push instead of 8)")
PRESETS["tuned-3x4096"] = dataclasses.replace(
    PRESETS["tuned"], name="tuned-3x4096",
    pipeline=_overlap_pipeline(3, 4096),
    about="as tuned, with 3 fresh 4 GiB buckets in flight instead of 2 (12 GiB staged during the push instead of 8)")
# Not memory-neutral: the paused window (the engines' generation) opens beside memory still going.
PRESETS["tuned-early"] = dataclasses.replace(
    PRESETS["tuned"], name="tuned-early", settle_before_rollout=False,
    about="as tuned, but rollout is posted while the weights are still being copied out and the groups "
          "destroyed (the daemon refuses the engines' resume until NVML shows the room): faster where the GPU "
          "has it, not memory-neutral")
PRESETS["tuned-split"] = dataclasses.replace(
    PRESETS["tuned"], name="tuned-split",
    groups="{policy: auto, max_resident_gib: 0.25, post_destroy_wait_s: 2.0, rebuild: split_shared}",
    about="as tuned, with the groups rebuilt as ncclCommSplit children of one parent bound to the device "
          "sharing its resources (rebuild: split_shared), parent destroyed with them: a destroy short enough to "
          "hide behind the offloads")
PRESETS["tuned-split-early"] = dataclasses.replace(
    PRESETS["tuned-split"], name="tuned-split-early", offload_weights_during_push=True,
    about="as tuned-split, with the weights' copies to the host started beside the push (their storage goes "
          "once the push has ended)")
DEFAULT_PRESETS = ("seed-baseline", "tuned", "tuned-serial-groups", "tuned-keep")


@dataclass(frozen=True, slots=True)
class SwitchSettings:
    model: str = "tiny"
    device: str = "cpu"
    presets: tuple[str, ...] = DEFAULT_PRESETS
    steps: int = 3
    warmup: int = 1
    optimizer_shards: int = 8
    groups: int = 14
    train_tokens: int = 512
    gen_requests: int = 8
    gen_tokens: int = 32
    rollout_s: float = 0.0  # the rollout window lasts at least this long (generation repeats): deferred waits hide
    mem_fraction: float = 0.80  # engine static memory (weights + KV) as a share of the GPU, as SGLang's
    kv_gib: float | None = None  # overrides the KV size mem_fraction gives
    post_destroy_wait_s: float | None = None  # overrides the presets' 2 s (the smoke test keeps it)
    sync_modes: tuple[str, ...] = ("sync",)  # per preset: sync, async (a background push from a snapshot)
    memory_sample_ms: float = 2.0  # NVML per-process readings over the paused window, this often
    seed: int = 0
    out: str | None = None


@dataclass
class StepRecord:
    """One handoff; seconds unless named otherwise."""

    step: int
    warmup: bool
    resume_s: float = 0.0
    train_s: float = 0.0
    sleep_s: float = 0.0
    update_s: float = 0.0
    wake_s: float = 0.0
    switch_s: float = 0.0  # resume + sleep + update + wake
    step_s: float = 0.0  # train + switch: what async can shorten
    sync_mode: str = "sync"  # what ran (async falls back to sync when no second buffer fits)
    parts: dict[str, float] = field(default_factory=dict)  # where each phase's time went
    offloaded_bytes: int = 0  # device → pinned host this step
    onloaded_bytes: int = 0  # pinned host → device
    pushed_bytes: int = 0
    chunks: int = 0
    transport: str = ""
    verified: bool = False
    onload_intact: bool | None = None  # the onload brought back the bytes the last offload took (None: first step)
    group_actions: list[str] = field(default_factory=list)
    memory: dict[str, int | None] = field(default_factory=dict)  # paused window (rollout), at its start
    memory_settled: dict[str, int | None] = field(default_factory=dict)  # once background group work ended
    # Maxima sampled from posting rollout (``call``) and from its reply (``window``) until the next train.
    memory_peak: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # e.g. why the daemon refused an early phase call
    loss: float = 0.0
    generated_tokens: int = 0


# --- GPU memory through NVML ----------------------------------------------------------------------


class _Nvml:
    """Per-process and device memory on one GPU; every reading is None where NVML cannot answer."""

    def __init__(self, device: torch.device) -> None:
        self._handle: Any = None
        self._nvml: Any = None
        if device.type != "cuda":
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            try:
                self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
            except Exception:  # UUID spelling differs: CUDA_VISIBLE_DEVICES is unset here, the index matches
                self._handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
            self._nvml = pynvml
        except Exception:  # no NVML here: memory readings are reported as None
            self._handle = None

    def read(self, pids: dict[str, int | None]) -> dict[str, int | None]:
        out: dict[str, int | None] = {f"{k}_nvml_bytes": None for k in pids}
        out["device_used_bytes"] = None
        if self._handle is None:
            return out
        n = self._nvml
        out["device_used_bytes"] = int(n.nvmlDeviceGetMemoryInfo(self._handle).used)
        try:
            used = {p.pid: p.usedGpuMemory for p in n.nvmlDeviceGetComputeRunningProcesses(self._handle)}
        except Exception:
            return out
        for name, pid in pids.items():
            value = used.get(pid)
            out[f"{name}_nvml_bytes"] = None if value is None else int(value)
        return out


# --- the floor --------------------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _best(fn: Callable[[], float], repeats: int = 3) -> float:
    fn()  # warm-up
    return min(fn() for _ in range(repeats))


def measure_copy_rates(device: torch.device, nbytes: int) -> dict[str, float]:
    """Device → pinned host and back, best of 3 after a warm-up, in bytes per second."""
    gpu = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")

    def timed(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], float]:
        def run() -> float:
            _sync(device)
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            _sync(device)
            return time.perf_counter() - t0
        return run

    d2h = nbytes / _best(timed(host, gpu))
    h2d = nbytes / _best(timed(gpu, host))
    del gpu, host
    _empty_cache(device)
    return {"d2h_bytes_per_s": d2h, "h2d_bytes_per_s": h2d, "probe_bytes": float(nbytes)}


def measure_alloc(device: torch.device, make: Callable[[], list[torch.Tensor]]) -> dict[str, float]:
    """Allocate what ``make`` builds, then release it back to the driver (empty_cache); best of 3."""
    def once() -> tuple[float, float]:
        _sync(device)
        t0 = time.perf_counter()
        held = make()
        _sync(device)
        t1 = time.perf_counter()
        del held
        _empty_cache(device)
        _sync(device)
        return t1 - t0, time.perf_counter() - t1

    once()
    runs = [once() for _ in range(3)]
    return {"alloc_s": min(r[0] for r in runs), "release_s": min(r[1] for r in runs)}


# --- one preset ------------------------------------------------------------------------------------


class _Rank:
    """The training rank: state, groups, agent; one per benchmark, shared by the presets."""

    def __init__(self, settings: SwitchSettings, device: torch.device, client: AsyncColocdClient,
                 life: GroupLifecycle, state: RankState) -> None:
        self.settings = settings
        self.device = device
        self.client = client
        self.life = life
        self.state = state

    def all_reduce(self, tensor: torch.Tensor) -> None:
        group = next((g for spec, g in self.life.groups() if spec.name.startswith("dp#")), None)
        if group is not None:
            dist.all_reduce(tensor, group=group)


async def _run_preset(preset: Preset, rank: _Rank, http: httpx.AsyncClient, engine_url: str, first_step: int,
                      nvml: _Nvml, pids: dict[str, int | None], daemon_url: str,
                      mode: str = "sync") -> list[StepRecord]:
    s, state, device = rank.settings, rank.state, rank.device
    agent = TrainerAgent(rank.client, groups=rank.life, device=device, overlap_groups=preset.overlap_groups)
    transport = "cuda_ipc" if device.type == "cuda" else "inline"
    export = preset.export if device.type == "cuda" else None
    document = preset.policy_yaml(transport) + f"sync: {{mode: {mode}}}\n"
    if s.post_destroy_wait_s is not None:
        document = document.replace("post_destroy_wait_s: 2.0", f"post_destroy_wait_s: {s.post_destroy_wait_s:g}")
    put = await http.put(f"{daemon_url}/v1/policies", content=document.encode(),
                         headers={"Content-Type": "application/yaml"})
    put.raise_for_status()
    records = []
    onload_state = onloader(state, preset.onload)
    # The trained weights' checksum when they went out (the previous step's): what the onload must bring back.
    offloaded_sum: list[list[int]] | None = None
    for i in range(s.warmup + s.steps):
        step = first_step + i
        rec = StepRecord(step, warmup=i < s.warmup)
        parts = rec.parts

        # resume: the engine gives everything back, the rank's groups and state come back.
        t0 = time.perf_counter()
        train = await agent.train(step)
        t1 = time.perf_counter()
        onload = await asyncio.to_thread(onload_state, ("weights", "grads", "optimizer"))
        waited = await agent.groups_ready()  # overlapped rebuild: what the onload did not hide
        t2 = time.perf_counter()
        groups_resume = _groups_s(agent, "groups_resume")
        parts["resume.train_phase"] = train["duration_s"]
        parts["resume.onload"] = onload.seconds
        if preset.overlap_groups:
            parts["resume.groups_overlapped"] = groups_resume
            parts["resume.groups_wait"] = waited
            parts["resume.http_and_client"] = (t1 - t0) - train["duration_s"]
        else:
            parts["resume.groups"] = groups_resume
            parts["resume.http_and_client"] = (t1 - t0) - train["duration_s"] - groups_resume
        rec.onloaded_bytes = onload.copied_bytes
        rec.resume_s = t2 - t0
        rec.group_actions.append(f"resume:{agent.last_reports.get('groups_resume', {}).get('action')}")
        if why := (agent.last_reports.get("groups_resume") or {}).get("fallback_reason"):
            rec.notes.append(f"groups: {why}")  # e.g. rebuild split_shared unavailable here, and why

        if offloaded_sum is not None:  # outside the timed windows: the benchmark's check, not the switch's
            rec.onload_intact = device_checksum(w for _, w in state.named_weights()) == offloaded_sum
            _empty_cache(device)  # the check's temporaries are the benchmark's, not the switch's memory
        t2 = time.perf_counter()

        # train: a token amount of real work; weights change, so the sync has new bytes to move.
        rec.loss = await asyncio.to_thread(state.step, s.train_tokens, seed=s.seed * 100_003 + step,
                                           all_reduce=rank.all_reduce)
        _sync(device)
        rec.train_s = time.perf_counter() - t2
        expected = device_checksum(w for _, w in state.named_weights())
        offloaded_sum = expected  # the wake offloads these weights unchanged

        # sleep: optimizer state out, grads dropped; groups paused and cleanup per policy; engine weights back.
        overlap = preset.overlap_copies and mode == "sync"
        plan_doc = agent.directives.get("cleanup")  # the train reply's plan, the one sync enacts

        t3 = time.perf_counter()
        if overlap:
            state.offload(("grads",))  # dropped, not copied; the agent's cleanup gives them back
            off_task, start_offload = _offload_when_started(state, ("optimizer",), plan_doc, device)
            agent.last_reports.pop("sync_room", None)
            agent.last_reports.pop("rollout_room", None)
            t4 = time.perf_counter()
            sync = await agent.sync(step, freeing=start_offload)
        else:
            off = await asyncio.to_thread(state.offload, ("grads", "optimizer"))
            t4 = time.perf_counter()
            sync = await agent.sync(step)
        t5 = time.perf_counter()
        groups_pause = 0.0 if preset.overlap_groups else _groups_s(agent, "groups_report")
        cleanup_s = (agent.last_reports.get("cleanup") or {}).get("seconds", 0.0)
        parts["sleep.groups"] = groups_pause
        parts["sleep.cleanup"] = cleanup_s
        parts["sleep.sync_phase"] = sync["duration_s"]
        parts["sleep.http_and_client"] = (t5 - t4) - groups_pause - cleanup_s - sync["duration_s"]
        if not overlap:
            parts["sleep.offload_optimizer"] = off.seconds
            rec.offloaded_bytes = off.copied_bytes
        rec.sleep_s = t5 - t3

        # update_weights: shaped by the pipeline plan in the sync reply. Async: only the snapshot is on the
        # critical path here; the push runs during the wake's post-step work and is joined before the rollout.
        plan = dict(sync["directives"]["pipeline"])
        if export is not None:
            plan["transport"] = export
        pusher = WeightPusher.from_plan(rank.client, plan)
        weight_sync = AsyncWeightSync(pusher)
        weight_sync.follow(sync["directives"].get("weight_sync"))
        early = overlap and preset.offload_weights_during_push and preset.settle_before_rollout
        pushed = threading.Event()
        offw_early: asyncio.Future[tuple[OffloadReport, float]] | None = None
        if early:  # the weights' copies queue behind the optimizer's; their storage goes once the push ended
            offw_early = asyncio.ensure_future(asyncio.to_thread(
                _offload_and_clean, state, ("weights",), plan_doc, device, functools.partial(_wait_set, pushed)))
        try:
            # The early offload drops the weights only once ``pushed`` is set, so they are all here until then.
            await weight_sync.start(state.named_weights(), version=f"{preset.name}-{mode}-{step}", step=step)
        finally:
            pushed.set()
        t6 = time.perf_counter()
        rec.update_s = t6 - t5
        report = weight_sync.report() or {}
        rec.sync_mode = str(report.get("mode", "sync"))
        if rec.sync_mode == "async":
            parts["update.snapshot"] = float(report.get("snapshot_s") or 0.0)

        if overlap:
            # The push is done (sync mode): verify it before the wake starts, so the read is not timed (with the
            # weights already going out beside the push, after the wake instead: nothing may run untimed).
            push = weight_sync.last_push
            log = list(pusher.chunk_log)
            await pusher.aclose()
            if not early:
                rec.verified = await _engine_holds(http, engine_url, state.names, expected)
            # wake_up: the optimizer offload (running since sleep) must end before the weights go out on the
            # same copy stream; the weights offload runs beside the rollout call, which waits for it (and for
            # a background group pause) only if the daemon says the engines' KV cache does not fit yet.
            # Early, the offload runs on, so the wake starts at once; and the optimizer's offload, which waits for its
            # copy stream, ends with the weights' copies queued behind it: wake.optimizer_offload_wait holds most of
            # the weights offload then, wake.offload_wait_before_rollout the rest.
            t7 = t6 if early else time.perf_counter()
            off, off_clean = await off_task
            # The push's buckets and the optimizer's blocks go back to the driver before the weights' copies
            # start (nothing in flight: milliseconds), so the rollout's KV cache can fit beside the weights.
            # (Early, the weights' copies are in flight: a cudaFree now would wait for them all.)
            early_clean = 0.0 if early else await asyncio.to_thread(_clean, plan_doc, device)
            parts["wake.cleanup_before_offload"] = early_clean
            t7b = time.perf_counter()
            offw_task = offw_early or asyncio.ensure_future(
                asyncio.to_thread(_offload_and_clean, state, ("weights",), plan_doc, device))
            agent.last_reports.pop("groups_pause_wait_s", None)
            if preset.settle_before_rollout:
                # Strict: the trainer is settled (offload, cleanup and, inside rollout(), the group pause
                # awaited) before the engines take their KV cache back and generate.
                await offw_task
                parts["wake.offload_wait_before_rollout"] = time.perf_counter() - t7b
                sampler = _window_sampler(nvml, pids, s)
                rollout = await agent.rollout(step)
            else:
                sampler = _window_sampler(nvml, pids, s)
                rollout = await agent.rollout(step, freeing=offw_task)
            t9 = time.perf_counter()
            # 1.0: the offload had ended before rollout was posted, and so had the group pause (the agent
            # waited for it before posting: it reports that wait only then).
            parts["wake.settled_before_rollout"] = float(
                preset.settle_before_rollout and "groups_pause_wait_s" in agent.last_reports)
            sampler.mark()
            offw, cleanup2 = await offw_task
            t10 = time.perf_counter()
            if early:
                rec.verified = await _engine_holds(http, engine_url, state.names, expected)
            room = agent.last_reports.get("rollout_room") or {}
            for phase in ("sync", "rollout"):
                if refused := (agent.last_reports.get(f"{phase}_room") or {}).get("refused"):
                    rec.notes.append(f"{phase} refused at first: {refused}")
            parts["sleep.offload_optimizer"] = off.seconds  # overlapped with sync + push
            parts["sleep.cleanup_after_offload"] = off_clean
            parts["wake.optimizer_offload_wait"] = t7b - t7 - early_clean
            parts["wake.rollout_posted_early"] = 1.0 if room.get("early") else 0.0
            parts["wake.rollout_room_wait"] = float(room.get("waited_s") or 0.0)
            parts["wake.offload_after_rollout_reply"] = t10 - t9
            rec.offloaded_bytes = off.copied_bytes
            pause_wait = float(agent.last_reports.get("groups_pause_wait_s", 0.0))
            rec.wake_s = t10 - t7
            parts["wake.http_and_client"] = ((t9 - t7b) - rollout["duration_s"] - parts["wake.rollout_room_wait"]
                                             - parts.get("wake.offload_wait_before_rollout", 0.0) - pause_wait)
        else:
            # wake_up: weights out, cleanup per policy (the push runs meanwhile if async), engine KV back.
            t7 = time.perf_counter()
            offw, cleanup2 = await asyncio.to_thread(_offload_and_clean, state, ("weights",), plan_doc, device)
            t8 = time.perf_counter()
            push = await weight_sync.join() or weight_sync.last_push
            joined = time.perf_counter()
            log = list(pusher.chunk_log)
            await pusher.aclose()
            report = weight_sync.report() or {}
            if rec.sync_mode == "async":
                parts["update.push_overlapped"] = float(report.get("overlap_s") or 0.0)
                parts["wake.join_wait"] = joined - t8
            rec.verified = await _engine_holds(http, engine_url, state.names, expected)
            t9 = time.perf_counter()  # the verification read is the benchmark's, not the switch's
            agent.last_reports.pop("groups_pause_wait_s", None)
            sampler = _window_sampler(nvml, pids, s)
            rollout = await agent.rollout(step)
            t10 = time.perf_counter()
            sampler.mark()
            pause_wait = float(agent.last_reports.get("groups_pause_wait_s", 0.0))
            parts["wake.http_and_client"] = (t10 - t9) - rollout["duration_s"] - pause_wait
            rec.wake_s = (joined - t7) + (t10 - t9)  # sync: the join is immediate (the push ran inside start())
        assert push is not None
        rec.pushed_bytes, rec.chunks, rec.transport = push.nbytes, push.chunks, str(plan["transport"])
        parts["update.chunks_engine"] = sum(c.load_s for c in log)
        parts["update.export"] = sum(c.export_s for c in log)
        rec.group_actions.append(f"pause:{(agent.last_reports.get('groups_report') or {}).get('action')}")
        parts["wake.offload_weights"] = offw.seconds
        parts["wake.cleanup"] = cleanup2
        parts["wake.rollout_phase"] = rollout["duration_s"]
        if preset.overlap_groups:
            parts["wake.groups_wait"] = pause_wait
        rec.offloaded_bytes += offw.copied_bytes
        rec.switch_s = rec.resume_s + rec.sleep_s + rec.update_s + rec.wake_s
        rec.step_s = rec.train_s + rec.switch_s
        for phase, reply in (("train", train), ("sync", sync), ("rollout", rollout)):
            for name, seconds in _span_totals(reply).items():
                parts[f"daemon.{phase}.{name}"] = seconds

        # rollout: the paused window. Memory first (the engine holds weights + KV), then real generation.
        rec.memory = {**nvml.read(pids), "trainer_torch_reserved_bytes":
                      int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else None,
                      "groups_kept_reported_bytes": (agent.last_reports.get("groups_report") or {}).get("kept_bytes")}
        if preset.overlap_groups:
            # A rollout posted before the background group pause ended (overlap_copies): the window's memory
            # once it has, read again (the engine's KV cache was allocated already, in the room NVML showed).
            parts["rollout.groups_pause_tail"] = await agent.groups_ready()
            parts["sleep.groups_overlapped"] = _groups_s(agent, "groups_report")
            rec.memory_settled = nvml.read(pids)
        window_start = time.perf_counter()
        rec.generated_tokens = await _generate(http, engine_url, s, step)
        while time.perf_counter() - window_start < s.rollout_s:
            rec.generated_tokens += await _generate(http, engine_url, s, step)
        rec.memory_peak = (await asyncio.to_thread(sampler.stop)).to_dict()  # the next train ends the window
        records.append(rec)
        print(f"  {preset.name}/{rec.sync_mode} step {step}{' (warm-up)' if rec.warmup else ''}: "
              f"step {rec.step_s:.3f} s, switch {rec.switch_s:.3f} s "
              f"(resume {rec.resume_s:.3f}, sleep {rec.sleep_s:.3f}, update {rec.update_s:.3f}, "
              f"wake {rec.wake_s:.3f}); verified={rec.verified}", flush=True)
    return records


def _offload_when_started(state: RankState, parts: tuple[str, ...], plan_doc: dict[str, Any] | None,
                          device: torch.device) -> tuple[asyncio.Future[tuple[OffloadReport, float]],
                                                         Callable[[], asyncio.Future[tuple[OffloadReport, float]]]]:
    """An offload task that starts when the returned function is called (the agent calls it after its
    cleanup, so the cleanup's cudaFree waits on no copy), and that function."""
    go: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def run() -> tuple[OffloadReport, float]:
        await go
        return await asyncio.to_thread(_offload_and_clean, state, parts, plan_doc, device)

    task = asyncio.ensure_future(run())

    def start() -> asyncio.Future[tuple[OffloadReport, float]]:
        go.set_result(None)
        return task

    return task, start


def _offload_and_clean(state: RankState, parts: tuple[str, ...], plan_doc: dict[str, Any] | None,
                       device: torch.device, before_drop: Callable[[], object] | None = None
                       ) -> tuple[OffloadReport, float]:
    """Offload ``parts``, then run the cleanup plan so their memory goes back to the driver."""
    report = state.offload(parts, before_drop=before_drop)
    return report, _clean(plan_doc, device)


def _wait_set(event: threading.Event, timeout_s: float = 600.0) -> None:
    """Block (a worker thread) until ``event`` is set; a push that never ends is an error, not a hang."""
    if not event.wait(timeout_s):
        raise TimeoutError(f"the weight push did not end within {timeout_s:g} s")


def _window_sampler(nvml: _Nvml, pids: dict[str, int | None], s: SwitchSettings) -> PeakSampler:
    """Started just before rollout is posted; ``mark`` at its reply, ``stop`` when the rollout ends."""
    sampler = PeakSampler(lambda: nvml.read(pids), s.memory_sample_ms / 1e3)
    sampler.start()
    return sampler


def _clean(plan_doc: dict[str, Any] | None, device: torch.device) -> float:
    """Run the cleanup plan of the train reply (if any); its seconds."""
    return run_cleanup(CleanupPlan.model_validate(plan_doc), device=device).seconds if plan_doc else 0.0


async def _engine_holds(http: httpx.AsyncClient, engine_url: str, names: Sequence[str],
                        expected: list[list[int]]) -> bool:
    """Whether the engine's device checksums of ``names`` are the trainer's (``expected``)."""
    sink = (await http.get(f"{engine_url}/colocd/sink")).raise_for_status().json()
    return [sink["checksums"].get(n) for n in names] == expected


def _span_totals(reply: dict[str, Any]) -> dict[str, float]:
    """Seconds per span name in a transition's trace (engine calls, NVML confirmation, ...)."""
    totals: dict[str, float] = {}
    for span in (reply.get("trace") or {}).get("spans", []):
        totals[span["name"]] = totals.get(span["name"], 0.0) + float(span["duration_s"])
    return totals


def _groups_s(agent: TrainerAgent, key: str) -> float:
    return float((agent.last_reports.get(key) or {}).get("seconds", 0.0))


async def _generate(http: httpx.AsyncClient, url: str, s: SwitchSettings, step: int) -> int:
    body = {
        "input_ids": [[1, 2 + (i % 5)] for i in range(s.gen_requests)],
        "sampling_params": [{"max_new_tokens": s.gen_tokens, "temperature": 1.0, "ignore_eos": True,
                             "sampling_seed": step * 1000 + i} for i in range(s.gen_requests)],
    }
    response = await http.post(f"{url}/generate", json=body)
    response.raise_for_status()
    return sum(len(item["output_ids"]) for item in response.json())


# --- summary ---------------------------------------------------------------------------------------


_FIELDS = ("switch_s", "resume_s", "sleep_s", "update_s", "wake_s", "train_s", "step_s")


_ENGINE_MEMORY_SPANS = ("daemon.train.release_memory", "daemon.sync.resume_memory", "daemon.rollout.resume_memory")


def _engine_alloc_seen(results: dict[str, list[StepRecord]]) -> float:
    """Fastest preset's median of the engine's release + resume calls per switch (inf if none ran)."""
    medians = [statistics.median(sum(r.parts.get(k, 0.0) for k in _ENGINE_MEMORY_SPANS) for r in recs)
               for recs in results.values() if recs]
    return min(medians, default=math.inf)


def _summary(name: str, records: Sequence[StepRecord], floor_s: float, strict_s: float) -> dict[str, Any]:
    timed = [r for r in records if not r.warmup] or list(records)
    out: dict[str, Any] = {"preset": name, "steps": len(timed)}
    for f in _FIELDS:
        out[f] = statistics.median(getattr(r, f) for r in timed)
    out["x_floor"] = out["switch_s"] / floor_s if floor_s > 0 else None
    out["x_floor_strict"] = out["switch_s"] / strict_s if strict_s > 0 else None
    keys = sorted({k for r in timed for k in r.parts})
    out["parts"] = {k: statistics.median(r.parts.get(k, 0.0) for r in timed) for k in keys}
    out["verified_all"] = all(r.verified for r in records)
    out["onload_intact_all"] = all(r.onload_intact is not False for r in records)
    for key in ("trainer_nvml_bytes", "engine_nvml_bytes", "device_used_bytes", "trainer_torch_reserved_bytes"):
        values = [v for r in timed if (v := r.memory.get(key)) is not None]
        out[key.replace("_bytes", "_gib_max")] = max(values) / GIB if values else None
    settled = [v for r in timed if (v := r.memory_settled.get("trainer_nvml_bytes")) is not None]
    out["trainer_nvml_settled_gib_max"] = max(settled) / GIB if settled else None
    # The maxima sampled over the whole paused window (from the rollout reply) and from posting rollout.
    for span in ("window", "call"):
        peaks = [v for r in timed if (v := (r.memory_peak.get(span) or {}).get("trainer_nvml_bytes")) is not None]
        out[f"trainer_{span}_peak_gib"] = max(peaks) / GIB if peaks else None
    out["memory_samples_min"] = min((int(r.memory_peak.get("window_samples") or 0) for r in timed), default=0)
    out["offloaded_bytes"] = timed[0].offloaded_bytes
    out["onloaded_bytes"] = timed[0].onloaded_bytes
    out["pushed_bytes"] = timed[0].pushed_bytes
    out["chunks"] = timed[0].chunks
    out["transport"] = timed[0].transport
    out["group_actions"] = sorted({a for r in timed for a in r.group_actions})
    out["sync_modes"] = sorted({r.sync_mode for r in timed})
    return out


def _table(summaries: list[dict[str, Any]], floor: dict[str, Any]) -> str:
    head = (f"{'preset':<20}{'switch s':>9}{'x floor':>8}{'x strict':>9}{'resume':>8}{'sleep':>8}{'update':>8}"
            f"{'wake':>8}{'trainer GiB start/settled/max':>31}{'engine GiB':>11}  ok")
    lines = [f"floor: {floor['total_s']:.3f} s per switch (strict: {floor['strict_total_s']:.3f} s) "
             f"(copies {floor['offload_s'] + floor['onload_s']:.3f} s over PCIe, {floor['device_copy_s'] * 1e3:.1f} ms "
             f"on the device, allocations {floor['alloc_s']:.3f} s)", head]
    for s in summaries:
        trainer = "/".join(_f(s[k], 2) for k in ("trainer_nvml_gib_max", "trainer_nvml_settled_gib_max",
                                                   "trainer_window_peak_gib"))
        lines.append(
            f"{s['preset']:<20}{s['switch_s']:>9.3f}{_f(s['x_floor'], 2):>8}{_f(s['x_floor_strict'], 2):>9}"
            f"{s['resume_s']:>8.3f}{s['sleep_s']:>8.3f}"
            f"{s['update_s']:>8.3f}{s['wake_s']:>8.3f}"
            f"{trainer:>31}"
            f"{_f(s['engine_nvml_gib_max'], 2):>11}  {'yes' if s['verified_all'] and s['onload_intact_all'] else 'NO'}")
    return "\n".join(lines)


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _trainer_gib(s: dict[str, Any]) -> float | None:
    """The trainer's GPU memory in the paused window: the largest of the maximum sampled over the whole
    window and the readings at its start and once settled (None where NVML gave nothing)."""
    values = [float(v) for k in ("trainer_window_peak_gib", "trainer_nvml_gib_max", "trainer_nvml_settled_gib_max")
              if (v := s.get(k)) is not None]
    return max(values) if values else None


def _targets(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    by = {s["preset"]: s for s in summaries}
    out: dict[str, Any] = {}
    tuned, seed = by.get("tuned"), by.get("seed-baseline")
    if tuned:
        out["tuned_x_floor"] = tuned["x_floor"]
        out["tuned_x_floor_strict"] = tuned["x_floor_strict"]
        out["tuned_within_1_3x_floor"] = tuned["x_floor"] is not None and tuned["x_floor"] <= 1.3
        out["tuned_within_1_3x_strict_floor"] = tuned["x_floor_strict"] is not None and tuned["x_floor_strict"] <= 1.3
    speedups = {name: by[name]["step_s"] / s["step_s"] for name in by
                if (s := by.get(f"{name}+async")) is not None and s["step_s"] > 0}
    if speedups:
        out["async_step_speedup"] = speedups  # sync step time / async step time, per preset (>1: async helps)
        out["async_ran_async"] = {n: by[f"{n}+async"]["sync_modes"] == ["async"] for n in speedups}
    if tuned and seed:
        out["speedup_vs_seed_baseline"] = seed["switch_s"] / tuned["switch_s"]
        out["speedup_at_least_3x"] = out["speedup_vs_seed_baseline"] >= 3.0
        t, b = _trainer_gib(tuned), _trainer_gib(seed)
        out["paused_trainer_gib"] = {"tuned": t, "seed-baseline": b}
        out["paused_memory_within_0_25_gib"] = None if t is None or b is None else t <= b + 0.25
    if seed:
        # Per preset: the paused window's maximum against the seed's + 0.25 GiB, and the time against the floor.
        base = _trainer_gib(seed)
        out["paused_window_max_gib"] = {name: _trainer_gib(p) for name, p in by.items()}
        out["memory_neutral"] = {name: None if (g := _trainer_gib(p)) is None or base is None else g <= base + 0.25
                                 for name, p in by.items()}
        out["x_floor"] = {name: p["x_floor"] for name, p in by.items()}
    return out


# --- the run ---------------------------------------------------------------------------------------


def _init_dist(device: torch.device) -> None:
    if not dist.is_initialized():
        # An in-process store: world size 1 needs no port.
        store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed, not declared
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=0, world_size=1)
    if device.type == "cuda":
        # NCCL's process-wide first-communicator memory is paid here, as in benchmarks/groups.py.
        warm = dist.new_group([0])
        dist.all_reduce(torch.ones(1, device=device), group=warm)
        dist.destroy_process_group(warm)


def _kv_bytes(settings: SwitchSettings, device: torch.device, weight_bytes: int) -> int:
    if settings.kv_gib is not None:
        return int(settings.kv_gib * GIB)
    if device.type != "cuda":
        return 1 << 20
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(settings.mem_fraction * total) - weight_bytes)


async def run_switch_bench(settings: SwitchSettings) -> dict[str, Any]:
    """Run every preset; print the table; return (and write to ``settings.out``) the JSON record."""
    if settings.model not in MODEL_SHAPES:
        raise ValueError(f"unknown model {settings.model!r}; known: {sorted(MODEL_SHAPES)}")
    unknown = [p for p in settings.presets if p not in PRESETS]
    if unknown:
        raise ValueError(f"unknown presets {unknown}; known: {sorted(PRESETS)}")
    if not settings.sync_modes or any(m not in ("sync", "async") for m in settings.sync_modes):
        raise ValueError(f"sync modes must be sync and/or async, got {settings.sync_modes}")
    device = torch.device(settings.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.set_device(device)
        torch.ones(1, device=device)
    shapes = hf_shapes(settings.model)
    owns_world = not dist.is_initialized()
    _init_dist(device)
    try:
        return await _run(settings, device, shapes)
    finally:
        if owns_world and dist.is_initialized():
            dist.destroy_process_group()


async def _run(settings: SwitchSettings, device: torch.device,
               shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    t_start = time.perf_counter()

    # The rank's state, built on the device, then measured and offloaded before the engine starts.
    state = RankState(shapes, device, shards=settings.optimizer_shards, seed=settings.seed)
    sizes = {p: state.nbytes(p) for p in ("weights", "grads", "optimizer")}
    weight_bytes = sizes["weights"]
    device_copy_s = measure_floor(state.named_weights(), device, 5)
    probe = min(4 * GIB, max(sizes["optimizer"], 1 << 20))
    rates = measure_copy_rates(device, probe)
    specs = [GroupSpec(MEGATRON_GROUPS[i % len(MEGATRON_GROUPS)] + f"#{i}", (0,)) for i in range(settings.groups)]
    life = GroupLifecycle(specs, device=device, group_timeout_s=300, agree_timeout_s=60)
    build = life.build()
    first_offload = state.offload(("weights", "grads", "optimizer"))
    gc.collect()
    _empty_cache(device)
    kv_bytes = _kv_bytes(settings, device, weight_bytes)

    # Allocation costs both sides pay per switch, measured here with the same shapes.
    def trainer_state() -> list[torch.Tensor]:
        held = [torch.empty(s, dtype=torch.bfloat16, device=device) for s in state.shapes]
        held.append(torch.zeros(state.param_numel, dtype=torch.bfloat16, device=device))
        held.append(torch.empty(3 * state.shard_numel, dtype=torch.float32, device=device))
        return held

    def engine_memory() -> list[torch.Tensor]:
        held = [torch.empty(s, dtype=torch.bfloat16, device=device) for _, s in shapes]
        held.append(torch.empty(kv_bytes, dtype=torch.uint8, device=device))
        return held

    alloc_trainer = measure_alloc(device, trainer_state)
    alloc_engine = measure_alloc(device, engine_memory)
    offload_bytes = sizes["weights"] + sizes["optimizer"]
    floor: dict[str, Any] = {
        "offload_s": offload_bytes / rates["d2h_bytes_per_s"],
        "onload_s": offload_bytes / rates["h2d_bytes_per_s"],
        "device_copy_s": device_copy_s,
        "alloc_s": sum(alloc_trainer.values()) + sum(alloc_engine.values()),
        "trainer_alloc": alloc_trainer,
        "engine_alloc": alloc_engine,
        "note": "bytes the switch must move over rates measured in this run, plus allocating and releasing "
                "(to the driver) the trainer state and the engine's weights + KV once each",
    }
    floor["total_s"] = floor["offload_s"] + floor["onload_s"] + floor["device_copy_s"] + floor["alloc_s"]
    print(f"python3 -m benchmarks.switch: {settings.model} on {device}; weights {weight_bytes / 1e9:.2f} GB, grads "
          f"{sizes['grads'] / 1e9:.2f} GB, optimizer shard (1/{settings.optimizer_shards}) "
          f"{sizes['optimizer'] / 1e9:.2f} GB, engine KV {kv_bytes / GIB:.2f} GiB, {settings.groups} groups; "
          f"floor {floor['total_s']:.3f} s", flush=True)

    workdir = tempfile.mkdtemp(prefix="colocd-bench-switch-")
    engine_cfg = ReferenceEngineConfig.model_validate({
        "name": "ref0",
        "url": "http://127.0.0.1:0",
        "device": settings.device,
        "launch": sink_launch(settings.model, kv_bytes / GIB, ready_timeout_s=600, log_file=f"{workdir}/engine.log"),
    })
    nvml = _Nvml(device)
    results: dict[str, list[StepRecord]] = {}
    failed: dict[str, str] = {}  # preset → why it stopped (the record keeps the others)
    async with ReferenceEngineProcess(engine_cfg) as engine:
        assert engine.url is not None
        engine_entry: dict[str, Any] = {"kind": "reference", "name": "ref0", "url": engine.url,
                                        "device": settings.device}
        if device.type == "cuda":
            engine_entry["gpus"] = [device.index or 0]  # the daemon confirms releases through NVML
        daemon_cfg = {"engines": [engine_entry], "timeouts": {"default_s": 600, "chunk_s": 600}}
        async with (
            DaemonProcess(daemon_cfg, workdir=workdir) as daemon,
            AsyncColocdClient(daemon.url) as client,
            httpx.AsyncClient(timeout=600, trust_env=False) as http,
        ):
            await client.wait_ready(120)
            pids = {"trainer": os.getpid(), "engine": engine.pid}
            rank = _Rank(settings, device, client, life, state)
            step = 1
            for name in settings.presets:
                for mode in settings.sync_modes:
                    key = name if mode == "sync" else f"{name}+{mode}"
                    try:
                        results[key] = await _run_preset(PRESETS[name], rank, http, engine.url, step, nvml, pids,
                                                         daemon.url, mode)
                    except Exception as exc:  # one device call measures every preset it can; this one is lost
                        if not results:
                            raise  # the first preset failing is the bench's own failure, not a preset's
                        failed[key] = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
                        print(f"  {key}: FAILED ({failed[key]}); the presets after it run on", flush=True)
                    step += settings.warmup + settings.steps
    life.close()
    # The allocation term measured in this process came out larger than what the engine's own release
    # and resume calls take (HTTP hop included); the strict floor uses the smaller of the two.
    engine_measured = sum(alloc_engine.values())
    seen = _engine_alloc_seen(results)
    floor["engine_alloc_seen_in_engine_s"] = seen
    floor["strict_total_s"] = floor["total_s"] - engine_measured + min(engine_measured, seen)
    summaries = [_summary(name, recs, floor["total_s"], floor["strict_total_s"]) for name, recs in results.items()]
    record = {
        "command": " ".join(["python3 -m benchmarks.switch", *sys.argv[1:]]),
        "model": settings.model,
        "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
        "gpu_total_bytes": torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None,
        "torch": torch.__version__,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,  # type: ignore[no-untyped-call]
        "settings": asdict(settings),
        "state_bytes": sizes,
        "pinned_host_bytes": state.pinned_bytes(),
        "engine": {"weight_bytes": weight_bytes, "kv_bytes": kv_bytes},
        "groups_build": asdict(build),
        "first_offload_s": first_offload.seconds,
        "rates": rates,
        "floor": floor,
        "presets": [{"name": n, "about": PRESETS[n].about, "policy": PRESETS[n].policy_yaml(
                        "cuda_ipc" if device.type == "cuda" else "inline"),
                     "trainer_export": PRESETS[n].export if device.type == "cuda" else None}
                    for n in settings.presets],
        "summary": summaries,
        "steps": {n: [asdict(r) for r in recs] for n, recs in results.items()},
        "targets": _targets(summaries),
        "failed_presets": failed,
        "caveats": [WORLD_SIZE_1],
        "seconds": time.perf_counter() - t_start,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(_table(summaries, floor), flush=True)
    print("targets: " + json.dumps(record["targets"]), flush=True)
    if failed:
        print("failed presets: " + json.dumps(failed), flush=True)
    if settings.out:
        write_record(Path(settings.out), record)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    """``python3 -m benchmarks.switch``: exit 1 when a preset failed or ended with weights it did not push."""
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.switch", description=__doc__.split("\n")[0],
                                formatter_class=ShowDefaults)
    p.add_argument("--model", default="tiny", help="tiny, qwen3-0.6b, qwen3-8b or qwen3-14b (HF shapes)")
    p.add_argument("--device", default="cpu", help="cpu (gloo, shm) or cuda")
    p.add_argument("--presets", default="seed-baseline,tuned,tuned-serial-groups,tuned-keep",
                   help="comma-separated: " + ", ".join(PRESETS))
    p.add_argument("--steps", type=int, default=3, help="timed handoffs per preset (median is reported)")
    p.add_argument("--warmup", type=int, default=1, help="untimed handoffs per preset first")
    p.add_argument("--optimizer-shards", type=int, default=8,
                   help="distributed-optimizer ranks: this rank holds 1/N of the fp32 master + Adam state")
    p.add_argument("--groups", type=int, default=14, help="process groups the rank holds (Megatron: 14)")
    p.add_argument("--train-tokens", type=int, default=512, help="tokens per training step")
    p.add_argument("--gen-tokens", type=int, default=32, help="tokens generated per request in each rollout")
    p.add_argument("--rollout-s", type=float, default=0.0,
                   help="each rollout window lasts at least this long (generation repeats), as a real one would")
    p.add_argument("--mem-fraction", type=float, default=0.80,
                   help="engine weights + KV as a share of the GPU (SGLang's mem_fraction_static)")
    p.add_argument("--kv-gib", type=float, default=None,
                   help="KV cache size; overrides --mem-fraction (default: from --mem-fraction)")
    p.add_argument("--post-destroy-wait-s", type=float, default=None,
                   help="override the presets' wait after destroying process groups (default: the presets' 2 s)")
    p.add_argument("--sync", default="sync",
                   help="sync, async or sync,async: the weight push awaited, or from a snapshot in the background "
                        "(policy sync.mode); both compare step time per preset in one run")
    p.add_argument("--memory-sample-ms", type=float, default=2.0,
                   help="the trainer's NVML memory is sampled this often over each paused window (its maximum)")
    p.add_argument("--seed", type=int, default=0, help="seed of the model and the rollouts")
    p.add_argument("--out", default=None, help="write the JSON record here (default: stdout only)")
    args = p.parse_args(argv)
    settings = SwitchSettings(model=args.model, device=args.device, presets=tuple(args.presets.split(",")),
                              steps=args.steps, warmup=args.warmup, optimizer_shards=args.optimizer_shards,
                              groups=args.groups, train_tokens=args.train_tokens, gen_tokens=args.gen_tokens,
                              rollout_s=args.rollout_s, mem_fraction=args.mem_fraction, kv_gib=args.kv_gib,
                              post_destroy_wait_s=args.post_destroy_wait_s, seed=args.seed, out=args.out,
                              sync_modes=tuple(args.sync.split(",")), memory_sample_ms=args.memory_sample_ms)
    record = asyncio.run(run_switch_bench(settings))
    return 0 if all(s["verified_all"] for s in record["summary"]) and not record["failed_presets"] else 1


if __name__ == "__main__":
    sys.exit(main())
