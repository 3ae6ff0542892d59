"""The daemon's view of the active policies: which values apply now, and reloading the policy file.

Rule: values from a policy document (policy file, SIGHUP, ``PUT /v1/policies``) win over the node
config's; with no document in force (the built-in defaults), the node config's values apply.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..policies import (
    GroupSnapshot,
    PipelinePlan,
    PipelineSnapshot,
    PolicyError,
    PolicySet,
    PolicyStore,
    Transport,
    YamlLimits,
    load_policy_yaml,
)
from .config import NodeConfig
from .staging import StagingMemory

__all__ = ["EffectiveTimeouts", "PolicyRuntime"]

log = logging.getLogger("colocd.policy")

_POLICY_STEPS = frozenset({"release", "resume", "chunk", "health", "memory_confirm", "sync"})


@dataclass(frozen=True, slots=True)
class EffectiveTimeouts:
    """Per-step budgets: the policy document's where it sets one, else the node config's."""

    node: Any
    policy: Any | None

    def for_step(self, step: str) -> float:
        if self.policy is not None and step in _POLICY_STEPS and getattr(self.policy, f"{step}_s", None) is not None:
            return float(self.policy.for_step(step))
        return float(self.node.for_step(step))

    @property
    def default_s(self) -> float:
        return float(self.policy.default_s if self.policy is not None else self.node.default_s)


class PolicyRuntime:
    """Owns the PolicyStore; knows the node config and the policy file."""

    def __init__(self, config: NodeConfig, store: PolicyStore | None = None) -> None:
        self.config = config
        self.store = store or PolicyStore()
        self._file_mtime: float | None = None
        if config.policy_file:
            self.reload_file(raise_errors=True)
            self.store.at_boundary()  # the file's policies are in force from the start

    @property
    def active(self) -> PolicySet:
        return self.store.active

    def from_document(self) -> bool:
        return self.store.active.source not in (None, "defaults")

    def apply_yaml(self, text: str | bytes, source: str) -> PolicySet:
        """Validate and stage; raises PolicyError (line/column) and leaves the running policy in force.

        Bounded by the node config's ``limits``, plugins only from ``policy_plugins`` (or entry points).
        CPU-bound: from the event loop, call it through ``asyncio.to_thread``.
        """
        limits = self.config.limits
        parsed = load_policy_yaml(text, source=source, plugins=frozenset(self.config.policy_plugins),
                                  limits=YamlLimits(max_bytes=limits.max_policy_bytes,
                                                    max_aliases=limits.max_yaml_aliases,
                                                    max_nodes=limits.max_yaml_nodes))
        return self.store.stage(parsed)

    def reload_file(self, raise_errors: bool = False) -> PolicySet | None:
        path = self.config.policy_file
        if not path:
            return None
        try:
            staged = self.apply_yaml(Path(path).read_bytes(), source=path)
            self._file_mtime = os.stat(path).st_mtime
        except (OSError, PolicyError) as exc:
            if raise_errors:
                raise
            log.error("policy file %s not applied, the running policy stays: %s", path, exc)
            return None
        log.info("policy file %s staged as version %s", path, staged.version)
        return staged

    def reload_if_changed(self) -> None:
        path = self.config.policy_file
        if not path:
            return
        try:
            mtime = os.stat(path).st_mtime
        except OSError:
            return
        if mtime != self._file_mtime:
            self.reload_file()

    # -- what one transition uses (read from a pinned PolicySet) ---------------------------------
    def timeouts(self, policies: PolicySet) -> EffectiveTimeouts:
        return EffectiveTimeouts(self.config.timeouts, policies.timeouts if self.from_document() else None)

    def pause_mode(self, policies: PolicySet) -> str:
        return policies.engines.pause_mode if self.from_document() else self.config.pause_mode

    def release_tags(self, policies: PolicySet) -> tuple[str, ...] | None:
        return tuple(policies.engines.release_tags) if self.from_document() else None

    def directives(self, policies: PolicySet, phase: str, trainer: dict[str, Any] | None,
                   transports: tuple[str, ...], staging: StagingMemory | None = None) -> dict[str, Any]:
        """What the trainer agent must enact for this phase (pure decisions, serialised)."""
        out: dict[str, Any] = {"policy": policies.info()}
        if phase == "train":
            snapshot = GroupSnapshot.model_validate((trainer or {}).get("groups") or {})
            out["process_groups"] = policies.process_groups.before_pause(snapshot).model_dump(mode="json")
            out["cleanup"] = policies.cleanup.plan().model_dump(mode="json")
        elif phase == "sync":
            out["pipeline"] = self.pipeline_plan(policies, transports, staging).model_dump(mode="json")
        return out

    def pipeline_plan(self, policies: PolicySet, transports: tuple[str, ...],
                      staging: StagingMemory | None = None) -> PipelinePlan:
        """The pipeline policy's plan, fed the memory the daemon measured (``staging``: None = not read),
        so its out-of-memory guard bounds depth x bucket by the GPU memory free now."""
        known = {t.value for t in Transport}
        available = tuple(Transport(t) for t in transports if t in known)
        plan = policies.pipeline.plan(PipelineSnapshot(
            available_transports=available or (Transport.SHM,),
            total_bytes=staging.total_bytes if staging else None,
            free_bytes=staging.free_bytes if staging else None))
        memory = staging.describe() if staging else "memory not read"
        return plan.model_copy(update={"reason": f"{plan.reason}; {memory}" if plan.reason else memory})
