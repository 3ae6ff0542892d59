"""Enacts a ``GroupDirective`` in the trainer's process: create, destroy, keep, suspend, rebuild named groups. The
daemon's policy decided; this module does the torch.distributed work, bounds every wait, and reports the seconds
spent and the GPU memory the groups kept through the pause."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

import torch
import torch.distributed as dist

from ..policies import GroupAction, GroupDirective, GroupSnapshot, RebuildMode, WaitPoint

__all__ = [
    "Canary", "GroupLifecycle", "GroupReport", "GroupSpec", "KeepAliveState", "LifecycleState", "SuspendCapability",
    "all_reduce_canary", "detect_split_capability", "detect_suspend_capability", "teardown_together",
]

log = logging.getLogger(__name__)

Canary = Callable[[str, dist.ProcessGroup, float], bool]
"""``canary(name, group, timeout_s) -> ok``: one bounded collective proving a kept group still works."""

_CPU_NOTE = "no CUDA device: GPU memory is not measurable, reported as None"
_CUDA_NOTE = "device free-memory deltas (mem_get_info minus torch's own reserved delta); other processes add noise"
_MIN_NCCL_SUSPEND = (2, 29, 7)
_MIN_NCCL_SPLIT = (2, 18, 0)  # ncclCommSplit and its splitShare config


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One process group: a name, its ranks (None: the whole world) and its backend (None: the default)."""

    name: str
    ranks: tuple[int, ...] | None = None
    backend: str | None = None


class LifecycleState(StrEnum):
    """Where the groups are; each method is legal only from some of these."""

    UNBUILT = "unbuilt"
    LIVE = "live"  # usable
    KEPT = "kept"  # alive through a pause; not trusted until the canary vote passes
    SUSPENDED = "suspended"  # alive, communicator memory given back
    DESTROYED = "destroyed"  # rebuilt on resume
    CLOSED = "closed"


class KeepAliveState(StrEnum):
    """Two-phase enable of keep-alive, plus the one-way switch a failure throws."""

    OFF = "off"  # groups are not being kept
    ELIGIBLE = "eligible"  # kept through a pause; the first canary vote has not passed yet
    READY = "ready"  # at least one canary vote passed on every rank
    DISABLED = "disabled"  # a keep-alive failed: destroy with no wait for the rest of the process


@dataclass(frozen=True, slots=True)
class SuspendCapability:
    """Whether ProcessGroupNCCL suspend/resume can be used here, and why not."""

    supported: bool
    reason: str


@dataclass(slots=True)
class GroupReport:
    """What one lifecycle call did and cost; bytes are None where unmeasurable (``memory_note`` says why)."""

    phase: str  # build | pause | resume | abandon | close
    action: str  # what was really done (a fallback may differ from the directive)
    policy: str | None
    seconds: float
    waited_s: float
    kept_bytes: int | None
    freed_bytes: int | None
    per_group_bytes: dict[str, int | None]
    memory_note: str
    keep_alive: KeepAliveState
    actions: list[str] = field(default_factory=list)
    fallback_reason: str | None = None


def all_reduce_canary(name: str, group: dist.ProcessGroup, timeout_s: float, *, device: torch.device) -> bool:
    """All-reduce a one on ``group`` and check the sum equals its size; raises on timeout."""
    probe = torch.ones(1, device=device)
    work = dist.all_reduce(probe, group=group, async_op=True)
    if work is None:  # only for a rank outside the group, which never gets here
        return False
    work.wait(timeout=timedelta(seconds=timeout_s))
    return int(probe.item()) == dist.get_world_size(group)


