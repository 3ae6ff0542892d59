"""One policy document: YAML text → a validated ``PolicySet``, and the document's JSON Schema. Every failure is a
``PolicyError`` at the offending node's line and column; ``YamlLimits`` bound the composer as it runs, so an alias
bomb is refused after the limit's worth of nodes, not after the whole document."""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar, Union

import yaml
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

__all__ = ["YamlLimits", "default_policies", "load_policy_yaml", "policy_json_schema"]

Path = tuple[str | int, ...]
# (path, at_key) -> (line, column), 1-based; at_key points at the mapping key rather than its value.
Locator = Callable[[Path, bool], tuple[int | None, int | None]]
_Mark = tuple[int, int]  # 1-based line, column

# What PyYAML's reader refuses (yaml.reader.Reader.NON_PRINTABLE): C0 controls but tab and newlines, DEL and
# C1 controls but NEL, surrogates, U+FFFE/FFFF. Checked before the reader runs so the error says where.
_NOT_YAML_TEXT = re.compile("[^\t\n\r\x20-\x7e\x85\xa0-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")


@dataclass(frozen=True, slots=True)
class YamlLimits:
    """Bounds on one policy document; the daemon passes its node config's ``limits``."""

    max_bytes: int = 256 * 1024
    max_aliases: int = 64
    max_nodes: int = 5_000  # counted with aliases expanded: what validation would walk
    max_depth: int = 64


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts nodes (aliases expanded), aliases and nesting while composing, and stops at the
    first limit crossed: PyYAML scans lazily, so nothing past that point is even tokenised."""

    def __init__(self, stream: str, limits: YamlLimits) -> None:
        super().__init__(stream)
        self._limits = limits
        self._aliases = 0
        self._depth = 0
        self._nodes = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its node count with aliases expanded, once composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            self._aliases += 1
            if self._aliases > self._limits.max_aliases:
                raise PolicyError(f"more than {self._limits.max_aliases} YAML aliases (limits.max_yaml_aliases)",
                                  *_position(mark))
            node = super().compose_node(parent, index)
            size = self._sizes.get(id(node))
            if size is None:  # the anchored node is still being composed: the alias is inside it
                raise PolicyError("a YAML alias refers to a node that contains it (a recursive document)",
                                  *_position(mark))
            self._spend(size, mark)
            return node
        self._depth += 1
        try:
            mark = self.peek_event().start_mark  # type: ignore[no-untyped-call]
            if self._depth > self._limits.max_depth:
                raise PolicyError(f"nested deeper than {self._limits.max_depth} levels", *_position(mark))
            before = self._nodes
            self._spend(1, mark)
            node = super().compose_node(parent, index)
            self._sizes[id(node)] = self._nodes - before
            return node
        finally:
            self._depth -= 1

    def _spend(self, nodes: int, mark: Any) -> None:
        self._nodes += nodes
        if self._nodes > self._limits.max_nodes:
            raise PolicyError(f"more than {self._limits.max_nodes} YAML nodes with aliases expanded "
                              "(limits.max_yaml_nodes)", *_position(mark))


def load_policy_yaml(text: str | bytes, *, source: str | None = None, limits: YamlLimits | None = None,
                     plugins: frozenset[str] = ANY_PLUGIN) -> PolicySet:
    """Parse and validate one YAML document (PolicyError on any problem); ``plugins``: the ``module:Class`` specs it
    may import (the node config's ``policy_plugins``; any, for an operator's offline check). CPU-bound."""
    limits = limits or YamlLimits()
    size = len(text.encode() if isinstance(text, str) else text)
    if size > limits.max_bytes:
        raise PolicyError(f"document is {size} bytes, over the limit of {limits.max_bytes} (limits.max_policy_bytes)")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PolicyError(f"document is not UTF-8: byte {exc.object[exc.start]:#04x} at offset {exc.start} "
                              f"({exc.reason})") from None
    _check_text(text)
    try:
        loader = _BoundedLoader(text, limits)
    except yaml.YAMLError as exc:  # the reader's own checks (_check_text should have caught them)
        raise PolicyError(f"invalid YAML: {str(exc).splitlines()[0]}") from None
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = " ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
            raise PolicyError(f"invalid YAML: {problem}", *_position(mark)) from None
        except yaml.YAMLError as exc:
            raise PolicyError(f"invalid YAML: {str(exc).splitlines()[0]}") from None
        if node is None:
            raise PolicyError("empty document; it needs at least 'apiVersion: colocd/v1'", 1, 1)
        marks: dict[tuple[Path, bool], _Mark] = {}
        _walk(node, (), marks)
        try:
            data = loader.construct_document(node)
        except yaml.MarkedYAMLError as exc:  # e.g. an unknown !tag
            raise PolicyError(f"invalid YAML: {exc.problem}", *_position(exc.problem_mark)) from None
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            # SafeConstructor's own conversions: "2026-13-01" as a date, an int of 5000 digits, !!int x.
            raise PolicyError(f"invalid YAML value: {exc}") from None
    finally:
        loader.dispose()

    def locate(path: Path, at_key: bool) -> tuple[int | None, int | None]:
        # Fall back to the nearest located ancestor: pydantic may name a position inside a scalar.
        for cut in range(len(path), -1, -1):
            mark = marks.get((path[:cut], at_key and cut == len(path)))
            if mark is not None:
                return mark
        return None, None

    return _build_policy_set(data, source, locate, plugins)


def _walk(node: yaml.Node, path: Path, marks: dict[tuple[Path, bool], _Mark]) -> None:
    """Record every node's position and refuse duplicate or non-scalar keys."""
    marks[(path, False)] = _position(node.start_mark)
    if isinstance(node, yaml.MappingNode):
        seen: dict[Any, int] = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            if key is None:
                raise PolicyError("mapping keys must be plain names", *_position(key_node.start_mark))
            if key in seen:
                # PyYAML silently keeps the last duplicate; an operator meant one of them, not both.
                line, column = _position(key_node.start_mark)
                raise PolicyError(f"key {key!r} appears twice (first at line {seen[key]})", line, column,
                                  field=".".join(str(p) for p in (*path, key)))
            seen[key] = _position(key_node.start_mark)[0]
            marks[((*path, key), True)] = _position(key_node.start_mark)
            _walk(value_node, (*path, key), marks)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _walk(item, (*path, index), marks)


