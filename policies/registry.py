"""Finds a policy class by name: a built-in, an entry point in group ``colocd.policies``, or ``module:Class``
(imported only when the allow-list names it: a document can arrive over HTTP). As uvicorn's ``importer.py``: a
module not found is the operator's typo; a module whose own import failed is the plugin's bug, with its cause."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from importlib import metadata
from types import MappingProxyType
from typing import Any

from ..errors import PluginImportError, PluginNotFoundError, PolicyError
from .base import Family, Policy
from .cleanup import AggressiveCleanupPolicy, CleanupPolicy, EmptyCachePolicy, NoCleanupPolicy
from .pipeline import OverlapPolicy, PipelinePolicy, SerialPolicy
from .process_groups import (
    AutoPolicy,
    DeferredCooldownPolicy,
    DestroyPolicy,
    KeepAlivePolicy,
    ProcessGroupPolicy,
    SuspendPolicy,
)

__all__ = ["ANY_PLUGIN", "BUILTINS", "DEFAULT_NAMES", "ENTRY_POINT_GROUP", "resolve_policy"]

ENTRY_POINT_GROUP = "colocd.policies"


def _table(*classes: type[Policy]) -> Mapping[str, type[Policy]]:
    return MappingProxyType({cls.name: cls for cls in classes})


BUILTINS: Mapping[Family, Mapping[str, type[Policy]]] = MappingProxyType({
    Family.PROCESS_GROUPS: _table(DestroyPolicy, DeferredCooldownPolicy, KeepAlivePolicy, SuspendPolicy, AutoPolicy),
    Family.PIPELINE: _table(SerialPolicy, OverlapPolicy),
    Family.CLEANUP: _table(EmptyCachePolicy, AggressiveCleanupPolicy, NoCleanupPolicy),
})

# deferred_cooldown: same safety as the seed's destroy, the wait usually hidden behind rollout, and
# no paused-window memory; keep_alive/auto need an operator to accept their memory cost.
DEFAULT_NAMES: Mapping[Family, str] = MappingProxyType(
    {Family.PROCESS_GROUPS: "deferred_cooldown", Family.PIPELINE: "overlap", Family.CLEANUP: "empty_cache"})

_BASES: Mapping[Family, type[Policy]] = MappingProxyType(
    {Family.PROCESS_GROUPS: ProcessGroupPolicy, Family.PIPELINE: PipelinePolicy, Family.CLEANUP: CleanupPolicy})


def _import_from_string(spec: str) -> Any:
    """Import ``"package.module:Attr.Inner"``; raise PluginNotFoundError or PluginImportError."""
    module_name, _, attrs = spec.partition(":")
    if not module_name or not attrs:
        raise PluginNotFoundError(f"plugin {spec!r} must be written as '<module>:<Class>'")
    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        # Missing is missing only if the module itself or one of its parents is what was not found;
        # a ModuleNotFoundError for anything else came from the plugin's own imports.
        if exc.name is not None and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            raise PluginNotFoundError(f"could not find module {module_name!r} (from {spec!r})") from None
        raise PluginImportError(f"module {module_name!r} failed to import: {exc!r}") from exc
    except Exception as exc:
        raise PluginImportError(f"module {module_name!r} failed to import: {exc!r}") from exc
    for attr in attrs.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError:
            raise PluginNotFoundError(f"attribute {attrs!r} not found in module {module_name!r}") from None
    return obj


# ``plugins=ANY_PLUGIN``: no allow-list (an operator's own offline check of a file, tests); never over HTTP.
ANY_PLUGIN: frozenset[str] = frozenset({"*:*"})


def resolve_policy(family: Family, name: str, *, plugins: frozenset[str] = ANY_PLUGIN) -> type[Policy]:
    """The policy class ``name`` designates in ``family``, or a PolicyError saying why not; ``plugins``: the
    ``module:Class`` specs that may be imported (``module:*`` for a whole module)."""
    builtin = BUILTINS[family].get(name)
    if builtin is not None:
        return builtin
    if ":" in name:
        # Allowed: listed exactly, or its module listed as ``module:*``.
        if plugins != ANY_PLUGIN and name not in plugins and f"{name.partition(':')[0]}:*" not in plugins:
            listed = ", ".join(sorted(plugins)) or "none"
            raise PolicyError(
                f"plugin {name!r} is not in this node's allow-list (policy_plugins in the node config; "
                f"listed: {listed}); install it as an entry point in group {ENTRY_POINT_GROUP!r} or list it there")
        found = _import_from_string(name)
        origin = repr(name)
    else:
        found, origin = _from_entry_point(family, name)
    base = _BASES[family]
    if not (isinstance(found, type) and issubclass(found, base)):
        other = getattr(found, "family", None) if isinstance(found, type) and issubclass(found, Policy) else None
        what = f"a {other} policy" if other else f"not a {base.__name__} subclass"
        raise PolicyError(f"{origin} is {what}; section {family} needs a {base.__name__}")
    return found


def _from_entry_point(family: Family, name: str) -> tuple[Any, str]:
    matches = list(metadata.entry_points(group=ENTRY_POINT_GROUP, name=name))
    if not matches:
        known = ", ".join(BUILTINS[family])
        raise PluginNotFoundError(f"unknown {family} policy {name!r}: not a built-in ({known}), not "
                                  f"'<module>:<Class>', and no entry point {name!r} in group {ENTRY_POINT_GROUP!r}")
    if len({ep.value for ep in matches}) > 1:
        # Two installed distributions claim the name; picking one silently would depend on sys.path order.
        values = ", ".join(sorted({ep.value for ep in matches}))
        raise PolicyError(f"entry point {name!r} in group {ENTRY_POINT_GROUP!r} is ambiguous: {values}")
    value = matches[0].value
    return _import_from_string(value), f"entry point {name!r} ({value})"

