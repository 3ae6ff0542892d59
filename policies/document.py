"""Turns a parsed policy document (plain dicts) into a ``PolicySet``, and publishes its JSON Schema.

Knows nothing of YAML: positions come from a ``Locator`` the loader passes in.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model

from ..errors import PolicyError
from .base import Family, Policy
from .cleanup import CleanupPolicy
from .pipeline import PipelinePolicy
from .policy_set import API_VERSION, PolicySet
from .process_groups import ProcessGroupPolicy
from .registry import ANY_PLUGIN, BUILTINS, DEFAULT_NAMES, resolve_policy
from .settings import AdapterSettings, EngineSettings, SyncSettings
from .timeouts import Timeouts

__all__ = ["Locator", "Path", "build_policy_set", "default_policies", "policy_json_schema"]

Path = tuple[str | int, ...]
# (path, at_key) -> (line, column), 1-based; at_key points at the mapping key rather than its value.
Locator = Callable[[Path, bool], tuple[int | None, int | None]]

_SECTIONS: tuple[str, ...] = ("apiVersion", *(str(f) for f in Family), "engines", "timeouts", "sync", "adapters")
P = TypeVar("P", bound=Policy)
M = TypeVar("M", bound=BaseModel)


def _nowhere(path: Path, at_key: bool) -> tuple[int | None, int | None]:
    return None, None


def build_policy_set(data: Any, *, source: str | None = None, locate: Locator = _nowhere,
                     plugins: frozenset[str] = ANY_PLUGIN) -> PolicySet:
    """Validate a parsed document and build its PolicySet; raise PolicyError at the first problem.

    ``plugins``: the ``module:Class`` specs the document may import (``registry.resolve_policy``).
    """
    if not isinstance(data, Mapping):
        raise PolicyError(f"a policy document is a mapping, got {_kind(data)}", *locate((), False))
    for key in data:
        if key not in _SECTIONS:
            raise PolicyError(
                f"unknown section {key!r}{_did_you_mean(key, _SECTIONS)}; sections: {', '.join(_SECTIONS)}",
                *locate((key,), True),
                field=str(key),
            )
    if "apiVersion" not in data:
        raise PolicyError(f"missing apiVersion (use {API_VERSION!r})", *locate((), False), field="apiVersion")
    if data["apiVersion"] != API_VERSION:
        raise PolicyError(
            f"unsupported apiVersion {data['apiVersion']!r}; this colocd reads {API_VERSION!r}",
            *locate(("apiVersion",), False),
            field="apiVersion",
        )
    # mypy's type-abstract: the bases are abstract on purpose; they are only used for isinstance.
    return PolicySet(
        process_groups=_build_policy(
            Family.PROCESS_GROUPS, ProcessGroupPolicy, data, locate, plugins),  # type: ignore[type-abstract]
        pipeline=_build_policy(
            Family.PIPELINE, PipelinePolicy, data, locate, plugins),  # type: ignore[type-abstract]
        cleanup=_build_policy(
            Family.CLEANUP, CleanupPolicy, data, locate, plugins),  # type: ignore[type-abstract]
        engines=_validate(EngineSettings, data.get("engines"), ("engines",), locate),
        timeouts=_validate(Timeouts, data.get("timeouts"), ("timeouts",), locate),
        sync=_validate(SyncSettings, data.get("sync"), ("sync",), locate),
        adapters=_validate(AdapterSettings, data.get("adapters"), ("adapters",), locate),
        source=source,
    )


def default_policies() -> PolicySet:
    """The PolicySet an empty ``apiVersion: colocd/v1`` document gives (version 0)."""
    return build_policy_set({"apiVersion": API_VERSION}, source="defaults")


def _build_policy(family: Family, base: type[P], data: Mapping[str, Any], locate: Locator,
                  plugins: frozenset[str]) -> P:
    path: Path = (str(family),)
    section = _mapping(data.get(str(family)), path, locate)
    name = section.get("policy", DEFAULT_NAMES[family])
    if not isinstance(name, str) or not name:
        raise PolicyError(
            f"policy must be a name or '<module>:<Class>', got {_kind(name)}",
            *locate((*path, "policy"), False),
            field=f"{family}.policy",
        )
    try:
        cls = resolve_policy(family, name, plugins=plugins)
    except PolicyError as exc:
        raise exc.at(*locate((*path, "policy"), False), field=f"{family}.policy") from exc.__cause__
    rest = {k: v for k, v in section.items() if k != "policy"}
    config = _validate(cls.Config, rest, path, locate, extra_allowed=("policy",), family=family)
    try:
        policy = cls(config, spec=name)
    except Exception as exc:  # a plugin's constructor is foreign code; report it where it was named
        raise PolicyError(
            f"{name!r} could not be constructed: {exc!r}",
            *locate((*path, "policy"), False),
            field=f"{family}.policy",
        ) from exc
    if not isinstance(policy, base):  # resolve_policy checked the class; this narrows the type
        raise PolicyError(f"{name!r} did not build a {base.__name__}", *locate((*path, "policy"), False))
    return policy


def _validate(
    model: type[M],
    section: Any,
    path: Path,
    locate: Locator,
    extra_allowed: tuple[str, ...] = (),
    family: Family | None = None,
) -> M:
    values = _mapping(section, path, locate)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _first_error(exc, model, path, locate, extra_allowed, family) from None


def _mapping(section: Any, path: Path, locate: Locator) -> Mapping[str, Any]:
    if section is None:  # an empty section means all defaults
        return {}
    if not isinstance(section, Mapping):
        raise PolicyError(
            f"must be a mapping, got {_kind(section)}", *locate(path, False), field=_dotted(path)
        )
    return section


def _first_error(
    exc: ValidationError,
    model: type[BaseModel],
    path: Path,
    locate: Locator,
    extra_allowed: tuple[str, ...],
    family: Family | None,
) -> PolicyError:
    errors = exc.errors(include_url=False)

    def place(err: Any) -> tuple[Path, bool]:
        loc = (*path, *err["loc"])
        if err["type"] == "missing":  # nothing to point at but the section holding it
            return loc[:-1], False
        return loc, err["type"] == "extra_forbidden"

    def order(err: Any) -> tuple[int, int]:
        line, column = locate(*place(err))
        return (line or 0, column or 0)

    first = min(errors, key=order)
    where, at_key = place(first)
    loc = (*path, *first["loc"])
    if first["type"] == "extra_forbidden":
        key = str(first["loc"][-1])
        accepted = (*extra_allowed, *model.model_fields)
        message = f"unknown field {key!r}{_did_you_mean(key, accepted)}; accepted here: {', '.join(accepted)}"
        owners = (
            [name for name, cls in BUILTINS[family].items() if key in cls.Config.model_fields]
            if family
            else []
        )
        if owners:
            # The usual cause: the policy was switched and a field of the old one was left behind.
            message += f" ({key!r} belongs to policy {' / '.join(owners)})"
    elif first["type"] == "missing":
        message = "required field is missing"
    else:
        message = f"{first['msg']} (got {first['input']!r})"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return PolicyError(message, *locate(where, at_key), field=_dotted(loc))


def _dotted(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _did_you_mean(word: Any, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(str(word), choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _kind(value: Any) -> str:
    return "nothing" if value is None else f"{type(value).__name__} {value!r}"


# --- JSON Schema -------------------------------------------------------------------------------


class _PluginSection(BaseModel):
    """A plugin policy: its own Config decides the other keys, so the schema cannot."""

    model_config = ConfigDict(extra="allow", title="PluginPolicy")

    policy: str = Field(..., description="'<module>:<Class>' or an entry point name in group colocd.policies")


def _section_models(family: Family) -> list[type[BaseModel]]:
    models: list[type[BaseModel]] = []
    for name, cls in BUILTINS[family].items():
        literal = Literal[name]  # type: ignore[valid-type]
        # Only the family's default may leave out ``policy``; every other variant needs its name.
        policy_field = (literal, name) if name == DEFAULT_NAMES[family] else (literal, ...)
        title = "".join(part.title() for part in (str(family), name, "section") for part in part.split("_"))
        models.append(create_model(title, __base__=cls.Config, __doc__=cls.__doc__, policy=policy_field))
    builtin_names: list[Any] = list(BUILTINS[family])
    plugin = create_model(
        f"{''.join(p.title() for p in str(family).split('_'))}PluginSection",
        __base__=_PluginSection,
        policy=(str, Field(..., json_schema_extra={"not": {"enum": builtin_names}})),
    )
    models.append(plugin)
    return models


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy document, for editors and ``policies/schema.json``."""
    fields: dict[str, Any] = {"apiVersion": (Literal["colocd/v1"], Field(..., description="document format"))}
    for family in Family:
        union = tuple(_section_models(family))
        # null is accepted: an empty section means the family's defaults.
        fields[str(family)] = (_union((*union, type(None))), None)
    fields["engines"] = (EngineSettings | None, None)
    fields["timeouts"] = (Timeouts | None, None)
    fields["sync"] = (SyncSettings | None, None)
    fields["adapters"] = (AdapterSettings | None, None)
    document = create_model(
        "ColocdPolicyDocument",
        __config__=ConfigDict(extra="forbid"),
        __doc__="A colocd policy document (apiVersion colocd/v1).",
        **fields,
    )
    schema: dict[str, Any] = document.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "colocd/v1/policies", **schema}


def _union(members: tuple[type, ...]) -> Any:
    return Union[members]  # noqa: UP007 - built at runtime from a tuple
