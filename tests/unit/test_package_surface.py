"""The wheel is the product and nothing else: the lab (``benchmarks/``: benches, their results, device scripts) sits
beside the package in the checkout, is not installed, and no installed module imports it."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
PACKAGE_DATA = {"colocd/policies/schema.json"}  # pyproject.toml's package-data: the only file that is not Python
LAB = ("benchmarks", "bench")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    """The wheel built from this checkout as a user's ``pip wheel .`` builds it; setuptools' build and egg-info
    folders go to a temporary directory (DIST_EXTRA_CONFIG), so no earlier build's leftovers get into it."""
    tmp = tmp_path_factory.mktemp("wheel")
    extra = tmp / "setup.cfg"
    extra.write_text(f"[build]\nbuild_base = {tmp / 'build'}\n[egg_info]\negg_base = {tmp}\n")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp / "dist"), str(CHECKOUT)],
                   check=True, timeout=240, env={**os.environ, "DIST_EXTRA_CONFIG": str(extra)})
    (built,) = (tmp / "dist").glob("colocd-*.whl")
    return zipfile.ZipFile(built)


def _modules(wheel: zipfile.ZipFile) -> list[str]:
    return [n for n in wheel.namelist() if n.endswith(".py")]


def test_the_wheel_holds_python_modules_the_policy_schema_and_its_metadata_only(wheel: zipfile.ZipFile) -> None:
    others = [n for n in wheel.namelist()
              if not n.endswith(".py") and n not in PACKAGE_DATA and ".dist-info/" not in n]
    assert others == []
    assert "colocd/cli.py" in wheel.namelist() and "colocd/timeline.py" in wheel.namelist()


def test_the_wheel_holds_no_bench_module(wheel: zipfile.ZipFile) -> None:
    assert [n for n in _modules(wheel) if n.split("/")[1] in LAB] == []


def _imported(source: str, module: str) -> list[str]:
    """Every module an ``import``/``from ... import`` in ``source`` names, made absolute (``module`` is its name)."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: len(module.split(".")) - node.level] if node.level else []
            target = ".".join([*base, node.module] if node.module else base)
            names += [target] + [f"{target}.{alias.name}" for alias in node.names]
    return names


def test_no_module_of_the_wheel_imports_the_lab(wheel: zipfile.ZipFile) -> None:
    lab = {"benchmarks", *(f"colocd.{name}" for name in LAB)}
    offenders = []
    for path in _modules(wheel):
        module = path.removesuffix(".py").removesuffix("/__init__").replace("/", ".")
        if path.endswith("__init__.py"):
            module += ".__init__"  # a package's relative imports resolve against the package itself
        for name in _imported(wheel.read(path).decode(), module):
            if any(name == top or name.startswith(top + ".") for top in lab):
                offenders.append(f"{path}: {name}")
    assert offenders == []
