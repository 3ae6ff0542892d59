"""Every body colocd sends is one SGLang's own request structs accept, per protocol band.

The structs are the ones ``tests/contract/extract_sglang_structs.py`` read out of the released wheels with
``ast`` (field names, annotation and default source, line numbers) and committed under
``fixtures/``: 0.5.23 for V0_5_23, 0.5.9 for PRE_SESSION, 0.5.4 for LEGACY. SGLang ignores keys it
does not know (``msgspec_utils.py`` ``extra_behavior="ignore"``), so a misspelt or missing field
would fail silently there; here it fails by name.
"""

from __future__ import annotations

import ast
import base64
import binascii
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import sglang_replies as replies
from pydantic import ValidationError

from colocd.engines.base import PauseMode
from colocd.engines.sglang import wire
from colocd.engines.sglang.protocol import LEGACY, PRE_SESSION, PROTOCOLS, V0_5_23, SGLangProtocol

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_OF = {
    V0_5_23.name: "sglang_0_5_23_io_struct.json",
    PRE_SESSION.name: "sglang_0_5_9_io_struct.json",
    LEGACY.name: "sglang_0_5_4_io_struct.json",
}
# BaseReq's routing fields (0.5.23 io_struct.py:89-90): defaulted, internal, never sent by colocd.
INTERNAL_FIELDS = {"rid", "http_worker_ipc"}
B64 = base64.b64encode(b"\x80\x04not-really-a-pickle").decode()
PROTOCOL_LIST = [V0_5_23, PRE_SESSION, LEGACY]


@cache
def fixture(protocol_name: str) -> dict[str, Any]:
    return json.loads((FIXTURES / FIXTURE_OF[protocol_name]).read_text())


def request_classes() -> list[type[wire.SGLangRequest]]:
    return [*(getattr(wire, n) for n in wire.__all__ if n.endswith("ReqInput")), replies.UpdateWeightFromDiskReqInput]


def samples(cls: type[wire.SGLangRequest]) -> Iterator[wire.SGLangRequest]:
    """A minimal body (required fields only) and one with every field set away from its default."""
    required: dict[type[wire.SGLangRequest], dict[str, Any]] = {
        wire.UpdateWeightsFromTensorReqInput: {"serialized_named_tensors": [B64, B64]},
        wire.UpdateWeightsFromDistributedReqInput: {
            "names": ["w"],
            "dtypes": ["bfloat16"],
            "shapes": [[2, 3]],
        },
        replies.UpdateWeightFromDiskReqInput: {"model_path": "/ckpt/step-7"},
        wire.InitWeightsUpdateGroupReqInput: {
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 3,
        },
        wire.UpdateWeightVersionReqInput: {"new_version": "7"},
    }
    everything: dict[str, Any] = {
        "tags": ["weights", "kv_cache"],
        "mode": "retract",
        "torch_empty_cache": False,
        "selector": "target",
        "load_format": "flattened_bucket",
        "flush_cache": False,
        "abort_all_requests": True,
        "weight_version": "7",
        "is_async": True,
        "keep_pause": True,
        "recapture_cuda_graph": True,
        "token_step": 7,
        "manifest": {"w": {"dtype": "bfloat16"}},
        "group_name": "colocd",
        "backend": "gloo",
        "action": "compare",
        "allow_quant_error": True,
        "skip_tensor_list": ["rotary"],
    }
    base = required.get(cls, {})
    yield cls.model_validate(base)
    full = {**base, **{k: v for k, v in everything.items() if k in cls.model_fields}}
    if cls is wire.ContinueGenerationReqInput:
        full["torch_empty_cache"] = False
    elif "torch_empty_cache" in full:
        full["torch_empty_cache"] = True  # default False there
    if cls is wire.UpdateWeightVersionReqInput:
        full["abort_all_requests"] = False  # default True there
    yield cls.model_validate(full)


# --- annotation checking: does a JSON value fit the annotation source SGLang wrote? ------------


def fits(annotation: str, value: Any) -> bool:
    return _fits(ast.parse(annotation, mode="eval").body, value)


