"""The published JSON Schema is up to date, accepts the shipped examples, and the package stays pure."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import colocd.policies
from colocd.policies import policy_json_schema

ROOT = Path(__file__).resolve().parents[2]
POLICIES = ROOT / "policies"


def test_schema_json_is_up_to_date() -> None:
    expected = json.dumps(policy_json_schema(), indent=2, sort_keys=True) + "\n"
    assert (POLICIES / "schema.json").read_text() == expected, "run: python scripts/write_policy_schema.py"


def _validator() -> object:
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator(policy_json_schema())


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_schema_accepts_the_shipped_examples(path: Path) -> None:
    errors = list(_validator().iter_errors(yaml.safe_load(path.read_text())))  # type: ignore[attr-defined]
    assert errors == []


@pytest.mark.parametrize(
    "doc",
    [
        {"apiVersion": "colocd/v2"},
        {"apiVersion": "colocd/v1", "bogus": {}},
        {"apiVersion": "colocd/v1", "process_groups": {"policy": "destroy", "max_resident_gib": 3}},
        {"apiVersion": "colocd/v1", "process_groups": {"policy": "auto"}},
        {"apiVersion": "colocd/v1", "pipeline": {"policy": "overlap", "transport": "pigeon"}},
        {"apiVersion": "colocd/v1", "engines": {"pause_mode": "stop"}},
    ],
)
def test_schema_rejects_what_the_loader_rejects(doc: dict[str, object]) -> None:
    assert list(_validator().iter_errors(doc))  # type: ignore[attr-defined]
    with pytest.raises(colocd.policies.PolicyError):
        colocd.policies.load_policy_yaml(yaml.safe_dump(doc))


def test_schema_leaves_room_for_plugins() -> None:
    doc = {"apiVersion": "colocd/v1", "cleanup": {"policy": "mypkg.cleanup:Custom", "knob": 3}}
    assert list(_validator().iter_errors(doc)) == []  # type: ignore[attr-defined]


def _isort_style(name: str) -> tuple[int, str]:
    # ruff RUF022's order: CONSTANTS, then Classes, then functions.
    return (0 if name.isupper() else 1 if name[:1].isupper() else 2, name)


@pytest.mark.parametrize("module", sorted(p.stem for p in POLICIES.glob("*.py")))
def test_every_module_declares_a_sorted_all_and_imports_nothing_else_of_ours(module: str) -> None:
    # Policies decide and import nothing of ours but the root of the exception tree (errors.py imports nothing).
    tree = ast.parse((POLICIES / f"{module}.py").read_text())
    assert ast.get_docstring(tree), f"{module} needs a one-sentence docstring"
    names = [
        ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets)
    ]
    assert names and names[0] == sorted(names[0], key=_isort_style), f"{module}: __all__ unsorted"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level:
            assert node.level == 1 or (node.level, node.module) == (2, "errors"), \
                f"{module} imports from outside policies/"
        if isinstance(node, ast.ImportFrom) and not node.level:
            assert not (node.module or "").startswith("colocd"), f"{module} imports {node.module}"
        if isinstance(node, ast.Import):
            assert not any(a.name.startswith("colocd") for a in node.names), f"{module} imports colocd"


def test_package_exports_are_complete() -> None:
    for name in colocd.policies.__all__:
        assert hasattr(colocd.policies, name)


def test_importing_policies_loads_neither_torch_nor_other_layers() -> None:
    code = (
        "import sys, colocd.policies\n"
        "layers = ('colocd.engines', 'colocd.daemon', 'colocd.api')\n"
        "bad = [m for m in sys.modules if m == 'torch' or m.startswith(layers)]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"