def detect_suspend_capability(device: torch.device, backends: Sequence[str]) -> SuspendCapability:
    """Needs torch >= 2.12, NCCL >= 2.29.7, CUDA, NCCL-only groups and cuMem on (nccl-keepalive.md §1.1)."""
    torch_missing = (f"torch {torch.__version__} has no ProcessGroupNCCL suspend (needs 2.12)"
                     if torch.__version__ < "2.12" else None)
    capability = _nccl_gate("suspend", device, backends, torch_missing, _MIN_NCCL_SUSPEND,
                            "2.29.7 has no ncclCommSuspend")
    if capability.supported and os.environ.get("NCCL_CUMEM_ENABLE") == "0":
        # Suspend only releases cuMem allocations; with cuMem off it would succeed and free nothing.
        return SuspendCapability(False, "NCCL_CUMEM_ENABLE=0: suspend would succeed but free nothing")
    return capability


def detect_split_capability(device: torch.device, backends: Sequence[str]) -> SuspendCapability:
    """Whether groups can be rebuilt as ncclCommSplit children of one parent (``rebuild: split_shared``)."""
    options = _nccl_options() if device.type == "cuda" else None
    torch_missing = (f"torch {torch.__version__} cannot split a process group from a parent"
                     if options is None or not hasattr(options, "split_from") else None)
    return _nccl_gate("split_shared", device, backends, torch_missing, _MIN_NCCL_SPLIT, "2.18 has no ncclCommSplit")