def _name(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    raise AssertionError(f"annotation node not understood: {ast.dump(node)}")


def _fits(node: ast.expr, value: Any) -> bool:
    if isinstance(node, ast.Constant) and node.value is None:
        return value is None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _fits(node.left, value) or _fits(node.right, value)
    if isinstance(node, ast.Subscript):
        head = _name(node.value)
        args = list(node.slice.elts) if isinstance(node.slice, ast.Tuple) else [node.slice]
        if head == "Optional":
            return value is None or _fits(args[0], value)
        if head == "Union":
            return any(_fits(a, value) for a in args)
        if head in ("List", "list", "Tuple", "tuple"):
            return isinstance(value, list) and all(_fits(args[0], v) for v in value)
        if head in ("Dict", "dict"):
            return isinstance(value, dict) and all(
                _fits(args[0], k) and _fits(args[1], v) for k, v in value.items()
            )
        if head == "Literal":
            return any(isinstance(a, ast.Constant) and a.value == value for a in args)
        if head == "Annotated":
            if not _fits(args[0], value):
                return False
            if any(isinstance(m, ast.Call) and _name(m.func) == "Base64Bytes" for m in args[1:]):
                return _all_base64(value)  # msgspec_utils.py:24: b64decode(value, validate=True)
            return True
        raise AssertionError(f"annotation {head}[...] not understood")
    simple = _name(node)
    checks = {
        "Any": lambda v: True,
        "str": lambda v: isinstance(v, str),
        "bytes": lambda v: isinstance(v, str),  # JSON carries bytes as text
        "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "dict": lambda v: isinstance(v, dict),
        "list": lambda v: isinstance(v, list),
    }
    if simple not in checks:
        raise AssertionError(f"annotation {simple!r} not understood")
    return checks[simple](value)


def _all_base64(value: Any) -> bool:
    items = value if isinstance(value, list) else [value]
    try:
        for item in items:
            base64.b64decode(item, validate=True)
    except (binascii.Error, ValueError, TypeError):
        return False
    return True


def check_against_struct(struct_name: str, struct: dict[str, Any], body: dict[str, Any]) -> None:
    fields = {f["name"]: f for f in struct["fields"]}
    for key, value in body.items():
        assert key in fields, f"{struct_name} has no field {key!r} (SGLang would silently ignore it)"
        f = fields[key]
        assert fits(f["annotation"], value), (
            f"{struct_name}.{key}={value!r} does not fit {f['annotation']} (io_struct.py:{f['line']})"
        )
    for name, f in fields.items():
        if f["required"] and name not in INTERNAL_FIELDS:
            assert name in body, (
                f"{struct_name}.{name} has no default in SGLang (io_struct.py:{f['line']}) but is not sent"
            )


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", PROTOCOL_LIST, ids=lambda p: p.name)
@pytest.mark.parametrize("cls", request_classes(), ids=lambda c: c.__name__)
def test_every_request_body_fits_that_versions_struct(
    protocol: SGLangProtocol, cls: type[wire.SGLangRequest]
) -> None:
    struct = fixture(protocol.name)["structs"][cls.__name__]
    if not protocol.has_struct(cls.__name__):
        assert struct is None, f"{protocol.name} lists {cls.__name__} as absent but SGLang has it"
        with pytest.raises(ValueError, match="has no"):
            wire.body(next(samples(cls)), protocol)
        return
    assert struct is not None, f"SGLang {fixture(protocol.name)['sglang_version']} has no {cls.__name__}"
    minimal, full = samples(cls)
    check_against_struct(cls.__name__, struct, wire.body(minimal, protocol))
    absent = protocol.fields_absent(cls.__name__)
    try:
        body = wire.body(full, protocol)
    except ValueError as exc:
        assert any(f"{cls.__name__}.{name}" in str(exc) for name in absent), str(exc)
        body = wire.body(full.model_copy(update={n: cls.model_fields[n].default for n in absent}), protocol)
    check_against_struct(cls.__name__, struct, body)


@pytest.mark.parametrize("protocol", PROTOCOL_LIST, ids=lambda p: p.name)
def test_absent_fields_are_exactly_what_that_version_lacks(protocol: SGLangProtocol) -> None:
    structs = fixture(protocol.name)["structs"]
    for cls in request_classes():
        struct = structs[cls.__name__]
        if struct is None:
            assert not protocol.has_struct(cls.__name__)
            continue
        theirs = {f["name"] for f in struct["fields"]}
        lacking = set(cls.model_fields) - theirs
        assert lacking == set(protocol.fields_absent(cls.__name__)), (cls.__name__, lacking)


@pytest.mark.parametrize("cls", request_classes(), ids=lambda c: c.__name__)
def test_models_mirror_sglang_0_5_23_names_requiredness_and_defaults(cls: type[wire.SGLangRequest]) -> None:
    struct = fixture(V0_5_23.name)["structs"][cls.__name__]
    theirs = {f["name"]: f for f in struct["fields"] if f["name"] not in INTERNAL_FIELDS}
    assert set(cls.model_fields) == set(theirs), (
        f"{cls.__name__}: fields differ from io_struct.py:{struct['line']}"
    )
    for name, ours in cls.model_fields.items():
        f = theirs[name]
        assert ours.is_required() == f["required"], (
            f"{cls.__name__}.{name}: required differs (io_struct.py:{f['line']})"
        )
        if not f["required"]:
            assert ours.default == ast.literal_eval(f["default"]), (
                f"{cls.__name__}.{name}: default {ours.default!r} vs SGLang {f['default']} "
                f"(io_struct.py:{f['line']})"
            )


@pytest.mark.parametrize("protocol", PROTOCOL_LIST, ids=lambda p: p.name)
def test_protocol_routes_exist_in_that_version(protocol: SGLangProtocol) -> None:
    routes = fixture(protocol.name)["routes"]

    def live(path: str | None) -> bool:
        return path is not None and routes.get(path) is not None and not routes[path]["always_404"]

    route = protocol.weight_version_route
    assert live(route), f"{protocol.name}: {route} missing or a 404 stub"
    assert live("/begin_weight_update") == live("/end_weight_update") == protocol.weight_update_session
    assert (routes["/pause_generation"]["body"] is not None) == protocol.pause_body
    assert (routes["/continue_generation"]["body"] is not None) == protocol.continue_body
    for cls in request_classes():
        if protocol.has_struct(cls.__name__):
            route = routes[cls.ROUTE]
            assert route is not None and route["body"] == cls.__name__, (cls.ROUTE, route)


@pytest.mark.parametrize("protocol", PROTOCOL_LIST, ids=lambda p: p.name)
def test_pause_and_continue_bodies_follow_the_protocol(protocol: SGLangProtocol) -> None:
    for mode in PauseMode:
        if mode in protocol.pause_modes:
            request = wire.pause_generation_request(protocol, mode)
            assert (request is not None) == protocol.pause_body
            if request is not None:
                check_against_struct(
                    "PauseGenerationReqInput",
                    fixture(protocol.name)["structs"]["PauseGenerationReqInput"],
                    request,
                )
        else:
            with pytest.raises(ValueError, match="cannot pause"):
                wire.pause_generation_request(protocol, mode)
    request = wire.continue_generation_request(protocol)
    assert (request is not None) == protocol.continue_body


def test_a_non_default_value_an_old_sglang_would_ignore_is_refused() -> None:
    model = wire.UpdateWeightsFromDistributedReqInput(
        names=["w"], dtypes=["bfloat16"], shapes=[[2]], load_format="flattened_bucket"
    )
    with pytest.raises(ValueError, match=r"UpdateWeightsFromDistributedReqInput\.load_format"):
        wire.body(model, LEGACY)
    assert wire.body(model, PRE_SESSION)["load_format"] == "flattened_bucket"


def test_bodies_send_every_field_so_nothing_rests_on_sglang_defaults() -> None:
    body = wire.body(wire.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[B64]), V0_5_23)
    assert body["flush_cache"] is True and body["weight_version"] is None and body["selector"] == "all"
    assert set(body) == set(wire.UpdateWeightsFromTensorReqInput.model_fields)


