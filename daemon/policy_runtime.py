"""The daemon's view of the active policies: which values apply now, and reloading the policy file.

Values a policy document (policy file, SIGHUP, ``PUT /v1/policies``) sets win over the node config's; the two are
merged once, when a document is staged, so a transition reads one ``Timeouts`` and one pause mode.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from ..errors import RequestInvalid
from ..policies import (
    GroupSnapshot,
    PipelinePlan,
    PipelineSnapshot,
    PolicyError,
    PolicySet,
    PolicyStore,
    Transport,
    YamlLimits,
    default_policies,
    load_policy_yaml,
)
from .config import NodeConfig
from .staging import StagingMemory

__all__ = ["PolicyRuntime"]

log = logging.getLogger("colocd.policy")

class PolicyRuntime:
    """Owns the PolicyStore; knows the node config and the policy file."""

    def __init__(self, config: NodeConfig) -> None:
        self.config = config
        self.store = PolicyStore(self._over_node(default_policies()))
        self._file_seen: tuple[int, int] | None = None  # (mtime_ns, size) of the policy file last read
        if config.policy_file:
            self.reload_file(raise_errors=True)
            self.store.at_boundary()  # the file's policies are in force from the start

    @property
    def active(self) -> PolicySet:
        return self.store.active

    def apply_yaml(self, text: str | bytes, source: str) -> PolicySet:
        """Validate and stage (PolicyError: the running policy stays); CPU-bound: call it in a thread."""
        limits = self.config.limits
        parsed = load_policy_yaml(text, source=source, plugins=frozenset(self.config.policy_plugins),
                                  limits=YamlLimits(max_bytes=limits.max_policy_bytes,
                                                    max_aliases=limits.max_yaml_aliases,
                                                    max_nodes=limits.max_yaml_nodes))
        return self.store.stage(self._over_node(parsed))

    def _over_node(self, document: PolicySet) -> PolicySet:
        return document.over_node(self.config.timeouts, self.config.pause_mode)

    def reload_file(self, raise_errors: bool = False) -> PolicySet | None:
        """Read, validate and stage the policy file; a bad file is logged (or raised, at start) and the running
        policy stays. The file's (mtime, size) is recorded either way, so a bad file is reported once per edit."""
        path = self.config.policy_file
        if not path:
            return None
        try:
            self._file_seen = _signature(path)
            staged = self.apply_yaml(Path(path).read_bytes(), source=path)
        except (OSError, PolicyError) as exc:
            if raise_errors:
                raise
            log.error("policy file %s not applied, the running policy stays: %s", path, exc)
            return None
        log.info("policy file %s staged as version %s", path, staged.version)
        return staged

    def reload_if_changed(self) -> None:
        """The health loop's check of the policy file: it never raises (a failure is logged)."""
        path = self.config.policy_file
        if not path:
            return
        try:
            if _signature(path) != self._file_seen:
                self.reload_file()
        except OSError:
            return  # gone or unreadable for now; the next pass looks again
        except Exception:  # a plugin's import or constructor is foreign code: never the end of the loop
            log.exception("policy file %s not applied, the running policy stays", path)

    def directives(self, policies: PolicySet, phase: str, trainer: dict[str, Any] | None,
                   transports: frozenset[Transport] | None, staging: StagingMemory | None = None) -> dict[str, Any]:
        """What the trainer agent must enact for this phase."""
        sync = policies.sync
        out: dict[str, Any] = {"policy": policies.info(), "weight_sync": {
            **sync.model_dump(mode="json"), "max_staleness_versions": sync.staleness_bound}}
        if phase == "train":
            snapshot = _group_snapshot((trainer or {}).get("groups") or {})
            out["process_groups"] = policies.process_groups.before_pause(snapshot).model_dump(mode="json")
            out["cleanup"] = policies.cleanup.plan().model_dump(mode="json")
        elif phase == "sync":
            out["pipeline"] = self.pipeline_plan(policies, transports, staging).model_dump(mode="json")
        return out

    def pipeline_plan(self, policies: PolicySet, transports: frozenset[Transport] | None,
                      staging: StagingMemory | None = None) -> PipelinePlan:
        """The plan over the transports every engine accepts (``None``: no engines), fed the memory the daemon
        measured (``staging``) so its out-of-memory guard bounds depth x bucket by the GPU memory free now."""
        memory_fields = {"total_bytes": staging.total_bytes if staging else None,
                         "free_bytes": staging.free_bytes if staging else None}
        if transports is None:
            snapshot = PipelineSnapshot(**memory_fields)
        else:
            available = tuple(t for t in Transport if t in transports)  # the enum's order: deterministic
            snapshot = PipelineSnapshot(available_transports=available, **memory_fields)
        plan = policies.pipeline.plan(snapshot)
        memory = staging.describe() if staging else "memory not read"
        return plan.model_copy(update={"reason": f"{plan.reason}; {memory}" if plan.reason else memory})


def _group_snapshot(groups: dict[str, Any]) -> GroupSnapshot:
    """The trainer's groups as the policy reads them; a 422 naming the field the trainer got wrong."""
    try:
        return GroupSnapshot.model_validate(groups)
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in ("trainer", "groups", *error["loc"]))
        raise RequestInvalid(f"{where}: {error['msg']}", field=where) from None


def _signature(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_mtime_ns, st.st_size
