"""vLLM's worker extension opens the trainer's own cuda_ipc chunk (SGLang's flattened bucket, or one handle per
tensor) in another process on the exporting GPU, and gets the trainer's tensors byte for byte; a chunk exported on
another GPU, or a server not launched to trust its trainer's pickles, is refused in words."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from colocd.engines.chunks import ChunkLayout
from colocd.engines.cuda_handles import device_uuid
from colocd.engines.sglang.payload import export_flattened_bucket, named_tensors_payload, serialize

pytestmark = pytest.mark.gpu

_GATE = "VLLM_ALLOW_INSECURE_SERIALIZATION"

# The vLLM worker's side: the extension's receiver on cuda:0, reading one payload from stdin.
_WORKER = """
import hashlib, json, sys, torch
from colocd.engines.vllm.extension import ChunkReceiver
receiver = ChunkReceiver(torch.device("cuda:0"))
try:
    named = receiver.tensors(receiver.select([json.loads(sys.stdin.read())], 0))
    print(json.dumps({"tensors": {name: [str(t.dtype), list(t.shape), hashlib.sha256(
        t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
        for name, t in named}}))
except ValueError as exc:
    print(json.dumps({"refused": str(exc)}))
"""


def _named() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda:0").manual_seed(0)
    return [("layer.weight", torch.randn(64, 32, device="cuda:0", generator=g).to(torch.bfloat16)),
            ("layer.bias", torch.randn(7, device="cuda:0", generator=g))]


def _handle(named: list[tuple[str, torch.Tensor]], load_format: str) -> tuple[dict[str, Any], object]:
    """The trainer's handle (as trainer/producer.py's cuda_ipc Producer exports it) and what keeps its buffer alive."""
    if load_format == "direct":
        payload, keep = serialize(named_tensors_payload(named)), named
    else:
        payload, keep = export_flattened_bucket(named)  # type: ignore[assignment]
    handle = {"payload_b64": payload, "load_format": load_format, "device_uuid": device_uuid(0),
              "layout": ChunkLayout.for_tensors(named).to_json()}
    return handle, keep


def _described(named: list[tuple[str, torch.Tensor]]) -> dict[str, object]:
    """What the worker script prints for tensors it got: per name, dtype, shape and the sha256 of the bytes."""
    return {"tensors": {name: [str(t.dtype), list(t.shape), hashlib.sha256(
        t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()]
        for name, t in named}}


def _worker_loads(handle: dict[str, Any], *, trusted: bool = True) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != _GATE}
    if trusted:
        env[_GATE] = "1"
    part = {"rank": 0, "transport": "cuda_ipc", "nbytes": 0, "handle": handle}
    proc = subprocess.run([sys.executable, "-c", _WORKER], input=json.dumps(part), capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result: dict[str, Any] = json.loads(proc.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("load_format", ["flattened_bucket", "direct"])
def test_the_worker_gets_the_trainers_tensors_byte_for_byte(load_format: str) -> None:
    named = _named()
    handle, keep = _handle(named, load_format)
    assert _worker_loads(handle) == _described(named)
    del keep


def test_a_chunk_exported_on_another_gpu_is_refused_naming_both() -> None:
    handle, keep = _handle(_named(), "flattened_bucket")
    refused = _worker_loads({**handle, "device_uuid": "GPU-elsewhere"})["refused"]
    assert "GPU-elsewhere" in refused and device_uuid(0) in refused
    del keep


def test_a_server_not_launched_to_trust_its_trainer_refuses_the_pickle() -> None:
    handle, keep = _handle(_named(), "flattened_bucket")
    assert _GATE in _worker_loads(handle, trusted=False)["refused"]
    del keep