def _nccl_gate(feature: str, device: torch.device, backends: Sequence[str], torch_missing: str | None,
               minimum: tuple[int, ...], too_old: str) -> SuspendCapability:
    """The first of CUDA, NCCL-only groups, torch's support and NCCL's version that fails, or supported."""
    if device.type != "cuda":
        return SuspendCapability(False, f"{feature} needs CUDA and NCCL; this process runs on CPU")
    if any(b != "nccl" for b in backends):
        return SuspendCapability(False, f"{feature} applies to NCCL groups only; backends here: "
                                        f"{sorted(set(backends))}")
    if torch_missing is not None:
        return SuspendCapability(False, torch_missing)
    try:
        nccl = tuple(torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    except Exception as exc:
        return SuspendCapability(False, f"NCCL version unknown ({exc!r})")
    version = ".".join(map(str, nccl))
    if nccl < minimum:
        return SuspendCapability(False, f"NCCL {version} < {too_old}")
    return SuspendCapability(True, f"torch {torch.__version__}, NCCL {version}")


class GroupLifecycle:
    """A named set of process groups taken through pauses as the daemon's directives say; every rank constructs it
    at the same point and makes the same calls in the same order (they are collective)::

        life = GroupLifecycle([GroupSpec("tp", (0, 1)), GroupSpec("tp", (2, 3)), GroupSpec("dp", (0, 2))])
        life.build()
        report = life.pause(directive)   # before the trainer's memory is paused
        report = life.resume()           # before the trainer needs its groups again

    ``agree_timeout_s`` bounds the cross-rank vote; keep it above groups x ``canary_timeout_s`` so a rank that sat
    out canary timeouts still reaches the vote before its peers give up on it."""

    def __init__(self, specs: Sequence[GroupSpec], *, device: torch.device | None = None,
                 group_timeout_s: float = 600.0, agree_timeout_s: float = 120.0, max_wait_s: float = 60.0,
                 canary: Canary | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GroupLifecycle needs torch.distributed initialised (init_process_group)")
        self._specs = tuple(specs)
        cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
        self._device = device or (torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"))
        self._group_timeout = timedelta(seconds=group_timeout_s)
        self._max_wait_s = max_wait_s
        self._canary: Canary = canary or (lambda name, group, timeout_s: all_reduce_canary(
            name, group, timeout_s, device=self._device))
        self._cuda = self._device.type == "cuda"
        backends = [spec.backend or dist.get_backend() for spec in self._specs]
        self._suspend = detect_suspend_capability(self._device, backends)
        self._split = detect_split_capability(self._device, backends)
        # split_shared: the parent the groups were split from (destroyed with them), and how to rebuild next.
        self._parent: dist.ProcessGroup | None = None
        self._parent_bytes: int | None = 0
        self._rebuild = RebuildMode.SEPARATE
        # The vote runs on its own gloo group, never destroyed: it must work when the kept groups do not.
        self._control = dist.new_group(backend="gloo", timeout=timedelta(seconds=agree_timeout_s))
        self._groups: list[dist.ProcessGroup | None] = []  # one slot per spec; None where not a member
        self._resident: dict[str, int | None] = {}
        self._state = LifecycleState.UNBUILT
        self._keep_alive = KeepAliveState.OFF
        self._cooldown_until: float | None = None
        self._canary_timeout_s = 30.0
        self._policy: str | None = None  # the policy of the last pause's directive

    @property
    def state(self) -> LifecycleState:
        return self._state

    def groups(self) -> Iterator[tuple[GroupSpec, dist.ProcessGroup]]:
        """The live groups this rank is a member of, in creation order."""
        if self._state != LifecycleState.LIVE:
            raise RuntimeError(f"groups are not usable in state {self._state}; call resume() first")
        return self._members()

    def snapshot(self) -> GroupSnapshot:
        """What the daemon's process-group policy needs to decide the next pause."""
        return GroupSnapshot(group_count=len(self._resident), resident_bytes=self._resident_total(),
                             keep_alive_disabled=self._keep_alive == KeepAliveState.DISABLED,
                             suspend_supported=self._suspend.supported)

    def build(self) -> GroupReport:
        """Create every group (collective) and warm it with one canary so lazy communicators exist."""
        self._require(LifecycleState.UNBUILT, "build")
        start = time.monotonic()
        return self._report("build", "create", start, self._create_all()[0])

    def pause(self, directive: GroupDirective) -> GroupReport:
        """Enact ``directive`` before the trainer's memory is paused."""
        self._require(LifecycleState.LIVE, "pause")
        start = time.monotonic()
        effective, why = self._effective(directive)
        self._policy = effective.policy
        actions: list[str] = [f"directive {directive.action} from {directive.policy}: {directive.reason}"]
        if why:
            actions.append(why)
        if effective.action == GroupAction.DESTROY:
            return self._destroy(effective, start, actions, why)
        self._canary_timeout_s = effective.canary_timeout_s
        if effective.action == GroupAction.SUSPEND:
            return self._suspend_all(start, actions)
        self._kept(LifecycleState.KEPT)
        actions.append(f"kept {len(self._resident)} groups through the pause ({self._keep_alive})")
        return self._report("pause", "keep", start, actions, kept=self._resident_total(),
                            freed=0 if self._cuda else None, fallback_reason=why, per_group=self._resident)

    def resume(self) -> GroupReport:
        """Make the groups usable again: rebuild (after any cooldown remainder) or canary-check kept ones."""
        start = time.monotonic()
        if self._state == LifecycleState.LIVE:
            return self._report("resume", "none", start, ["groups already live"])
        if self._state == LifecycleState.DESTROYED:
            until = self._cooldown_until  # the rebuild clears it
            remaining = 0.0 if until is None else min(until - time.monotonic(), self._max_wait_s)
            waited = self._timed_sleep(remaining) if remaining > 0 else 0.0
            actions = [f"slept {waited:.3f} s: remainder of the deferred post-destroy wait"] if waited else []
            created, why = self._create_all(self._rebuild)
            return self._report("resume", "rebuild", start, actions + created, waited=waited, fallback_reason=why)
        if self._state != LifecycleState.SUSPENDED:
            self._require(LifecycleState.KEPT, "resume")
        return self._verify_kept(start, resume_first=self._state == LifecycleState.SUSPENDED)

    def abandon(self, reason: str) -> GroupReport:
        """Kept groups failed in use (the weight sync raised): abort them, rebuild, disable keep-alive."""
        start = time.monotonic()
        actions = [f"keep-alive disabled: {reason}", *self._give_up(reason)]
        return self._report("abandon", "rebuild", start, actions, fallback_reason=reason)

    def close(self) -> None:
        """Destroy every group, the control group included. Idempotent."""
        if self._state == LifecycleState.CLOSED:
            return
        self._teardown(_destroy)
        _destroy(self._control)
        self._state = LifecycleState.CLOSED

    def __enter__(self) -> GroupLifecycle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _effective(self, directive: GroupDirective) -> tuple[GroupDirective, str | None]:
        """The directive to enact here, after the local facts the daemon may not have had."""
        if directive.action == GroupAction.SUSPEND and not self._suspend.supported:
            log.warning("process-group suspend unavailable (%s); using the fallback", self._suspend.reason)
            fallback = directive.fallback or GroupDirective.destroy(directive.policy, "no fallback given")
            return self._effective(fallback)[0], f"suspend unavailable ({self._suspend.reason}); fallback"
        keeps = directive.action in (GroupAction.KEEP, GroupAction.SUSPEND)
        if keeps and self._keep_alive == KeepAliveState.DISABLED:
            return (GroupDirective.destroy(directive.policy, "keep-alive disabled for this process"),
                    "keep-alive disabled by an earlier failure: destroy, no wait")
        return directive, None

    def _destroy(self, directive: GroupDirective, start: float, actions: list[str], why: str | None) -> GroupReport:
        if self._keep_alive in (KeepAliveState.ELIGIBLE, KeepAliveState.READY):
            self._keep_alive = KeepAliveState.OFF  # the policy moved away from keeping
        before = self._free_bytes()
        split = self._parent is not None
        resident = self._resident_total()  # before the destroy drops the parent's share
        count = self._teardown(_destroy)
        freed = _delta(self._free_bytes(), before)
        destroyed_at = time.monotonic()
        actions.append(f"destroyed {count} groups" + (" and the parent they were split from" if split else ""))
        self._rebuild = directive.rebuild
        waited = 0.0
        wait_s = min(directive.wait_s, self._max_wait_s)
        if wait_s < directive.wait_s:
            actions.append(f"wait capped at max_wait_s={self._max_wait_s:g} s")
        if directive.wait_point != WaitPoint.AFTER_DESTROY:
            # Deferred: the pause (rollout) usually outlasts the wait, so resume() sleeps only what is left.
            self._cooldown_until = destroyed_at + wait_s
            actions.append(f"deferred post-destroy wait of {wait_s:g} s to the next rebuild")
        elif wait_s > 0:
            waited = self._timed_sleep(wait_s)
            actions.append(f"slept {waited:.3f} s post-destroy wait")
        kept = None if resident is None or freed is None else max(0, resident - freed)
        return self._report("pause", "destroy", start, actions, waited=waited, kept=kept, freed=freed,
                            fallback_reason=why)

    def _suspend_all(self, start: float, actions: list[str]) -> GroupReport:
        before = self._free_bytes()
        ok = True
        try:
            for _spec, group in self._members():
                _backend(group, self._device).suspend()
        except Exception as exc:
            log.warning("communicator suspend failed: %r", exc)
            actions.append(f"suspend failed locally: {exc!r}")
            ok = False
        if not self._vote(ok, actions):
            reason = "suspend failed on at least one rank"
            self._disable(reason)
            self._abort_all()
            actions.append("aborted all groups, no wait; rebuilt on resume")
            return self._report("pause", "destroy", start, actions, fallback_reason=reason)
        freed = _delta(self._free_bytes(), before)
        per_group: dict[str, int | None] = {}  # what each suspended communicator still holds (NCCL's ``persist``)
        for spec, group in self._members():
            try:
                per_group[spec.name] = int(_backend(group, self._device).memory_stats()["persist"])
            except Exception:
                per_group[spec.name] = None
        kept = None if any(v is None for v in per_group.values()) else sum(v or 0 for v in per_group.values())
        self._kept(LifecycleState.SUSPENDED)
        actions.append(f"suspended {len(per_group)} communicators")
        return self._report("pause", "suspend", start, actions, kept=kept, freed=freed, per_group=per_group)

    def _verify_kept(self, start: float, *, resume_first: bool) -> GroupReport:
        actions: list[str] = []
        ok = True
        if resume_first:
            try:
                for _spec, group in self._members():
                    _backend(group, self._device).resume()
                actions.append("resumed communicators")
            except Exception as exc:
                actions.append(f"resume failed locally: {exc!r}")
                ok = False
        if ok:
            ok = self._run_canaries(actions)
        if self._vote(ok, actions):
            self._state = LifecycleState.LIVE
            self._keep_alive = KeepAliveState.READY
            return self._report("resume", "canary", start, actions)
        # Any failure anywhere: every rank drops every group, waits nothing, and never keeps again.
        reason = "canary vote failed: at least one rank could not use its kept groups"
        actions += self._give_up(reason)
        return self._report("resume", "rebuild", start, actions, fallback_reason=reason)

    def _give_up(self, reason: str) -> list[str]:
        """Keep-alive failed: disable it for good, abort every group (no wait) and create them afresh."""
        self._disable(reason)
        self._abort_all()
        return ["aborted all groups, no wait", *self._create_all()[0]]

    def _create_all(self, mode: RebuildMode = RebuildMode.SEPARATE) -> tuple[list[str], str | None]:
        """Every spec's group (``split_shared`` where this process can: split from one parent made first); returns
        the actions and, where ``split_shared`` could not be honoured, the one-line reason."""
        probe_ready = torch.ones(1, device=self._device)  # allocate before measuring, so it is not counted
        del probe_ready
        why: str | None = None
        notes: list[str] = []
        if mode == RebuildMode.SPLIT_SHARED and not self._split.supported:
            why = f"rebuild split_shared unavailable ({self._split.reason}): separate communicators"
        elif mode == RebuildMode.SPLIT_SHARED:
            try:
                notes.append(self._make_parent())
                self._create_groups()
            except Exception as exc:  # what was made goes, separate ones come (a rank failing alone leaves its
                # peers waiting in the split until NCCL's timeout)
                why = " ".join(f"rebuild split_shared failed ({exc!r:.300}): separate communicators".split())
                self._abort_all()
        if why is not None:
            log.warning("process groups: %s", why)
            notes.append(why)
        if self._state != LifecycleState.LIVE:  # separate, or split_shared that could not be
            self._create_groups()
        self._cooldown_until = None
        split = " split from one parent" if self._parent is not None else ""
        return [*notes, f"created {len(self._specs)} groups{split} ({len(self._resident)} with this rank)"], why

    def _create_groups(self) -> None:
        """new_group for every spec in order (every rank, member or not), each warmed and measured; then LIVE."""
        self._groups = []
        self._resident = {}
        for index, spec in enumerate(self._specs):
            before = self._free_bytes()
            reserved = _reserved(self._device)
            group = self._new_group(spec, index)
            if group is not None:
                # The first collective creates NCCL's communicator: its cost stays in the rebuild, and it is measured.
                if not all_reduce_canary(spec.name, group, self._group_timeout.total_seconds(), device=self._device):
                    raise RuntimeError(f"group {spec.name!r} failed its warm-up all-reduce right after creation")
            self._groups.append(group)
            if group is None:
                continue
            used = _delta(before, self._free_bytes())
            grown = _reserved(self._device) - reserved
            self._resident[spec.name] = None if used is None else max(0, used - grown)
        self._state = LifecycleState.LIVE

    def _make_parent(self) -> str:
        """The parent communicator over the whole world, created eagerly (bound to the device); it holds the
        resources the groups split from it share (splitShare)."""
        before = self._free_bytes()
        self._parent = dist.new_group(None, self._group_timeout, "nccl", device_id=self._device)
        self._parent_bytes = _delta(before, self._free_bytes())
        if hasattr(_nccl_options().config, "split_share"):
            return "parent communicator created; children share its resources (splitShare=1)"
        env = os.environ.get("NCCL_COMM_SPLIT_SHARE_RESOURCES")
        return (f"parent communicator created; this torch cannot set splitShare, so children share its resources "
                f"only with NCCL_COMM_SPLIT_SHARE_RESOURCES=1 (here: {env!r})")

    def _new_group(self, spec: GroupSpec, index: int) -> dist.ProcessGroup | None:
        """The group, or None on a rank outside it."""
        ranks = list(spec.ranks) if spec.ranks else None
        if self._parent is None:
            return _member(dist.new_group(ranks, self._group_timeout, spec.backend))
        parent = _backend(self._parent, self._device)
        member = ranks is None or dist.get_rank() in ranks
        opts = _nccl_options()
        opts._timeout = self._group_timeout  # as new_group sets it (else torch warns that they differ)
        opts.split_from = parent
        opts.split_color = index  # one split per call: the members share it, every other rank takes no colour
        if hasattr(opts.config, "split_share"):
            opts.config.split_share = 1
        # Bound to the device, the group's communicator is split at creation (eagerly): ncclCommSplit is
        # collective over the parent, so every rank must reach it at the same point, non-members included.
        group = dist.new_group(ranks, self._group_timeout, "nccl", pg_options=opts, device_id=self._device)
        if not member:
            parent.perform_nocolor_split(self._device)
        return _member(group)

    def _run_canaries(self, actions: list[str]) -> bool:
        failed: list[str] = []
        for spec, group in self._members():
            try:
                ok = self._canary(spec.name, group, self._canary_timeout_s)
            except Exception as exc:  # the collective's state is unknown: stop; peers time out, all meet at the vote
                log.warning("canary on group %r raised: %r", spec.name, exc)
                actions.append(f"canary raised on group {spec.name!r}: {exc!r}")
                return False
            if not ok:  # the collective completed: go on, so peers are not left waiting
                failed.append(spec.name)
        actions.append(f"canary wrong on groups {failed}" if failed else f"canary ok on {len(self._resident)} groups")
        return not failed

    def _vote(self, ok: bool, actions: list[str]) -> bool:
        """All ranks agree through gloo all_reduce(MIN): one failure anywhere is a failure everywhere."""
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._control)
        except Exception as exc:  # a peer died or hung past agree_timeout_s
            actions.append(f"vote failed: {exc!r}")
            return False
        agreed = bool(flag.item())
        actions.append("all ranks agreed" if agreed else "vote: at least one rank failed")
        return agreed

    def _abort_all(self) -> None:
        # Abort, not destroy: destroy flushes, and a communicator that just failed may never flush.
        self._teardown(_abort)

    def _teardown(self, how: Callable[[dist.ProcessGroup], None]) -> int:
        """Every group at once, then the parent they were split from (nothing of theirs outlives it); the next
        resume rebuilds. Returns how many groups this rank tore down."""
        members = [group for group in self._groups if group is not None]
        teardown_together(how, members)
        if self._parent is not None:
            how(self._parent)
            self._parent, self._parent_bytes = None, 0
        self._groups, self._state, self._cooldown_until = [None] * len(self._specs), LifecycleState.DESTROYED, None
        return len(members)

    def _kept(self, state: LifecycleState) -> None:
        self._state = state
        if self._keep_alive == KeepAliveState.OFF:
            self._keep_alive = KeepAliveState.ELIGIBLE

    def _members(self) -> Iterator[tuple[GroupSpec, dist.ProcessGroup]]:
        for spec, group in zip(self._specs, self._groups, strict=True):
            if group is not None:
                yield spec, group

    def _disable(self, reason: str) -> None:
        if self._keep_alive != KeepAliveState.DISABLED:
            log.warning("keep-alive disabled for the rest of this process: %s", reason)
        self._keep_alive = KeepAliveState.DISABLED

    def _timed_sleep(self, seconds: float) -> float:
        begin = time.monotonic()
        time.sleep(seconds)  # the policy's post-destroy wait itself
        return time.monotonic() - begin

    def _free_bytes(self) -> int | None:
        if not self._cuda:
            return None
        torch.cuda.synchronize(self._device)
        return int(torch.cuda.mem_get_info(self._device)[0])

    def _resident_total(self) -> int | None:
        values = [*self._resident.values(), self._parent_bytes]  # a split_shared parent holds what they share
        if not self._cuda or any(v is None for v in values):
            return None
        return sum(v or 0 for v in values)

    def _require(self, state: LifecycleState, verb: str) -> None:
        if self._state != state:
            raise RuntimeError(f"cannot {verb} process groups in state {self._state} (needs {state})")

    def _report(self, phase: str, action: str, start: float, actions: list[str], *, waited: float = 0.0,
                kept: int | None = None, freed: int | None = None, fallback_reason: str | None = None,
                per_group: Mapping[str, int | None] | None = None) -> GroupReport:
        """The policy named is the last pause's (None before the first); bytes are None on CPU (unmeasured)."""
        return GroupReport(
            phase=phase, action=action, policy=self._policy, seconds=time.monotonic() - start, waited_s=waited,
            kept_bytes=kept, freed_bytes=freed, per_group_bytes=dict(per_group or {}),
            memory_note=_CUDA_NOTE if self._cuda else _CPU_NOTE, keep_alive=self._keep_alive, actions=actions,
            fallback_reason=fallback_reason)


def teardown_together(teardown: Callable[[dist.ProcessGroup], None], groups: Sequence[dist.ProcessGroup]) -> None:
    """``teardown`` every group at once, one thread each: an NCCL communicator's teardown waits for its proxy
    thread's 500 ms ``poll`` (NCCL 2.28 ``proxy.cc``), so in a row each waits a further period, together the set
    waits one (docs/client.md). Every rank tears down the same set, so a collective teardown meets its peers."""
    if groups:
        with ThreadPoolExecutor(len(groups), thread_name_prefix="colocd-group-teardown") as pool:
            list(pool.map(teardown, groups))


def _destroy(group: dist.ProcessGroup) -> None:
    _quietly(dist.destroy_process_group, group)


def _abort(group: dist.ProcessGroup) -> None:
    _quietly(getattr(dist.distributed_c10d, "_abort_process_group", dist.destroy_process_group), group)


def _quietly(teardown: Callable[[dist.ProcessGroup], None], group: dist.ProcessGroup) -> None:
    try:
        teardown(group)
    except Exception as exc:  # best effort: the group is dropped either way
        log.warning("tearing down a process group failed: %r", exc)


def _backend(group: dist.ProcessGroup, device: torch.device) -> Any:
    # Any: suspend/resume/memory_stats exist from torch 2.12 (nccl-keepalive.md §2); detect_suspend_capability checked.
    return group._get_backend(device)


def _member(group: object) -> dist.ProcessGroup | None:
    """``new_group``'s answer as a group, None on a rank outside it (NON_GROUP_MEMBER)."""
    return group if isinstance(group, dist.ProcessGroup) else None


def _nccl_options() -> Any:
    """A fresh ``ProcessGroupNCCL.Options`` (None without NCCL); Any: CPU builds' stubs lack the class."""
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    return None if nccl is None else nccl.Options()


def _reserved(device: torch.device) -> int:
    return int(torch.cuda.memory_reserved(device)) if device.type == "cuda" else 0


def _delta(larger: int | None, smaller: int | None) -> int | None:
    return None if larger is None or smaller is None else larger - smaller
