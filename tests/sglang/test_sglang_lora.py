"""LoRA adapter versions pushed through colocd into a live SGLang (0.5.23 / 0.5.20 on CPU): after each push the
engine serves exactly what it serves for the same files loaded by its own --lora-paths at launch, never the previous
version's; a retired version is unloaded, and SGLang's implicit re-load of an unloaded adapter from its cached path
fails because the folder is gone.

Stock SGLang dies at start-up with LoRA on a CPU torch (its LoRA code pins host memory); the test environment's
shim (scripts/sglang_cpu_shims/sitecustomize.py) makes pinning a no-op there. Without it the module is skipped
with SGLang's own words.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file
from sglang_live import READY_TIMEOUT_S, SERVER_ARGS, install
from support import daemon_node, write_peft_adapter

from colocd.api.client import ColocdHTTPError
from colocd.engines.config import LaunchConfig, SGLangEngineConfig
from colocd.engines.processes import Launched
from colocd.engines.sglang.launcher import launch_sglang
from colocd.trainer import push_adapter

pytestmark = pytest.mark.timeout(600)

PROMPT = [356, 381]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {v: write_peft_adapter(root / v, seed) for v, seed in (("v1", 1), ("v2", 2), ("v3", 3))}


@pytest.fixture(scope="module")
def lora_server(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    _, model = install()  # COLOCD_SGLANG_PYTHON, which launch_sglang runs SGLang under
    log = tmp_path_factory.mktemp("sglang-lora") / "server.log"
    config = SGLangEngineConfig(name="sg", model_path=model, launch=LaunchConfig(
        args=[*SERVER_ARGS, "--enable-lora", "--lora-backend", "torch_native", "--max-loras-per-batch", "4",
              "--max-lora-rank", "8", "--lora-target-modules", "q_proj", "v_proj",
              "--lora-paths", *(f"ref-{v}={p}" for v, p in adapters.items())],
        ready_timeout_s=READY_TIMEOUT_S, log_file=str(log)))

    try:
        server = asyncio.run(launch_sglang(config))
    except Exception:
        said = [line for line in log.read_text(errors="replace").splitlines() if "pin_memory" in line]
        if said:  # the engine's own words: LoRA cannot start on this CPU torch without the shim
            pytest.skip(f"SGLang cannot serve LoRA adapters on CPU here: {said[-1].strip()}")
        raise
    try:
        yield server
    finally:
        server.process.stop_sync(grace_s=15)


async def _tokens(url: str, adapter: str | None) -> list[int] | str:
    """Greedy tokens with ``adapter`` (None: the base model), or SGLang's error message."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        response = await http.post(f"{url}/generate", json={
            "input_ids": PROMPT, "lora_path": adapter,
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}})
    if response.status_code != 200:
        return response.text
    return list(response.json()["output_ids"])


async def _push(node: Any, folder: Path, base: str, version: str) -> dict[str, Any]:
    config = json.loads((folder / "adapter_config.json").read_text())
    named = load_file(str(folder / "adapter_model.safetensors")).items()
    return await push_adapter(node.client, named, config=config, base=base, version=version)


async def test_each_pushed_version_serves_what_sglang_loads_itself_from_the_same_files(
        lora_server: Launched, adapters: dict[str, Path]) -> None:
    url = lora_server.url
    base = await _tokens(url, None)
    async with daemon_node([{"kind": "sglang", "name": "sg", "url": url}]) as node:
        await _push(node, adapters["v1"], "same", "1")
        assert await _tokens(url, "same@1") == await _tokens(url, "ref-v1") != base
        await _push(node, adapters["v2"], "same", "2")
        served = await _tokens(url, "same@2")
        assert served == await _tokens(url, "ref-v2") and served != await _tokens(url, "ref-v1")


async def test_a_retired_version_is_unloaded_and_cannot_be_loaded_back_by_a_request(
        lora_server: Launched, adapters: dict[str, Path]) -> None:
    url = lora_server.url
    async with daemon_node([{"kind": "sglang", "name": "sg", "url": url}]) as node:
        for version in ("1", "2", "3"):
            await _push(node, adapters[f"v{version}"], "kept", version)
        with pytest.raises(ColocdHTTPError) as retired:
            await node.client.phase("rollout", 0, adapter="kept@1")
        assert retired.value.status == 410
        gone = await _tokens(url, "kept@1")  # SGLang tries its cached path, which the daemon deleted
        assert isinstance(gone, str) and "Failed to implicitly load LoRA adapter kept@1" in gone  # SGLang's words
        assert await _tokens(url, "kept@2") == await _tokens(url, "ref-v2")
