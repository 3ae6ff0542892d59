"""Parses a YAML policy document into a ``PolicySet``; errors carry the offending node's line and column.

Positions come from PyYAML's composer (node marks), so a typo deep in a section points at its own line.
Parsing is bounded (``YamlLimits``): size, aliases, nesting depth and nodes counted with aliases expanded,
all enforced while the composer runs, so a small alias bomb ("billion laughs") or a flat list of 100k
scalars is refused after the limit's worth of nodes instead of after the whole document. Characters the
YAML reader refuses (NUL, BEL, ESC, ...) are refused first, with their line and column; every other
failure of the reader, composer or constructor is a ``PolicyError`` too, never a foreign exception.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import PolicyError
from .document import Path, build_policy_set
from .policy_set import PolicySet
from .registry import ANY_PLUGIN

__all__ = ["YamlLimits", "load_policy_yaml"]

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
    """Parse and validate one YAML document; raise PolicyError(message, line, column) on any problem.

    ``load_policy_yaml(open("policies.yaml").read(), source="policies.yaml")``

    ``plugins``: the ``module:Class`` specs it may import (the daemon passes its node config's
    ``policy_plugins``; the default, any, is for an operator's own offline check). CPU-bound: the daemon
    calls it off the event loop.
    """
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

    return build_policy_set(data, source=source, locate=locate, plugins=plugins)


def _walk(node: yaml.Node, path: Path, marks: dict[tuple[Path, bool], _Mark]) -> None:
    """Record every node's position and refuse duplicate or non-scalar keys; composing already bounded the
    nodes (aliases expanded) this visits."""
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
                raise PolicyError(
                    f"key {key!r} appears twice (first at line {seen[key]})",
                    line,
                    column,
                    field=_join(path, key),
                )
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


def _join(path: Path, key: str) -> str:
    return ".".join(str(p) for p in (*path, key))