def _check_text(text: str) -> None:
    """Refuse the first character YAML cannot hold, naming it and where it is (a NUL, BEL or ESC is a pasted
    binary or terminal escape, never a policy)."""
    bad = _NOT_YAML_TEXT.search(text)
    if bad is None:
        return
    char, offset = bad.group(), bad.start()
    line = text.count("\n", 0, offset) + 1
    column = offset - (text.rfind("\n", 0, offset) + 1) + 1
    raise PolicyError(f"character U+{ord(char):04X} is not allowed in a YAML document (control characters other "
                      "than tab and newline cannot appear, even quoted; write them as escapes in a "
                      "double-quoted string)", line, column)


def _position(mark: Any) -> _Mark:
    if mark is None:
        return (None, None)  # type: ignore[return-value]
    return mark.line + 1, mark.column + 1


# --- validation ------------------------------------------------------------------------------------

# The sections of plain settings (values, not policies), each named as its PolicySet field.
_SETTINGS: dict[str, type[BaseModel]] = {
    "engines": EngineSettings, "timeouts": Timeouts, "sync": SyncSettings, "adapters": AdapterSettings}
_SECTIONS: tuple[str, ...] = ("apiVersion", *(str(f) for f in Family), *_SETTINGS)
P = TypeVar("P", bound=Policy)
M = TypeVar("M", bound=BaseModel)


def _build_policy_set(data: Any, source: str | None, locate: Locator, plugins: frozenset[str]) -> PolicySet:
    """Validate a parsed document and build its PolicySet; raise PolicyError at the first problem."""
    if not isinstance(data, Mapping):
        raise PolicyError(f"a policy document is a mapping, got {_kind(data)}", *locate((), False))
    for key in data:
        if key not in _SECTIONS:
            raise PolicyError(f"unknown section {key!r}{_did_you_mean(key, _SECTIONS)}; sections: "
                              f"{', '.join(_SECTIONS)}", *locate((key,), True), field=str(key))
    if "apiVersion" not in data:
        raise PolicyError(f"missing apiVersion (use {API_VERSION!r})", *locate((), False), field="apiVersion")
    if data["apiVersion"] != API_VERSION:
        raise PolicyError(f"unsupported apiVersion {data['apiVersion']!r}; this colocd reads {API_VERSION!r}",
                          *locate(("apiVersion",), False), field="apiVersion")
    # mypy's type-abstract: the bases are abstract on purpose; they are only used for isinstance.
    return PolicySet(
        process_groups=_build_policy(
            Family.PROCESS_GROUPS, ProcessGroupPolicy, data, locate, plugins),  # type: ignore[type-abstract]
        pipeline=_build_policy(Family.PIPELINE, PipelinePolicy, data, locate, plugins),  # type: ignore[type-abstract]
        cleanup=_build_policy(Family.CLEANUP, CleanupPolicy, data, locate, plugins),  # type: ignore[type-abstract]
        engines=_validate(EngineSettings, data.get("engines"), ("engines",), locate),
        timeouts=_validate(Timeouts, data.get("timeouts"), ("timeouts",), locate),
        sync=_validate(SyncSettings, data.get("sync"), ("sync",), locate),
        adapters=_validate(AdapterSettings, data.get("adapters"), ("adapters",), locate),
        source=source)


