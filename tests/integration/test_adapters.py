"""LoRA adapter versions through the daemon (daemon/adapters.py): each push an immutable name every engine loads
from a folder of its own, the policy's ``keep`` stay loaded, older ones are unloaded with their folders and refused
by name, a push over a cap or onto an engine without adapters is refused, and a failed or cut-off push leaves the
previous version serving and nothing on disk."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load
from support import DEADLINE_S, InMemoryEngine, daemon_node

from colocd.api.client import ColocdHTTPError
from colocd.engines.base import EngineInfo
from colocd.errors import EngineRejected
from colocd.trainer import push_adapter
from colocd.trainer.push import adapter_body

CONFIG = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": {"v_proj", "q_proj"}}


def _named(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    return [(f"{prefix}.lora_A.weight", torch.randn(2, 8, generator=g)),
            (f"{prefix}.lora_B.weight", torch.randn(8, 2, generator=g))]


class AdapterEngine(InMemoryEngine):
    """Loads adapters by reading the folder the daemon wrote, as vLLM does; ``fail_load`` refuses the next load."""

    def __init__(self, name: str, *, cap: int | None = None) -> None:
        super().__init__(name)
        self.cap = cap
        self.held: dict[str, tuple[dict[str, Any], bytes]] = {}  # name → (config, safetensors bytes)
        self.calls: list[str] = []
        self.fail_load = False
        self.fail_unload = False
        self.hang_load = False

    def restart(self) -> None:
        """What a new process of the engine is: another incarnation, holding no adapters."""
        self.incarnation = f"{self.incarnation}+"
        self.held.clear()

    async def attach(self) -> EngineInfo:
        return EngineInfo(self.name, "fake", "0", "fake", self.version, max_adapters=self.cap)

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.calls.append(f"load {name}")
        if self.hang_load:
            await asyncio.Event().wait()  # an engine that never answers
        if self.fail_load:
            raise EngineRejected(self.name, "load_lora_adapter: HTTP 400: out of adapter slots", status=400)
        folder = Path(path)
        self.held[name] = (json.loads((folder / "adapter_config.json").read_text()),
                           (folder / "adapter_model.safetensors").read_bytes())

    async def unload_lora_adapter(self, name: str) -> None:
        self.calls.append(f"unload {name}")
        if self.fail_unload:
            raise EngineRejected(self.name, "unload_lora_adapter: HTTP 500", status=500)
        self.held.pop(name)


# LoRA training keeps the base weights resident: an adapter push needs no base-weight release, and the rollout
# after it needs no base-weight push.
ADAPTER_POLICY = b"apiVersion: colocd/v1\nengines: {release_tags: [kv_cache, cuda_graph]}\n"


async def _synced(node: Any) -> None:
    await node.daemon.stage_policies(ADAPTER_POLICY, "test")
    await node.client.phase("train", 1)
    await node.client.phase("sync", 1)


def _folders(node: Any) -> list[str]:
    root = node.daemon.adapters.root
    return sorted(p.name.rsplit(".", 1)[0] for p in root.iterdir()) if root is not None else []


async def test_a_push_is_loaded_by_every_engine_under_its_immutable_name_and_named_in_replies() -> None:
    e0, e1 = AdapterEngine("e0"), AdapterEngine("e1")
    async with daemon_node(adapters={"e0": e0, "e1": e1}) as node:
        await _synced(node)
        reply = await push_adapter(node.client, _named(1), config=CONFIG, base="policy", version="1")
        assert reply["adapter"] == "policy@1" and set(reply["load_s"]) == {"e0", "e1"}
        for engine in (e0, e1):
            config, weights = engine.held["policy@1"]
            assert config == {**CONFIG, "target_modules": ["q_proj", "v_proj"]}
            held, pushed = load(weights), dict(_named(1))  # the trainer's tensors under PEFT's names
            assert held.keys() == pushed.keys() and all(torch.equal(held[n], t) for n, t in pushed.items())
        assert (await node.client.status())["adapters"]["current"] == "policy@1"
        assert (await node.client.phase("rollout", 1))["adapter"] == "policy@1"


async def test_the_version_before_the_kept_ones_is_unloaded_its_folder_deleted_and_its_name_refused() -> None:
    engine = AdapterEngine("e0")
    async with daemon_node(adapters={"e0": engine}) as node:
        await _synced(node)
        for version in ("1", "2", "3"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        assert set(engine.held) == {"p@2", "p@3"} and _folders(node) == ["p@2", "p@3"]
        with pytest.raises(ColocdHTTPError) as retired:
            await node.client.phase("rollout", 1, adapter="p@1")
        assert retired.value.status == 410 and retired.value.body["current"] == "p@3"
        assert "retired" in retired.value.body["message"]
        assert (await node.client.status())["node"]["phase"] == "sync"  # nothing moved
        assert (await node.client.phase("rollout", 1, adapter="p@2"))["adapter"] == "p@3"  # the previous still serves


async def test_a_name_pushed_before_is_refused_and_nothing_changes() -> None:
    engine = AdapterEngine("e0")
    async with daemon_node(adapters={"e0": engine}) as node:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        with pytest.raises(ColocdHTTPError) as reused:
            await push_adapter(node.client, _named(2), config=CONFIG, base="p", version="1")
        assert reused.value.status == 409 and "never reused" in reused.value.body["message"]
        assert engine.calls == ["load p@1"] and _folders(node) == ["p@1"]


async def test_a_push_that_would_pass_an_engines_cap_is_refused_naming_the_cap() -> None:
    engine = AdapterEngine("e0", cap=1)
    async with daemon_node(adapters={"e0": engine}) as node:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        with pytest.raises(ColocdHTTPError) as over:
            await push_adapter(node.client, _named(2), config=CONFIG, base="p", version="2")
        assert over.value.status == 409 and over.value.body["state"]["cap"] == 1
        assert "engine 'e0'" in over.value.body["message"] and "adapters.keep" in over.value.body["message"]
        assert set(engine.held) == {"p@1"} and _folders(node) == ["p@1"]


async def test_keep_one_under_a_cap_of_one_unloads_the_old_version_before_loading_the_new() -> None:
    engine = AdapterEngine("e0", cap=1)
    async with daemon_node(adapters={"e0": engine}) as node:
        await node.daemon.stage_policies(b"apiVersion: colocd/v1\nadapters: {keep: 1}\n", "test")
        await node.client.phase("train", 1)  # a staged policy applies at the next transition
        for version in ("1", "2"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        assert engine.calls == ["load p@1", "unload p@1", "load p@2"] and _folders(node) == ["p@2"]


async def test_a_push_one_engine_fails_is_unloaded_from_the_others_and_the_previous_version_serves() -> None:
    e0, e1 = AdapterEngine("e0"), AdapterEngine("e1")
    async with daemon_node(adapters={"e0": e0, "e1": e1}) as node:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        e1.fail_load = True
        with pytest.raises(ColocdHTTPError) as failed:
            await push_adapter(node.client, _named(2), config=CONFIG, base="p", version="2")
        assert failed.value.status == 502 and failed.value.body["engine"] == "e1"
        assert set(e0.held) == set(e1.held) == {"p@1"} and _folders(node) == ["p@1"]
        assert (await node.client.status())["adapters"]["current"] == "p@1"


async def test_an_engine_that_never_answers_a_load_fails_the_push_within_its_budget_and_the_previous_serves() -> None:
    e0, e1 = AdapterEngine("e0"), AdapterEngine("e1")
    async with daemon_node(adapters={"e0": e0, "e1": e1}) as node:
        await node.daemon.stage_policies(b"apiVersion: colocd/v1\ntimeouts: {weight_update_s: 0.2}\n", "test")
        await node.client.phase("train", 1)  # a staged policy applies at the next transition
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        e1.hang_load = True
        with pytest.raises(ColocdHTTPError) as late:
            await push_adapter(node.client, _named(2), config=CONFIG, base="p", version="2")
        assert late.value.status == 504 and late.value.body["engine"] == "e1"
        assert "weight_update_s" in late.value.body["message"]
        assert set(e0.held) == {"p@1"} and _folders(node) == ["p@1"]
        assert (await node.client.status())["adapters"]["current"] == "p@1"


async def test_the_reference_engine_is_refused_as_an_sglang_without_lora_and_nothing_is_left(
        pooled_engine: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}) as node:
        with pytest.raises(ColocdHTTPError) as refused:
            await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        assert refused.value.status == 409 and refused.value.body["error"] == "AdapterUnsupported"
        assert refused.value.body["state"] == {"engine": "ref0"} and "--enable-lora" in refused.value.body["message"]
        assert _folders(node) == [] and (await node.client.status())["adapters"]["current"] is None


async def test_a_body_that_is_not_an_adapter_is_refused_and_nothing_is_left() -> None:
    async with daemon_node(adapters={"e0": AdapterEngine("e0")}) as node, node.http() as http:
        body = adapter_body(_named(1), CONFIG)
        for bad in (b"not safetensors", body[:-3]):
            response = await http.put("/v1/adapters/p/1", content=bad)
            assert response.status_code == 422 and response.json()["field"] == "body"
        assert _folders(node) == []


async def test_a_trainer_gone_mid_body_leaves_nothing_and_the_previous_version_serves() -> None:
    async with daemon_node(adapters={"e0": AdapterEngine("e0")}) as node:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        body = adapter_body(_named(2), CONFIG)
        host, port = node.url.removeprefix("http://").split(":")
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"PUT /v1/adapters/p/2 HTTP/1.1\r\nhost: x\r\ncontent-length: {len(body)}\r\n\r\n".encode()
                     + body[:100])
        await writer.drain()
        deadline = time.monotonic() + DEADLINE_S
        while len(list(node.daemon.adapters.root.iterdir())) < 2:  # the partial folder exists: the body is arriving
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        writer.close()
        while _folders(node) != ["p@1"]:
            assert time.monotonic() < deadline, _folders(node)
            await asyncio.sleep(0.01)
        assert (await node.client.status())["adapters"]["loaded"] == ["p@1"]


async def test_a_version_an_engine_failed_to_unload_keeps_its_folder_until_a_later_push_unloads_it() -> None:
    engine = AdapterEngine("e0")
    async with daemon_node(adapters={"e0": engine}) as node:
        for version in ("1", "2"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        engine.fail_unload = True
        await push_adapter(node.client, _named(3), config=CONFIG, base="p", version="3")
        assert _folders(node) == ["p@1", "p@2", "p@3"]  # the engine still holds p@1: it may re-read its folder
        assert (await node.client.status())["adapters"]["loaded"] == ["p@2", "p@3"]
        engine.fail_unload = False
        await push_adapter(node.client, _named(4), config=CONFIG, base="p", version="4")
        assert set(engine.held) == {"p@3", "p@4"} and _folders(node) == ["p@3", "p@4"]


async def test_a_relaunched_engine_loads_the_kept_versions_again_from_their_folders() -> None:
    engine = AdapterEngine("e0")
    async with daemon_node(adapters={"e0": engine}) as node:
        for version in ("1", "2", "3"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        engine.restart()
        await node.daemon._reconcile_relaunched("e0")  # what the supervisor calls once the engine is back
        assert list(engine.held) == ["p@2", "p@3"] and _folders(node) == ["p@2", "p@3"]


async def test_an_engine_restarted_behind_the_daemons_back_loads_the_kept_versions_at_the_next_reconcile() -> None:
    engine = AdapterEngine("e0")
    async with daemon_node(adapters={"e0": engine}, timeouts={"health_interval_s": 0.05}) as node:
        for version in ("1", "2", "3"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        engine.restart()  # nobody tells the daemon: its health loop sees the new incarnation
        deadline = time.monotonic() + DEADLINE_S
        while list(engine.held) != ["p@2", "p@3"]:
            assert time.monotonic() < deadline, engine.calls
            await asyncio.sleep(0.01)  # polling the engine, bounded by the deadline
        assert engine.calls[-2:] == ["load p@2", "load p@3"]
        assert (await node.client.status())["adapters"]["current"] == "p@3"


# --- a daemon SIGKILLed and started again on its journal -------------------------------------------------------

async def _never() -> None:
    """In place of the adapters' shutdown: a SIGKILLed daemon unloads nothing and deletes nothing."""