def test_request_models_refuse_unknown_and_malformed_fields() -> None:
    with pytest.raises(ValidationError):
        wire.ReleaseMemoryOccupationReqInput.model_validate({"tag": ["weights"]})
    with pytest.raises(ValidationError, match="not standard base64"):
        wire.UpdateWeightsFromTensorReqInput(serialized_named_tensors=["a-b_"])
    with pytest.raises(ValidationError, match="one entry per tensor"):
        wire.UpdateWeightsFromDistributedReqInput(names=["a", "b"], dtypes=["bfloat16"], shapes=[[1]])
    with pytest.raises(ValidationError):
        wire.UpdateWeightsFromTensorReqInput(serialized_named_tensors=[])


def test_replies_parse_as_sglang_sends_them() -> None:
    # Shapes from 0.5.23 http_server.py: tensor update 1452-1455, version 1540-1549, pause 1838-1841,
    # weights_checker 1614-1619, error 2246-2250, /model_info 812-850, /server_info 863-894.
    assert replies.ControlResult.model_validate({"success": False, "message": "no session"}).success is False
    assert (
        replies.UpdateWeightVersionResult.model_validate(
            {"success": True, "message": "Weight version updated to 7", "new_version": "7"}
        ).new_version
        == "7"
    )
    assert (
        replies.GenerationControlResult.model_validate(
            {"message": "Generation paused successfully.", "status": "ok"}
        ).status
        == "ok"
    )
    checker = replies.CheckWeightsResult.model_validate(
        {"success": True, "message": "ok", "ranks": [{"per_gpu_checksum": "ab"}], "per_engine_checksum": "cd"}
    )
    assert checker.per_engine_checksum == "cd"
    assert replies.ErrorResponse.model_validate({"error": {"message": "boom"}}).error.message == "boom"
    info = wire.ModelInfo.model_validate({"model_path": "m", "weight_version": "7", "architectures": ["X"]})
    assert info.weight_version == "7"
    server = wire.ServerInfo.model_validate({"version": "0.5.4", "tp_size": 2, "port": 30000})
    assert server.tp_size == 2 and server.device is None
    assert replies.WeightVersionInfo.model_validate({"weight_version": "default"}).weight_version == "default"


