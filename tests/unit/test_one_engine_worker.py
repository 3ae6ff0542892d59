"""The daemon has one way to move an engine: the worker (daemon/worker.py) is the only module that reaches an
engine's adapter and the only one that writes an engine's record (``EngineHandle.state``); the plan
(daemon/reconcile.py) only computes records, and states.py defines them."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

DAEMON = Path(__file__).resolve().parents[2] / "daemon"
WORKER = "worker.py"


def _lines(kind: type[ast.AST], test: Callable[[Any], bool]) -> dict[str, list[int]]:
    """Each daemon module other than the worker, with the lines of its ``kind`` nodes where ``test`` holds."""
    found: dict[str, list[int]] = {}
    for path in sorted(DAEMON.glob("*.py")):
        if path.name == WORKER:
            continue
        nodes = ast.walk(ast.parse(path.read_text()))
        hits = [getattr(n, "lineno", 0) for n in nodes if isinstance(n, kind) and test(n)]
        if hits:
            found[path.name] = hits
    return found


def test_no_daemon_module_but_the_worker_reaches_an_engines_adapter() -> None:
    assert _lines(ast.Attribute, lambda n: n.attr == "adapter") == {}


def test_no_daemon_module_but_the_worker_writes_an_engines_record() -> None:
    def writes_state(node: ast.Assign) -> bool:
        """``x.state = <an EngineRecord>`` (a launched process's ``state`` is a ``LaunchState``: not a record)."""
        value = ast.unparse(node.value)
        record = "EngineRecord" in value or ".with_" in value or value.endswith(".state")
        return record and any(isinstance(t, ast.Attribute) and t.attr == "state" for t in node.targets)

    assert _lines(ast.Assign, writes_state) == {}


def test_the_worker_is_where_engines_are_called() -> None:
    """The rule above holds because the calls are here (a renamed worker would make it hold vacuously)."""
    tree = ast.parse((DAEMON / WORKER).read_text())
    assert sum(isinstance(n, ast.Attribute) and n.attr == "adapter" for n in ast.walk(tree)) >= 10