def default_policies() -> PolicySet:
    """The PolicySet an empty ``apiVersion: colocd/v1`` document gives (version 0)."""
    return _build_policy_set({"apiVersion": API_VERSION}, "defaults", lambda path, at_key: (None, None), ANY_PLUGIN)


def _build_policy(family: Family, base: type[P], data: Mapping[str, Any], locate: Locator,
                  plugins: frozenset[str]) -> P:
    path: Path = (str(family),)
    section = _mapping(data.get(str(family)), path, locate)
    name = section.get("policy", DEFAULT_NAMES[family])
    if not isinstance(name, str) or not name:
        raise PolicyError(f"policy must be a name or '<module>:<Class>', got {_kind(name)}",
                          *locate((*path, "policy"), False), field=f"{family}.policy")
    try:
        cls = resolve_policy(family, name, plugins=plugins)
    except PolicyError as exc:
        raise exc.at(*locate((*path, "policy"), False), field=f"{family}.policy") from exc.__cause__
    rest = {k: v for k, v in section.items() if k != "policy"}
    config = _validate(cls.Config, rest, path, locate, extra_allowed=("policy",), family=family)
    try:
        policy = cls(config, spec=name)
    except Exception as exc:  # a plugin's constructor is foreign code; report it where it was named
        raise PolicyError(f"{name!r} could not be constructed: {exc!r}", *locate((*path, "policy"), False),
                          field=f"{family}.policy") from exc
    if not isinstance(policy, base):  # resolve_policy checked the class; this narrows the type
        raise PolicyError(f"{name!r} did not build a {base.__name__}", *locate((*path, "policy"), False))
    return policy


def _validate(model: type[M], section: Any, path: Path, locate: Locator, extra_allowed: tuple[str, ...] = (),
              family: Family | None = None) -> M:
    values = _mapping(section, path, locate)
    try:
        return model.model_validate(values)
    except ValidationError as exc:
        raise _first_error(exc, model, path, locate, extra_allowed, family) from None


def _mapping(section: Any, path: Path, locate: Locator) -> Mapping[str, Any]:
    if section is None:  # an empty section means all defaults
        return {}
    if not isinstance(section, Mapping):
        raise PolicyError(f"must be a mapping, got {_kind(section)}", *locate(path, False), field=_dotted(path))
    return section


def _first_error(exc: ValidationError, model: type[BaseModel], path: Path, locate: Locator,
                 extra_allowed: tuple[str, ...], family: Family | None) -> PolicyError:
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
        owners = [name for name, cls in BUILTINS[family].items() if key in cls.Config.model_fields] if family else []
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
    models.append(create_model(f"{''.join(p.title() for p in str(family).split('_'))}PluginSection",
                               __base__=_PluginSection,
                               policy=(str, Field(..., json_schema_extra={"not": {"enum": builtin_names}}))))
    return models


def policy_json_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a policy document, for editors and ``policies/schema.json``."""
    fields: dict[str, Any] = {"apiVersion": (Literal["colocd/v1"], Field(..., description="document format"))}
    for family in Family:
        union = tuple(_section_models(family))
        # null is accepted: an empty section means the family's defaults.
        fields[str(family)] = (Union[(*union, type(None))], None)
    for name, model in _SETTINGS.items():
        fields[name] = (model | None, None)
    document = create_model("ColocdPolicyDocument", __config__=ConfigDict(extra="forbid"),
                            __doc__="A colocd policy document (apiVersion colocd/v1).", **fields)
    schema: dict[str, Any] = document.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": "colocd/v1/policies", **schema}

