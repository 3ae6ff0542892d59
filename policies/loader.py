"""Parses a YAML policy document into a ``PolicySet``; errors carry the offending node's line and column.

Positions come from PyYAML's composer (node marks), so a typo deep in a section points at its own line.
"""

from __future__ import annotations

from typing import Any

import yaml

from .document import Path, build_policy_set
from .errors import PolicyError
from .policy_set import PolicySet

__all__ = ["load_policy_yaml"]

_Mark = tuple[int, int]  # 1-based line, column


def load_policy_yaml(text: str | bytes, *, source: str | None = None) -> PolicySet:
    """Parse and validate one YAML document; raise PolicyError(message, line, column) on any problem.

    ``load_policy_yaml(open("policies.yaml").read(), source="policies.yaml")``
    """
    loader = yaml.SafeLoader(text)
    try:
        try:
            node = loader.get_single_node()
        except yaml.MarkedYAMLError as exc:
            mark = exc.problem_mark or exc.context_mark
            problem = " ".join(p for p in (exc.context, exc.problem) if p) or "invalid YAML"
            raise PolicyError(f"invalid YAML: {problem}", *_position(mark)) from None
        except yaml.YAMLError as exc:
            raise PolicyError(f"invalid YAML: {exc}") from None
        if node is None:
            raise PolicyError("empty document; it needs at least 'apiVersion: colocd/v1'", 1, 1)
        marks: dict[tuple[Path, bool], _Mark] = {}
        _walk(node, (), marks)
        try:
            data = loader.construct_document(node)
        except yaml.MarkedYAMLError as exc:  # e.g. an unknown !tag
            raise PolicyError(f"invalid YAML: {exc.problem}", *_position(exc.problem_mark)) from None
    finally:
        loader.dispose()

    def locate(path: Path, at_key: bool) -> tuple[int | None, int | None]:
        # Fall back to the nearest located ancestor: pydantic may name a position inside a scalar.
        for cut in range(len(path), -1, -1):
            mark = marks.get((path[:cut], at_key and cut == len(path)))
            if mark is not None:
                return mark
        return None, None

    return build_policy_set(data, source=source, locate=locate)


def _walk(node: yaml.Node, path: Path, marks: dict[tuple[Path, bool], _Mark]) -> None:
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


def _position(mark: Any) -> _Mark:
    if mark is None:
        return (None, None)  # type: ignore[return-value]
    return mark.line + 1, mark.column + 1


def _join(path: Path, key: str) -> str:
    return ".".join(str(p) for p in (*path, key))
