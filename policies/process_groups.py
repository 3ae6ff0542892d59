"""Process-group policies: whether the trainer's NCCL groups survive the pause, and what waits it takes
(``GroupSnapshot`` in, ``GroupDirective`` out, in the phase reply; ``trainer/groups.py`` enacts it)."""

from __future__ import annotations

from abc import abstractmethod
from enum import StrEnum
from typing import ClassVar, Literal

from pydantic import Field

from .base import Decision, Family, Policy, PolicyConfig

__all__ = ["AutoPolicy", "DeferredCooldownPolicy", "DestroyPolicy", "GroupAction", "GroupDirective", "GroupSnapshot",
           "KeepAlivePolicy", "ProcessGroupPolicy", "RebuildMode", "SuspendPolicy", "WaitPoint"]

_GIB = 1 << 30

# The seed's post-destroy wait. nccl-keepalive.md §2 argues subgroups never bind a fixed port, so
# the wait is probably unnecessary; it stays the default until a run on real hardware proves it.
_DEFAULT_WAIT_S = 2.0
_DEFAULT_CANARY_S = 30.0


class GroupAction(StrEnum):
    """What happens to the groups before the pause."""

    KEEP = "keep"  # leave them alive; canary + cross-rank agreement after the pause
    DESTROY = "destroy"  # destroy them; rebuild when the trainer resumes
    SUSPEND = "suspend"  # keep them but give communicator memory back (NCCL >= 2.29.7)


class WaitPoint(StrEnum):
    """Where the post-destroy wait is spent."""

    AFTER_DESTROY = "after_destroy"  # right after destroying, on the switch's critical path
    BEFORE_REBUILD = "before_rebuild"  # only the remainder, just before the next rebuild


class RebuildMode(StrEnum):
    """How destroyed groups are created again."""

    SEPARATE = "separate"  # one independent communicator per group (new_group)
    # ncclCommSplit children of one parent communicator bound to the device, sharing its resources
    # (splitShare): a destroy of 14 one-rank groups takes ~0.14 s instead of ~0.50 s on an H200. The
    # children use the parent's channels and buffers, so groups whose collectives overlap in time contend
    # for them; the parent is destroyed with its children, so nothing is kept through the pause. NCCL only.
    SPLIT_SHARED = "split_shared"


class GroupSnapshot(Decision):
    """What the trainer agent knows about its groups when the daemon asks (``GroupLifecycle.snapshot()``)."""

    group_count: int = Field(0, ge=0, description="process groups this rank is a member of")
    resident_bytes: int | None = Field(
        None, ge=0, description="measured GPU memory the groups hold while alive; None: not measurable")
    keep_alive_disabled: bool = Field(False, description="a keep-alive failure disabled it for the process")
    suspend_supported: bool | None = Field(None, description="ProcessGroupNCCL suspend/resume; None: unknown")


class GroupDirective(Decision):
    """The decision for one pause: keep, destroy (with a wait and where it is spent) or suspend."""

    policy: str = Field(..., description="the policy that decided, as named in the YAML")
    action: GroupAction
    wait_s: float = Field(0.0, ge=0, description="post-destroy wait; 0 for keep and suspend")
    wait_point: WaitPoint = WaitPoint.AFTER_DESTROY
    canary_timeout_s: float = Field(_DEFAULT_CANARY_S, gt=0, description="bound on each canary all-reduce")
    fallback: GroupDirective | None = Field(None, description="what to do when suspend is not available")
    rebuild: RebuildMode = Field(RebuildMode.SEPARATE, description="destroy: how the groups are created again")
    reason: str = ""

    @classmethod
    def keep(cls, policy: str, reason: str, *, canary_timeout_s: float = _DEFAULT_CANARY_S) -> GroupDirective:
        return cls(policy=policy, action=GroupAction.KEEP, canary_timeout_s=canary_timeout_s, reason=reason)

    @classmethod
    def destroy(cls, policy: str, reason: str, *, wait_s: float = 0.0, wait_point: WaitPoint = WaitPoint.AFTER_DESTROY,
                rebuild: RebuildMode = RebuildMode.SEPARATE) -> GroupDirective:
        return cls(policy=policy, action=GroupAction.DESTROY, wait_s=wait_s, wait_point=wait_point, rebuild=rebuild,
                   reason=reason)


class ProcessGroupPolicy(Policy):
    """Decides, before each pause, what happens to the trainer's process groups."""

    family: ClassVar[Family] = Family.PROCESS_GROUPS

    @abstractmethod
    def before_pause(self, snapshot: GroupSnapshot) -> GroupDirective:
        """Return the directive for this pause. Pure: same snapshot, same directive."""


class WaitConfig(PolicyConfig):
    post_destroy_wait_s: float = Field(
        _DEFAULT_WAIT_S, ge=0, le=600, description="fixed wait after destroying groups (the seed's 2 s)")
    rebuild: RebuildMode = Field(
        RebuildMode.SEPARATE,
        description="how destroyed groups are created again: separate (one communicator each) | split_shared "
                    "(ncclCommSplit children of one parent bound to the device, sharing its channels and buffers: "
                    "a faster destroy, but groups whose collectives overlap contend; NCCL only, a no-op with a "
                    "reason elsewhere)",
    )