async def test_a_daemon_killed_after_a_push_names_the_same_adapter_refuses_retired_ones_and_strands_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, journal = AdapterEngine("e0"), str(tmp_path / "journal.jsonl")
    async with daemon_node(adapters={"e0": engine}, journal=journal) as node:
        for version in ("1", "2", "3"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        monkeypatch.setattr(node.daemon.adapters, "aclose", _never)
    async with daemon_node(adapters={"e0": engine}, journal=journal) as node, node.http() as http:
        assert (await node.client.status())["adapters"]["loaded"] == ["p@2", "p@3"]
        assert (await http.get("/v1/adapters/p@3")).json() == {"name": "p@3", "current": True, "loaded": True}
        retired = await http.get("/v1/adapters/p@1")
        assert retired.status_code == 410 and retired.json()["current"] == "p@3"
        assert set(engine.held) == {"p@2", "p@3"} and _folders(node) == ["p@2", "p@3"]  # the engine kept them
        root = node.daemon.adapters.root
    assert engine.held == {} and not root.exists()  # its clean stop unloads the versions the killed one pushed


async def test_a_restarted_daemon_deletes_the_folders_the_killed_one_left_of_versions_it_no_longer_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, journal = AdapterEngine("e0"), str(tmp_path / "journal.jsonl")
    async with daemon_node(adapters={"e0": engine}, journal=journal) as node:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        monkeypatch.setattr(node.daemon.adapters, "aclose", _never)
        staging = node.daemon.adapters.root / "p@2.0123abcd"  # a body that was arriving when the daemon died
        staging.mkdir()
    assert staging.exists()
    async with daemon_node(adapters={"e0": engine}, journal=journal) as node:
        assert _folders(node) == ["p@1"] and not staging.exists()


async def test_an_engine_restarted_while_the_daemon_was_down_loads_the_kept_versions_before_the_daemon_is_ready(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    engine, journal = AdapterEngine("e0"), str(tmp_path / "journal.jsonl")
    async with daemon_node(adapters={"e0": engine}, journal=journal) as node:
        await _synced(node)  # the journal records the engine's incarnation
        for version in ("1", "2"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        monkeypatch.setattr(node.daemon.adapters, "aclose", _never)
    engine.restart()
    async with daemon_node(adapters={"e0": engine}, journal=journal):
        assert list(engine.held) == ["p@1", "p@2"]


async def test_the_metrics_name_the_current_adapter_and_count_loads_and_unloads() -> None:
    async with daemon_node(adapters={"e0": AdapterEngine("e0")}) as node:
        for version in ("1", "2", "3"):
            await push_adapter(node.client, _named(int(version)), config=CONFIG, base="p", version=version)
        text = await node.client.metrics()
        assert 'colocd_adapter_info{name="p@3"} 1.0' in text and 'colocd_adapter_info{name="p@2"}' not in text
        assert 'colocd_adapter_load_seconds_count{engine="e0"} 3.0' in text
        assert 'colocd_adapter_unloads_total{engine="e0"} 1.0' in text
        assert 'colocd_adapter_pushes_total{outcome="committed"} 3.0' in text


async def test_closing_the_daemon_unloads_every_version_and_deletes_the_folders() -> None:
    engine = AdapterEngine("e0")
    async with daemon_node(adapters={"e0": engine}) as node:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        root = node.daemon.adapters.root
    assert engine.held == {} and not root.exists()


async def test_an_unknown_adapter_name_is_a_404_and_a_loaded_one_is_described() -> None:
    async with daemon_node(adapters={"e0": AdapterEngine("e0")}) as node, node.http() as http:
        await push_adapter(node.client, _named(1), config=CONFIG, base="p", version="1")
        assert (await http.get("/v1/adapters/p@1")).json() == {"name": "p@1", "current": True, "loaded": True}
        assert (await http.get("/v1/adapters/p@9")).status_code == 404


