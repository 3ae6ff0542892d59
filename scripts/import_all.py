"""Import every module of the ``colocd`` package (what the wheel holds); exit non-zero naming each one that fails.

    python scripts/import_all.py        # what scripts/test.sh runs before pytest

A missing runtime dependency (one pyproject.toml does not declare) fails here, loudly, instead of
somewhere deep in a test. The modules are those of pyproject.toml's ``packages``, what the wheel holds: the
checkout's folder holds more (``benchmarks/``, the lab), which an editable install can reach. Modules that run only
inside an engine's own environment are allowed to miss exactly that engine's package, and nothing else.
"""

from __future__ import annotations

import importlib
import pkgutil
import sys
import tomllib
import traceback
from pathlib import Path

# module -> the one top-level package it may lack here (it is imported only inside that engine's process,
# or it belongs to an optional extra: colocd.cluster's Ray side is the ``colocd[ray]`` extra)
ENGINE_ONLY = {f"colocd.cluster.{m}": "ray" for m in ("registry", "trainer")}


def product_modules() -> list[str]:
    """The modules of pyproject.toml's packages: each package and the plain modules directly in it."""
    pyproject = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    root = importlib.import_module("colocd").__path__[0]
    names = []
    for package in pyproject["tool"]["setuptools"]["packages"]:
        names.append(package)
        folder = Path(root, *package.split(".")[1:])
        names += [f"{package}.{m.name}" for m in pkgutil.iter_modules([str(folder)]) if not m.ispkg]
    return names


def import_all() -> list[str]:
    """Import every colocd module; return one line per failure."""
    failures = []
    for name in product_modules():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            top = (exc.name or "").split(".")[0]
            if ENGINE_ONLY.get(name) == top:
                continue
            failures.append(f"{name}: missing module {exc.name!r} (is it declared in pyproject.toml?)")
        except Exception as exc:
            failures.append(f"{name}: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")
    return failures


def main() -> int:
    failures = import_all()
    for line in failures:
        print(f"import_all: {line}", file=sys.stderr)
    if not failures:
        print("import_all: every colocd module imports", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