class CanaryConfig(PolicyConfig):
    canary_timeout_s: float = Field(
        _DEFAULT_CANARY_S, ge=0.1, le=3600, description="bound on each canary all-reduce after the pause")


class DestroyPolicy(ProcessGroupPolicy):
    """Destroy every group before the pause, then wait ``post_destroy_wait_s`` (the seed's baseline)."""

    name: ClassVar[str] = "destroy"

    Config = WaitConfig
    config: WaitConfig

    def before_pause(self, snapshot: GroupSnapshot) -> GroupDirective:
        return GroupDirective.destroy(
            self.spec, f"destroy {snapshot.group_count} groups, then wait {self.config.post_destroy_wait_s:g} s",
            wait_s=self.config.post_destroy_wait_s, rebuild=self.config.rebuild)


class DeferredCooldownPolicy(ProcessGroupPolicy):
    """Destroy before the pause; spend only what is left of the wait just before the next rebuild."""

    name: ClassVar[str] = "deferred_cooldown"

    Config = WaitConfig
    config: WaitConfig

    def before_pause(self, snapshot: GroupSnapshot) -> GroupDirective:
        return _deferred(self.spec, self.config.post_destroy_wait_s, f"destroy {snapshot.group_count} groups",
                         self.config.rebuild)


class KeepAlivePolicy(ProcessGroupPolicy):
    """Keep groups through the pause; a canary all-reduce and a cross-rank vote decide whether they stay."""

    name: ClassVar[str] = "keep_alive"

    Config = CanaryConfig
    config: CanaryConfig

    def before_pause(self, snapshot: GroupSnapshot) -> GroupDirective:
        if snapshot.keep_alive_disabled:
            # The seed's rule: after one failure, plain destroy with no wait for the rest of the process.
            return GroupDirective.destroy(self.spec, "keep-alive disabled by an earlier failure; destroy, no wait")
        held = "unmeasured" if snapshot.resident_bytes is None else f"{snapshot.resident_bytes / _GIB:.2f} GiB"
        return GroupDirective.keep(self.spec, f"keep {snapshot.group_count} groups ({held} resident)",
                                   canary_timeout_s=self.config.canary_timeout_s)


class SuspendPolicy(ProcessGroupPolicy):
    """Keep groups but suspend their communicators (memory back, topology kept); else use ``fallback``."""

    name: ClassVar[str] = "suspend"

    class Config(WaitConfig, CanaryConfig):
        fallback: Literal["destroy", "deferred_cooldown", "keep_alive"] = Field(
            "deferred_cooldown", description="what to do where suspend/resume is not available")

    config: Config

    def before_pause(self, snapshot: GroupSnapshot) -> GroupDirective:
        # What the named fallback policy decides, with this policy's settings and name.
        policies: dict[str, type[DestroyPolicy | DeferredCooldownPolicy | KeepAlivePolicy]] = {
            "destroy": DestroyPolicy, "deferred_cooldown": DeferredCooldownPolicy, "keep_alive": KeepAlivePolicy}
        fallback = policies[self.config.fallback](self.config, spec=self.spec).before_pause(snapshot)
        if snapshot.suspend_supported is False:
            return fallback.model_copy(
                update={"reason": f"suspend unavailable, fallback {self.config.fallback}: {fallback.reason}"})
        if snapshot.keep_alive_disabled:
            return fallback.model_copy(update={"reason": f"keep-alive disabled, fallback: {fallback.reason}"})
        return GroupDirective(policy=self.spec, action=GroupAction.SUSPEND, fallback=fallback,
                              canary_timeout_s=self.config.canary_timeout_s,
                              reason=f"suspend {snapshot.group_count} communicators")


class AutoPolicy(ProcessGroupPolicy):
    """Keep alive while the groups' measured memory fits ``max_resident_gib``; else deferred_cooldown."""

    name: ClassVar[str] = "auto"

    class Config(WaitConfig, CanaryConfig):
        max_resident_gib: float = Field(
            ..., gt=0, description="GPU memory the kept groups may hold through the pause, GiB")

    config: Config

    def before_pause(self, snapshot: GroupSnapshot) -> GroupDirective:
        budget = self.config.max_resident_gib
        wait, rebuild = self.config.post_destroy_wait_s, self.config.rebuild
        if snapshot.keep_alive_disabled:
            return _deferred(self.spec, wait, "keep-alive disabled by an earlier failure", rebuild)
        if snapshot.resident_bytes is None:
            # Unmeasured memory could be anything; keeping it could break the budget we promise.
            return _deferred(self.spec, wait, "resident memory of the groups is not measured", rebuild)
        held = snapshot.resident_bytes / _GIB
        if held > budget:
            return _deferred(self.spec, wait, f"groups hold {held:.2f} GiB > budget {budget:g} GiB", rebuild)
        return GroupDirective.keep(self.spec, f"groups hold {held:.2f} GiB <= budget {budget:g} GiB: keep alive",
                                   canary_timeout_s=self.config.canary_timeout_s)


def _deferred(policy: str, wait_s: float, why: str, rebuild: RebuildMode) -> GroupDirective:
    return GroupDirective.destroy(policy, f"{why}; wait up to {wait_s:g} s before the next rebuild", wait_s=wait_s,
                                  wait_point=WaitPoint.BEFORE_REBUILD, rebuild=rebuild)