def test_every_protocol_is_registered_by_name() -> None:
    assert set(PROTOCOLS) == set(FIXTURE_OF)


def test_wire_exports_are_sorted_and_complete() -> None:
    # ruff RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical.
    assert wire.__all__ == sorted(wire.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n))
    assert all(hasattr(wire, n) for n in wire.__all__)


# --- is each fixture what its wheel says today? --------------------------------------------------


def _wheel_cache() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "colocd" / "sglang-wheels"


def _fetch_wheel(version: str, name: str) -> Path:
    """The released wheel ``name`` of SGLang ``version``: from COLOCD_SGLANG_WHEEL (a wheel or a folder) if set, else
    fetched once with ``pip download --no-deps`` into a cache shared by every checkout on the machine."""
    spots = [Path(p) for p in os.environ.get("COLOCD_SGLANG_WHEEL", "").split(os.pathsep) if p]
    for spot in [*spots, _wheel_cache()]:
        found = spot if spot.is_file() else spot / name
        if found.name == name and found.is_file():
            return found
    cache = _wheel_cache()
    cache.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d", str(cache),
         f"sglang=={version}"], capture_output=True, text=True, timeout=240, check=False)
    if not (cache / name).is_file():
        pytest.skip(f"pip download --no-deps sglang=={version} did not give {name} "
                    f"(exit {done.returncode}: {done.stderr.strip()[-300:]})")
    return cache / name


def _extractor() -> Any:
    spec = importlib.util.spec_from_file_location(
        "extract_sglang_structs", ROOT / "tests" / "contract" / "extract_sglang_structs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("fixture_file", sorted(set(FIXTURE_OF.values())))
def test_fixture_matches_a_fresh_extraction_from_its_wheel(fixture_file: str) -> None:
    recorded = json.loads((FIXTURES / fixture_file).read_text())
    wheel = _fetch_wheel(recorded["sglang_version"], recorded["wheel"])
    fresh = _extractor().extract_from_wheel(wheel)
    assert fresh["wheel_sha256"] == recorded["wheel_sha256"], "a different build of the same wheel name"
    assert fresh == recorded, (
        f"re-run tests/contract/extract_sglang_structs.py {wheel} -o tests/contract/fixtures/{fixture_file}"
    )
