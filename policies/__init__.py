"""Policies decide, nothing else: typed snapshots in, typed decisions out, loaded from one YAML document.

No I/O and no imports from the rest of colocd but its exception tree (``colocd.errors``, which imports
nothing). The daemon holds a ``PolicyStore``; the trainer agent enacts ``GroupDirective`` and ``CleanupPlan``;
the weight-stream pipeline follows ``PipelinePlan``.
"""

from ..errors import PluginImportError, PluginNotFoundError, PolicyError
from .base import Decision, Family, Policy, PolicyConfig
from .cleanup import (
    AggressiveCleanupPolicy,
    CleanupAction,
    CleanupPlan,
    CleanupPolicy,
    EmptyCachePolicy,
    NoCleanupPolicy,
)
from .document import default_policies, policy_json_schema
from .loader import YamlLimits, load_policy_yaml
from .pipeline import OverlapPolicy, PipelinePlan, PipelinePolicy, PipelineSnapshot, SerialPolicy
from .policy_set import API_VERSION, PolicySet
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
from .registry import BUILTINS, ENTRY_POINT_GROUP, resolve_policy
from .settings import (
    DEFAULT_PAUSE_MODE,
    AdapterSettings,
    EngineSettings,
    PauseModeName,
    SecondBuffer,
    SyncMode,
    SyncSettings,
    VerifyMode,
)
from .store import PolicyStore
from .timeouts import Budget, Timeouts
from .transport import AUTO_ORDER, Transport

__all__ = [
    "API_VERSION",
    "AUTO_ORDER",
    "BUILTINS",
    "DEFAULT_PAUSE_MODE",
    "ENTRY_POINT_GROUP",
    "AdapterSettings",
    "AggressiveCleanupPolicy",
    "AutoPolicy",
    "Budget",
    "CleanupAction",
    "CleanupPlan",
    "CleanupPolicy",
    "Decision",
    "DeferredCooldownPolicy",
    "DestroyPolicy",
    "EmptyCachePolicy",
    "EngineSettings",
    "Family",
    "GroupAction",
    "GroupDirective",
    "GroupSnapshot",
    "KeepAlivePolicy",
    "NoCleanupPolicy",
    "OverlapPolicy",
    "PauseModeName",
    "PipelinePlan",
    "PipelinePolicy",
    "PipelineSnapshot",
    "PluginImportError",
    "PluginNotFoundError",
    "Policy",
    "PolicyConfig",
    "PolicyError",
    "PolicySet",
    "PolicyStore",
    "ProcessGroupPolicy",
    "RebuildMode",
    "SecondBuffer",
    "SerialPolicy",
    "SuspendPolicy",
    "SyncMode",
    "SyncSettings",
    "Timeouts",
    "Transport",
    "VerifyMode",
    "WaitPoint",
    "YamlLimits",
    "default_policies",
    "load_policy_yaml",
    "policy_json_schema",
    "resolve_policy",
]
