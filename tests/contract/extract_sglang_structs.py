"""Record SGLang's HTTP request structs and control routes from a wheel by parsing, never importing, it.

Importing ``sglang.srt.managers.io_struct`` pulls in most of SGLang's runtime (torch, zmq, msgspec,
transformers, triton, ...; research/engine-apis.md §7), so this reads the wheel's
``sglang/srt/managers/io_struct.py`` and ``sglang/srt/entrypoints/http_server.py`` with ``ast``
and writes, for each struct colocd sends, every field's name, annotation source, default source and
line, plus the routes colocd calls with the body struct each one parses. The JSON it writes is the
fixture ``tests/contract/test_sglang_contract.py`` checks colocd's wire models against.

    python tests/contract/extract_sglang_structs.py /tmp/sgl/sglang-0.5.23-*.whl \\
        -o tests/contract/fixtures/sglang_0_5_23_io_struct.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import re
import sys
import zipfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_ROUTES", "DEFAULT_STRUCTS", "extract_from_sources", "extract_from_wheel", "main"]

IO_STRUCT_PATH = "sglang/srt/managers/io_struct.py"
HTTP_SERVER_PATH = "sglang/srt/entrypoints/http_server.py"

# The request bodies colocd sends (engines/sglang/wire.py); a struct missing from a version is
# recorded as absent, which is itself a protocol fact (e.g. no BeginWeightUpdateReqInput before 0.5.21).
DEFAULT_STRUCTS: tuple[str, ...] = (
    "ReleaseMemoryOccupationReqInput",
    "ResumeMemoryOccupationReqInput",
    "PauseGenerationReqInput",
    "ContinueGenerationReqInput",
    "BeginWeightUpdateReqInput",
    "EndWeightUpdateReqInput",
    "UpdateWeightsFromTensorReqInput",
    "UpdateWeightVersionReqInput",
    "UpdateWeightFromDiskReqInput",
    "InitWeightsUpdateGroupReqInput",
    "UpdateWeightsFromDistributedReqInput",
    "DestroyWeightsUpdateGroupReqInput",
    "CheckWeightsReqInput",
)

# The routes colocd calls or probes (engines/sglang/protocol.py); absent ones are recorded as absent.
DEFAULT_ROUTES: tuple[str, ...] = (
    "/health",
    "/health_generate",
    "/ready",
    "/model_info",
    "/get_model_info",
    "/server_info",
    "/get_server_info",
    "/weight_version",
    "/get_weight_version",
    "/flush_cache",
    "/release_memory_occupation",
    "/resume_memory_occupation",
    "/pause_generation",
    "/continue_generation",
    "/begin_weight_update",
    "/end_weight_update",
    "/update_weights_from_tensor",
    "/update_weights_from_distributed",
    "/update_weights_from_disk",
    "/init_weights_update_group",
    "/destroy_weights_update_group",
    "/update_weight_version",
    "/weights_checker",
)

_ROUTE_DECORATORS = {"get": ["GET"], "post": ["POST"], "put": ["PUT"], "delete": ["DELETE"]}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _src(source: str, node: ast.AST | None) -> str | None:
    if node is None:
        return None
    text = ast.get_source_segment(source, node)
    return " ".join(text.split()) if text is not None else ast.unparse(node)


def _is_dataclass_decorated(cls: ast.ClassDef) -> bool:
    for deco in cls.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name == "dataclass":
            return True
    return False


def _base_names(cls: ast.ClassDef) -> list[str]:
    return [ast.unparse(b) for b in cls.bases]


def _field_default(source: str, value: ast.expr | None) -> tuple[str | None, str | None]:
    """(default source, default_factory source) of one class-level assignment.

    ``field(default=..., kw_only=True)`` (dataclasses) and ``msgspec.field(...)`` are unwrapped, so
    the recorded default is the value SGLang fills in, not the call that declares it.
    """
    if value is None:
        return None, None
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "field":
            kw = {k.arg: k.value for k in value.keywords}
            return _src(source, kw.get("default")), _src(source, kw.get("default_factory"))
    return _src(source, value), None


def _own_fields(source: str, cls: ast.ClassDef) -> list[dict[str, Any]]:
    fields: list[dict[str, Any]] = []
    for stmt in cls.body:
        if not isinstance(stmt, ast.AnnAssign) or not isinstance(stmt.target, ast.Name):
            continue
        annotation = _src(source, stmt.annotation) or ""
        if annotation.startswith(("ClassVar", "typing.ClassVar")):
            continue
        default, factory = _field_default(source, stmt.value)
        fields.append(
            {
                "name": stmt.target.id,
                "annotation": annotation,
                "default": default,
                "default_factory": factory,
                "required": default is None and factory is None,
                "line": stmt.lineno,
                "declared_in": cls.name,
            }
        )
    return fields


def _struct_record(source: str, classes: dict[str, ast.ClassDef], name: str) -> dict[str, Any]:
    """One struct with its inherited fields first (dataclass and msgspec both order bases first)."""
    cls = classes[name]
    chain: list[ast.ClassDef] = []
    seen: set[str] = set()
    current: ast.ClassDef | None = cls
    while current is not None and current.name not in seen:
        seen.add(current.name)
        chain.append(current)
        parent = next((b for b in _base_names(current) if b in classes), None)
        current = classes.get(parent) if parent else None
    by_name: dict[str, dict[str, Any]] = {}
    for klass in reversed(chain):
        for f in _own_fields(source, klass):
            by_name[f["name"]] = f  # a subclass re-declaration wins, as in both frameworks
    bases = _base_names(cls)
    root_bases = [b for k in chain for b in _base_names(k)]
    kind = (
        "msgspec"
        if any("msgspec.Struct" in b for b in root_bases)
        else ("dataclass" if any(_is_dataclass_decorated(k) for k in chain) else "class")
    )
    return {"line": cls.lineno, "bases": bases, "kind": kind, "fields": list(by_name.values())}


def _route_paths(deco: ast.expr) -> tuple[str, list[str]] | None:
    if not (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)):
        return None
    if not (isinstance(deco.func.value, ast.Name) and deco.func.value.id == "app"):
        return None
    method = deco.func.attr
    if not deco.args or not isinstance(deco.args[0], ast.Constant) or not isinstance(deco.args[0].value, str):
        return None
    path = deco.args[0].value
    if method == "api_route":
        methods_kw = next((k.value for k in deco.keywords if k.arg == "methods"), None)
        methods = [
            e.value
            for e in getattr(methods_kw, "elts", [])
            if isinstance(e, ast.Constant) and isinstance(e.value, str)
        ]
        return path, methods or ["GET"]
    if method in _ROUTE_DECORATORS:
        return path, _ROUTE_DECORATORS[method]
    return None


def _body_of(
    func: ast.FunctionDef | ast.AsyncFunctionDef, struct_names: Iterable[str]
) -> tuple[str | None, bool]:
    """The request struct a handler parses from the body, and whether the body is required."""
    names = set(struct_names)
    args = func.args.args
    defaults = [None] * (len(args) - len(func.args.defaults)) + list(func.args.defaults)
    for arg, default in zip(args, defaults, strict=True):
        if arg.annotation is None:
            continue
        mentioned = {n.id for n in ast.walk(arg.annotation) if isinstance(n, ast.Name)}
        mentioned |= {n.attr for n in ast.walk(arg.annotation) if isinstance(n, ast.Attribute)}
        hits = sorted(mentioned & names)
        if hits:
            optional = "Optional" in mentioned or default is not None
            return hits[0], not optional
    return None, False


def _query_params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    """Handler parameters FastAPI reads from the query string (``x: float = Query(...)``)."""
    args = func.args.args
    defaults = [None] * (len(args) - len(func.args.defaults)) + list(func.args.defaults)
    out = []
    for arg, default in zip(args, defaults, strict=True):
        if isinstance(default, ast.Call) and getattr(default.func, "id", None) == "Query":
            out.append(arg.arg)
    return out


def _always_404(func: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """A route kept only to answer 404 (0.5.9+ keeps /get_weight_version this way)."""
    body = [s for s in func.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return False
    status = next((k.value for k in body[0].exc.keywords if k.arg == "status_code"), None)
    return isinstance(status, ast.Constant) and status.value == 404


def _routes(
    source: str, tree: ast.Module, wanted: Sequence[str], struct_names: Iterable[str]
) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for deco in node.decorator_list:
            hit = _route_paths(deco)
            if hit is None or hit[0] not in wanted:
                continue
            path, methods = hit
            body, required = _body_of(node, struct_names)
            entry = found.setdefault(
                path,
                {
                    "methods": [],
                    "line": deco.lineno,
                    "function": node.name,
                    "body": body,
                    "body_required": required,
                    "query": _query_params(node),
                },
            )
            entry["methods"] = sorted(set(entry["methods"]) | set(methods))
            entry["deprecated"] = "deprecated" in (ast.get_docstring(node) or "").lower()
            entry["always_404"] = _always_404(node)
    return {path: found.get(path) for path in wanted}


def extract_from_sources(
    io_struct: str,
    http_server: str,
    *,
    structs: Sequence[str] = DEFAULT_STRUCTS,
    routes: Sequence[str] = DEFAULT_ROUTES,
) -> dict[str, Any]:
    """The fixture body (structs and routes) for one version's two source files."""
    tree = ast.parse(io_struct)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    server_tree = ast.parse(http_server)
    return {
        "structs": {
            name: (_struct_record(io_struct, classes, name) if name in classes else None) for name in structs
        },
        "routes": _routes(http_server, server_tree, routes, classes),
    }


