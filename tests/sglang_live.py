"""Helpers of the live SGLang tier (tests/sglang): launching SGLang on CPU, the module's server, greedy output,
step weights, and the recorder of what SGLang answered (the fixture tests/contract holds the reference engine to).

Its own module (not tests/sglang/conftest.py) so test modules can import it by name.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import sglang_replies as replies
import torch
from safetensors.torch import load_file, save_file

from colocd.engines.config import LaunchConfig, SGLangEngineConfig
from colocd.engines.processes import Launched
from colocd.engines.sglang import wire
from colocd.engines.sglang.launcher import launch_sglang
from colocd.engines.sglang.protocol import V0_5_23

Named = list[tuple[str, torch.Tensor]]

# SGLang's CPU engine (research/sglang-cpu.md, "Launch flags"): without the token cap the default memory
# fraction allocates a ~10 GB KV cache from host RAM.
SERVER_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--max-total-tokens", "32768", "--max-running-requests", "16"]
READY_TIMEOUT_S = 400  # 40-105 s measured on a loaded 2-core machine; CI may be slower still
PROMPT = "The quick brown fox"


# What differs between the tested releases, as the live tier checks it (docs/sglang.md "Tested against";
# research/engine-versions.md §B with file:line in each wheel): the protocol the adapter negotiates, and whether a
# flush succeeds while a retract pause holds requests in the waiting queue (0.5.20's flush_cache needs the queue
# empty, managers/scheduler.py:4983; 0.5.23's ignores it while paused, :5520).
PROTOCOL_OF = {"0.5.20": "pre-session", "0.5.23": "0.5.23"}
FLUSH_WHILE_RETRACTED = {"0.5.20": False, "0.5.23": True}


class ServerDied(Exception):
    """The module's SGLang server is not running; the message carries its log tail."""


def install() -> tuple[str, str]:
    python = os.environ.get("COLOCD_SGLANG_PYTHON", "")
    model = os.environ.get("COLOCD_SGLANG_MODEL", "")
    if not python:
        reason = os.environ.get("COLOCD_SGLANG_SKIP_REASON") or "COLOCD_SGLANG_PYTHON is unset"
        pytest.skip(f"SGLang is not installed: {reason} (scripts/install-sglang-cpu.sh sets it)")
    if not os.access(python, os.X_OK):
        pytest.skip(f"SGLang is not installed: COLOCD_SGLANG_PYTHON={python} is not an executable")
    if not model or not os.path.isfile(os.path.join(model, "config.json")):
        pytest.skip(f"the tiny SGLang test model is missing: COLOCD_SGLANG_MODEL={model!r} has no config.json")
    return python, model


def engine_config(model: str, log: Path, port: int | None = None) -> SGLangEngineConfig:
    return SGLangEngineConfig(
        name="sg", model_path=model, url=None if port is None else f"http://127.0.0.1:{port}",
        launch=LaunchConfig(args=list(SERVER_ARGS), ready_timeout_s=READY_TIMEOUT_S, log_file=str(log)))


async def launch(model: str, log: Path, port: int | None = None) -> Launched:
    install()  # COLOCD_SGLANG_PYTHON, which launch_sglang runs SGLang under
    return await launch_sglang(engine_config(model, log, port))


@dataclass
class LiveServer:
    """The module's server: its URL and process, or why it is not there."""

    server: Launched | None
    log: Path
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        self.check()
        assert self.server is not None
        return self.server.url

    def check(self) -> None:
        """Raise ServerDied (with the log tail) unless the server is up."""
        if self.error is not None:
            raise ServerDied(self.error)
        assert self.server is not None
        if not self.server.process.running:
            raise ServerDied(f"SGLang exited mid-module; log tail:\n{self.server.process.log_tail(6000)}")


async def greedy(client: httpx.AsyncClient, url: str, max_new_tokens: int = 12) -> list[int]:
    """Greedy token ids for a fixed prompt: the behavioural fingerprint of the served weights."""
    r = await client.post(f"{url}/generate", json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                            "ignore_eos": True}})
    r.raise_for_status()
    return list(r.json()["output_ids"])


def original_weights(model_dir: Path) -> Named:
    return sorted(load_file(str(model_dir / "model.safetensors")).items())


def step_weights(model_dir: Path, step: int) -> Named:
    """Deterministic weights a trainer step would produce, in HF names: clearly not the original's."""
    g = torch.Generator().manual_seed(1000 + step)
    out = []
    for name, t in original_weights(model_dir):
        f = t.float()
        out.append((name, (f + 0.05 * torch.randn(f.shape, generator=g)).to(t.dtype)))
    return out


def save_model(model_dir: Path, named: Named, out: Path) -> Path:
    """A model directory serving ``named``: the tiny model's config and tokenizer, these weights."""
    out.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(dict(named), str(out / "model.safetensors"))
    return out


# --- what the live SGLang answered, kept as the fixture the reference engine is held to (tests/contract) ----
# The live tier records each response it checks under a name (route, request, status, body). With
# COLOCD_SGLANG_RECORD=1 a module writes them to FIXTURE when it ends; otherwise each recorded status must equal
# the fixture's, so a fixture that no longer says what SGLang answers fails here.

