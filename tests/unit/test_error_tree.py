"""The exception tree is one module: every public exception colocd defines is in ``colocd.errors``, under
``ColocdError``; the only exceptions defined elsewhere are the ones its docstring names."""

from __future__ import annotations

import ast
import builtins
import inspect
from pathlib import Path

import colocd
from colocd import errors

PACKAGE = Path(colocd.__file__).parent
# Deliberately elsewhere (colocd/errors.py says why): the reference engine is a separate program imitating
# SGLang, and ClusterStepError sits beside the StepResult it carries.
ELSEWHERE = {"cluster/client.py": {"ClusterStepError"}}
OUTSIDE = ("engines/reference/", "tests/", "benchmarks/", "scripts/", "deploy/")
EXCEPTION_NAMES = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
EXCEPTION_NAMES |= {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}


def _public_exception_classes(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute) else ""
                     for b in node.bases}
            if bases & EXCEPTION_NAMES:
                found.add(node.name)
    return found


def test_no_public_exception_is_defined_outside_the_tree_module() -> None:
    strays = {}
    for path in PACKAGE.rglob("*.py"):
        rel = path.relative_to(PACKAGE).as_posix()
        # A checkout's hidden folders (a venv, a copy of another revision) are not the package.
        if rel == "errors.py" or rel.startswith(OUTSIDE) or rel.startswith("."):
            continue
        if found := _public_exception_classes(path) - ELSEWHERE.get(rel, set()):
            strays[rel] = sorted(found)
    assert strays == {}, f"define these in colocd/errors.py, under ColocdError: {strays}"


def test_every_exception_of_the_tree_module_is_a_colocd_error_and_drawn_in_its_docstring() -> None:
    classes = [v for v in vars(errors).values() if inspect.isclass(v) and issubclass(v, BaseException)
               and v.__module__ == errors.__name__]
    assert sorted(c.__name__ for c in classes) == sorted(errors.__all__)
    assert [c.__name__ for c in classes if not issubclass(c, errors.ColocdError)] == []
    assert [c.__name__ for c in classes if c.__name__ not in (errors.__doc__ or "")] == []
