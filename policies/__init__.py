"""Policies decide, nothing else: typed snapshots in, typed decisions out, loaded from one YAML document; no I/O and
no imports from the rest of colocd but its exception tree."""

from ..errors import PluginImportError, PluginNotFoundError, PolicyError
from .base import Policy, PolicyConfig
from .cleanup import (
    AggressiveCleanupPolicy,
    CleanupAction,
    CleanupPlan,
    CleanupPolicy,
    EmptyCachePolicy,
    NoCleanupPolicy,
)
from .document import YamlLimits, default_policies, load_policy_yaml, policy_json_schema
from .pipeline import AUTO_ORDER, OverlapPolicy, PipelinePlan, PipelinePolicy, PipelineSnapshot, SerialPolicy, Transport
from .policy_set import PolicySet, PolicyStore
from .process_groups import (
    AutoPolicy,
    DeferredCooldownPolicy,
    DestroyPolicy,
    GroupAction,
    GroupDirective,
    GroupSnapshot,
    KeepAlivePolicy,
    ProcessGroupPolicy,
    RebuildMode,
    SuspendPolicy,
    WaitPoint,
)
from .settings import DEFAULT_PAUSE_MODE, AdapterSettings, PauseModeName, VerifyMode
from .timeouts import Budget, Timeouts

__all__ = [
    "AUTO_ORDER", "DEFAULT_PAUSE_MODE", "AdapterSettings", "AggressiveCleanupPolicy", "AutoPolicy", "Budget",
    "CleanupAction", "CleanupPlan", "CleanupPolicy", "DeferredCooldownPolicy", "DestroyPolicy", "EmptyCachePolicy",
    "GroupAction", "GroupDirective", "GroupSnapshot", "KeepAlivePolicy", "NoCleanupPolicy", "OverlapPolicy",
    "PauseModeName", "PipelinePlan", "PipelinePolicy", "PipelineSnapshot", "PluginImportError", "PluginNotFoundError",
    "Policy", "PolicyConfig", "PolicyError", "PolicySet", "PolicyStore", "ProcessGroupPolicy", "RebuildMode",
    "SerialPolicy", "SuspendPolicy", "Timeouts", "Transport", "VerifyMode", "WaitPoint", "YamlLimits",
    "default_policies", "load_policy_yaml", "policy_json_schema",
]