FIXTURE = Path(__file__).parent / "contract" / "fixtures" / "sglang_live_0_5_23.json"
# server_info is ~200 server arguments; the fixture keeps these (wire.ServerInfo's fields among them).
SERVER_INFO_KEYS = ("version", "model_path", "tp_size", "dp_size", "device", "enable_memory_saver",
                    "enable_weights_cpu_backup", "weight_cache_mode", "weight_version", "startup_time")


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


class Recorder:
    def __init__(self) -> None:
        self.entries: dict[str, dict[str, Any]] = {}
        self.recording = os.environ.get("COLOCD_SGLANG_RECORD") == "1"
        self.fixture: dict[str, Any] = json.loads(FIXTURE.read_text()) if FIXTURE.exists() else {}
        # The fixture is what SGLang 0.5.23 answered (the reference engine is held to it); another release's answers
        # (0.5.20: no session routes, docs/sglang.md) are neither compared with it nor recorded into it.
        serving = os.environ.get("COLOCD_SGLANG_VERSION") or self.fixture.get("sglang_version")
        if serving != self.fixture.get("sglang_version"):
            self.fixture, self.recording = {}, False

    def record(self, name: str, response: httpx.Response, request: Any = None) -> httpx.Response:
        body = _body(response)
        if name == "server_info" and isinstance(body, dict):
            body = {k: body[k] for k in SERVER_INFO_KEYS if k in body}
            body["internal_states"] = "(one scheduler-state object per DP rank; no paused/session keys)"
        self.entries[name] = {"method": response.request.method, "route": response.request.url.path,
                              "request": request, "status": response.status_code,
                              "content_type": response.headers.get("content-type", "").split(";")[0],
                              "body": body}
        known = self.fixture.get("responses", {}).get(name)
        if not self.recording and known is not None:
            assert response.status_code == known["status"], (
                f"{name}: SGLang answered {response.status_code}, the fixture says {known['status']}: "
                f"re-record with COLOCD_SGLANG_RECORD=1 ({FIXTURE.name})")
        return response

    def write(self, version: str) -> None:
        if not self.recording or not self.entries:
            return
        merged = {**self.fixture.get("responses", {}), **self.entries}
        FIXTURE.write_text(json.dumps({
            "sglang_version": version,
            "recorded_by": "tests/sglang (COLOCD_SGLANG_RECORD=1), SGLang on CPU (scripts/install-sglang-cpu.sh)",
            "responses": dict(sorted(merged.items()))}, indent=1, sort_keys=False) + "\n")




def greedy_sync(url: str, max_new_tokens: int = 12) -> list[int]:
    """``greedy`` for synchronous tests (those that drive the README's synchronous TrainerClient)."""
    r = httpx.post(f"{url}/generate", timeout=120, trust_env=False, json={
        "text": PROMPT, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}})
    r.raise_for_status()
    return list(r.json()["output_ids"])


def parameter_checksums(result: replies.CheckWeightsResult) -> dict[str, str]:
    """``{"tp<rank>/<parameter>": checksum}`` over every rank of a ``/weights_checker`` checksum reply (empty if it
    has none). SGLang's reply (0.5.23 http_server.py:1599-1619) holds, per TP rank, one checksum per (fused)
    parameter, e.g. ``model.layers.0.self_attn.qkv_proj.weight``: two servers serve the same weights exactly
    when every per-parameter checksum agrees."""
    return {f"tp{i}/{name}": value for i, rank in enumerate(result.ranks or ())
            for name, value in rank.checksums.items()}


def differing(expected: Mapping[str, str], actual: Mapping[str, str]) -> list[str]:
    """The parameters whose checksum differs or that only one side has, sorted; empty when they agree."""
    return sorted(k for k in expected.keys() | actual.keys() if expected.get(k) != actual.get(k))


def checksums_sync(url: str) -> dict[str, str]:
    """Every per-parameter ``/weights_checker`` checksum of the server."""
    r = httpx.post(f"{url}/weights_checker", json={"action": "checksum"}, timeout=120, trust_env=False)
    r.raise_for_status()
    return parameter_checksums(replies.CheckWeightsResult.model_validate(r.json()))


async def checksums(client: httpx.AsyncClient, url: str) -> dict[str, str]:
    """``checksums_sync`` for async tests."""
    r = await client.post(f"{url}/weights_checker", json={"action": "checksum"})
    r.raise_for_status()
    return parameter_checksums(replies.CheckWeightsResult.model_validate(r.json()))


async def load_from_disk(client: httpx.AsyncClient, url: str, model_path: str, *,
                         weight_version: str | None = None) -> bool:
    """SGLang loads ``model_path`` itself (``/update_weights_from_disk``, no session needed): whether it did. A
    failed load leaves the old weights served."""
    request = replies.UpdateWeightFromDiskReqInput(model_path=model_path, weight_version=weight_version)
    r = await client.post(f"{url}{request.ROUTE}", json=wire.body(request, V0_5_23))
    return r.status_code == 200 and r.json().get("success") is True