def _version_of(zf: zipfile.ZipFile) -> str:
    # The wheel's METADATA, not sglang/version.py: recent wheels ship a "0.0.0.dev0" placeholder there.
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    match = re.search(r"^Version:\s*(\S+)\s*$", zf.read(name).decode(), re.MULTILINE)
    if match is None:
        raise ValueError(f"no Version: line in {name}")
    return match.group(1)


def extract_from_wheel(wheel: Path) -> dict[str, Any]:
    """The complete fixture for one SGLang wheel: version, checksums, structs and routes."""
    with zipfile.ZipFile(wheel) as zf:
        io_bytes = zf.read(IO_STRUCT_PATH)
        http_bytes = zf.read(HTTP_SERVER_PATH)
        version = _version_of(zf)
    body = extract_from_sources(io_bytes.decode(), http_bytes.decode())
    return {
        "sglang_version": version,
        "wheel": wheel.name,
        "wheel_sha256": _sha256(wheel.read_bytes()),
        "io_struct": {"path": IO_STRUCT_PATH, "sha256": _sha256(io_bytes)},
        "http_server": {"path": HTTP_SERVER_PATH, "sha256": _sha256(http_bytes)},
        "generated_by": "tests/contract/extract_sglang_structs.py",
        **body,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="an sglang wheel (pip download --no-deps sglang==X -d DIR)")
    parser.add_argument("-o", "--output", type=Path, help="where to write the JSON; default: stdout")
    args = parser.parse_args(argv)
    fixture = extract_from_wheel(args.wheel)
    text = json.dumps(fixture, indent=1, sort_keys=False) + "\n"
    if args.output is None:
        sys.stdout.write(text)
    else:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
