"""The daemon against a real reference engine process, over real HTTP on loopback.

Each test reads as one behaviour of the node: a full step, the state rules, validation,
idempotency and engine failures.
"""

from __future__ import annotations

import re
import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from support import (
    EnginePool,
    daemon_node,
    leaves_no_shm_segments,
    reference_engine,
    served_checksums,
    shm_segments,
    weights_checksum,
)

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.push import WeightPusher


@pytest.fixture
def engine(engine_pool: EnginePool) -> Iterator[ReferenceEngineProcess]:
    proc = engine_pool.borrow()
    yield proc
    engine_pool.give_back(proc)


@pytest.fixture
async def daemon(engine: ReferenceEngineProcess) -> AsyncIterator[AsyncColocdClient]:
    async with daemon_node({"ref0": str(engine.url)}) as node:
        yield node.client


async def _greedy(engine_url: str, n: int = 8) -> list[int]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        r = await http.post(f"{engine_url}/generate", json={
            "input_ids": [1], "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return list(r.json()["output_ids"])


def _local_greedy(model: torch.nn.Module, n: int = 8) -> list[int]:
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, 1:].tolist()


async def _full_step(client: AsyncColocdClient, step: int, model: torch.nn.Module, **push: Any) -> dict[str, Any]:
    await client.phase("train", step)
    await client.phase("sync", step)
    report = await WeightPusher(client, **push).push(model.named_parameters(), version=f"v{step}", step=step)
    await client.phase("rollout", step)
    return {"push": report}


async def test_full_step_makes_engine_serve_the_trainers_new_weights(
        daemon: AsyncColocdClient, engine: ReferenceEngineProcess) -> None:
    trained = build_model(QwenLikeConfig(), seed=123)  # different weights than the engine's seed 0
    before = await _greedy(engine.url)
    await _full_step(daemon, 1, trained, bucket_mb=0.05)

    assert await served_checksums(engine.url) == [weights_checksum(trained.named_parameters())]
    after = await _greedy(engine.url)
    assert after == _local_greedy(trained)
    assert after != before
    status = await daemon.status()
    assert status["node"] == {"phase": "rollout", "step": 1}
    assert status["engines"]["ref0"]["weight_version"] == "v1"
    assert status["engines"]["ref0"]["generation"] == "serving"


async def test_every_sync_over_several_steps_leaves_identical_weights(
        daemon: AsyncColocdClient, engine: ReferenceEngineProcess) -> None:
    model = build_model(QwenLikeConfig(), seed=0)
    for step in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * step)
        await _full_step(daemon, step, model, bucket_mb=0.02, depth=3)
        assert await served_checksums(engine.url) == [weights_checksum(model.named_parameters())], step


async def test_train_releases_memory_and_reports_freed_bytes(daemon: AsyncColocdClient) -> None:
    reply = await daemon.phase("train", 1)
    freed = reply["freed_bytes"]["ref0"]
    assert freed["engine"] > 0
    tags = reply["engines"]["ref0"]["tags"]
    assert set(tags.values()) == {"released"}
    assert [s["name"] for s in reply["trace"]["spans"]][:3] == ["pause_generation", "flush_cache", "release_memory"]


async def test_illegal_transition_is_409_naming_the_state_and_changes_nothing(
        daemon: AsyncColocdClient, engine: ReferenceEngineProcess) -> None:
    before = await daemon.status()
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.phase("sync", 1)
    assert err.value.status == 409
    assert "'rollout'" in err.value.body["message"] and "step 0" in err.value.body["message"]
    after = await daemon.status()
    assert after["node"] == before["node"] and after["engines"] == before["engines"]
    assert len(await _greedy(engine.url, 2)) == 2  # still serving


async def test_rollout_without_a_weight_update_is_rejected_and_engine_stays_paused(
        daemon: AsyncColocdClient) -> None:
    await daemon.phase("train", 1)
    await daemon.phase("sync", 1)
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.phase("rollout", 1)
    assert err.value.status == 409
    assert "stale" in err.value.body["message"]
    engine = (await daemon.status())["engines"]["ref0"]
    assert engine["generation"] == "paused"
    assert engine["tags"]["kv_cache"] == "released"


async def test_train_step_must_advance(daemon: AsyncColocdClient) -> None:
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.phase("train", 0)
    assert err.value.status == 409
    assert "greater than the current step 0" in err.value.body["message"]


async def test_repeated_step_phase_is_a_replayed_no_op(daemon: AsyncColocdClient) -> None:
    first = await daemon.phase("train", 1)
    again = await daemon.phase("train", 1)
    assert first["replayed"] is False and again["replayed"] is True
    assert again["engines"] == first["engines"]
    # Had the daemon released again, the engine would have refused the double release (400 → 502).
    assert (await daemon.status())["node"] == {"phase": "train", "step": 1}


@pytest.mark.parametrize(("body", "field"), [
    ({"phase": "train"}, "step"),
    ({"phase": "dance", "step": 1}, "phase"),
    ({"phase": "train", "step": -1}, "step"),
    ({"phase": "train", "step": "one"}, "step"),
    ({"phase": "train", "step": 1, "extra": True}, "extra"),
])
async def test_malformed_phase_bodies_are_422_naming_the_field(
        daemon: AsyncColocdClient, body: dict[str, Any], field: str) -> None:
    with pytest.raises(ColocdHTTPError) as err:
        await daemon._call("POST", "/v1/phase", body)
    assert err.value.status == 422
    assert any(f["field"] == field for f in err.value.body["fields"]), err.value.body
    assert (await daemon.status())["node"] == {"phase": "rollout", "step": 0}


async def test_malformed_sleep_tags_and_chunks_are_422(daemon: AsyncColocdClient) -> None:
    with pytest.raises(ColocdHTTPError) as err:
        await daemon._call("POST", "/v1/sleep", {"tags": ["vram"]})
    assert err.value.status == 422 and "tags.0" in err.value.body["message"]
    with pytest.raises(ColocdHTTPError) as err:
        await daemon._call("POST", "/v1/weights/sessions/x/chunks",
                              {"seq": -1, "transport": "shm", "nbytes": 1, "handle": {}})
    assert err.value.status == 422 and "seq" in err.value.body["message"]


async def test_double_sleep_is_409_and_names_the_released_tag(daemon: AsyncColocdClient) -> None:
    await daemon.sleep(["kv_cache"])
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.sleep(["kv_cache"])
    assert err.value.status == 409 and "kv_cache" in err.value.body["message"]
    resumed = await daemon.resume(["kv_cache"])
    assert resumed["engines"]["ref0"]["generation"] == "serving"


async def test_resume_of_a_resident_tag_is_409(daemon: AsyncColocdClient) -> None:
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.resume(["weights"])
    assert err.value.status == 409 and "already resident" in err.value.body["message"]


async def test_aborted_update_keeps_old_version_paused_and_leaks_no_shared_memory(
        daemon: AsyncColocdClient, engine: ReferenceEngineProcess) -> None:
    await daemon.phase("train", 1)
    await daemon.phase("sync", 1)
    session = await daemon.open_session("v1", step=1, ranks=1)
    model = build_model(QwenLikeConfig(), seed=5)
    with leaves_no_shm_segments():
        pusher = WeightPusher(daemon, bucket_mb=0.01)
        await pusher.stream(session["session_id"], list(model.named_parameters())[:3])
        await daemon.abort(session["session_id"])

    status = (await daemon.status())["engines"]["ref0"]
    assert status["weight_version"] == "default"
    assert status["weights"] == "stale" and status["generation"] == "paused"
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.phase("rollout", 1)
    assert err.value.status == 409


async def test_unreachable_engine_gets_503_naming_it_and_daemon_keeps_serving() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead_port = s.getsockname()[1]  # closed on exit: nothing listens there
    async with daemon_node({"ghost": f"http://127.0.0.1:{dead_port}"}, ready=False) as node:
        client, url = node.client, node.url
        with pytest.raises(ColocdHTTPError) as err:
            await client.phase("train", 1)
        assert err.value.status == 503
        assert "ghost" in err.value.body["message"]
        assert (await client.status())["engines"]["ghost"]["healthy"] is False
        assert not await client.ready()
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(url + "/healthz")).status_code == 200


async def test_engine_dying_mid_step_is_a_clear_error_and_the_daemon_keeps_serving(
        daemon: AsyncColocdClient, engine: ReferenceEngineProcess) -> None:
    await engine.aclose()
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.phase("train", 1)
    assert err.value.status in (502, 503) and "ref0" in err.value.body["message"]
    assert (await daemon.status())["node"] == {"phase": "rollout", "step": 0}


async def test_metrics_expose_phase_durations_and_weight_bytes(daemon: AsyncColocdClient) -> None:
    await _full_step(daemon, 1, build_model(QwenLikeConfig(), seed=1), bucket_mb=1)
    text = await daemon.metrics()
    assert 'colocd_phase_duration_seconds_count{engine="ref0",phase="train"} 1.0' in text
    nbytes = sum(p.numel() * p.element_size() for p in build_model(QwenLikeConfig(), seed=1).parameters())
    delivered = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("colocd_weight_bytes_total{")]
    assert sum(delivered) >= nbytes
    assert 'colocd_transitions_total{outcome="ok",phase="rollout"} 1.0' in text


METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"
# What docs/metrics.md says appears later than the first scrape: engine calls at their first call, per-rank
# families when the rank first reports.
AT_FIRST_CALL = "colocd_substep_duration_seconds"
STARTED = "colocd_engine_launches_total"  # the start-up's own launch: 1 (docs/metrics.md)


def _documented_event_series() -> dict[str, dict[str, list[str]]]:
    """Every counter and histogram docs/metrics.md's tables list: its labels, each with the values the doc
    names for it (``outcome`` (`ok`, `rejected`) gives ok and rejected; a pattern such as `gpu:N` is left out)."""
    text = METRICS_DOC.read_text()
    assert f"`{AT_FIRST_CALL}`, appear at their first call" in text
    assert "per-rank families (label `rank`) appear when the rank first reports" in text
    found: dict[str, dict[str, list[str]]] = {}
    for name, labels in re.findall(r"^\| `(colocd_\w+)` \| (?:counter|histogram) \| ([^|]*) \|", text, re.M):
        found[name] = {label: re.findall(r"`([\w.]+)`", values)
                       for label, values in re.findall(r"`(\w+)`(?:\s*\(([^)]*)\))?", labels)}
    return found


async def test_a_fresh_daemon_exports_every_documented_event_series_at_zero() -> None:
    from prometheus_client.parser import text_string_to_metric_families

    documented = _documented_event_series()
    assert {"colocd_weight_chunks_total", "colocd_memory_confirm_seconds"} <= set(documented)
    engine = {"kind": "reference", "name": "ref0", "device": "cpu", "seed": 0, "launch": {"ready_timeout_s": 120}}
    async with daemon_node([engine]) as node:
        scraped = {f.name: f for f in text_string_to_metric_families(await node.client.metrics())}
    for name, labels in documented.items():
        if name == AT_FIRST_CALL or "rank" in labels:
            continue
        family = scraped.get(name.removesuffix("_total"))
        assert family is not None and family.samples, f"{name} is not exported before its first event"
        counts = [s for s in family.samples if not s.name.endswith("_created")]
        assert all(s.value == (1 if name == STARTED else 0) for s in counts), f"{name} is not at 0: {counts}"
        for label, values in labels.items():
            exported = {s.labels.get(label) for s in counts}
            wanted = {*values, *(["ref0"] if label == "engine" else [])}
            assert wanted <= exported, f"{name}: {label} lacks {sorted(wanted - exported)} (has {sorted(exported)})"


async def test_trace_is_served_as_json_and_chrome_events(daemon: AsyncColocdClient) -> None:
    await daemon.phase("train", 1)
    trace = await daemon.trace(1)
    assert trace["train"]["spans"]
    chrome = await daemon.trace(1, "chrome")
    # Spans are complete events; memory readings (the engine's own accounting here) are counter tracks.
    assert {e["ph"] for e in chrome["traceEvents"]} == {"X", "C"}
    assert all(e["name"].startswith("memory ") for e in chrome["traceEvents"] if e["ph"] == "C")


async def test_mutating_routes_need_the_token_when_one_is_configured(engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(engine.url)}, ready=False, token="s3cret") as node:
        async with AsyncColocdClient(node.url) as anonymous:
            with pytest.raises(ColocdHTTPError) as err:
                await anonymous.phase("train", 1)
            assert err.value.status == 401
            assert (await anonymous.status())["node"]["step"] == 0
        async with AsyncColocdClient(node.url, token="s3cret") as trainer:
            assert (await trainer.phase("train", 1))["phase"] == "train"


async def test_openapi_document_lists_the_phase_route(daemon: AsyncColocdClient) -> None:
    spec = await daemon._call("GET", "/openapi.json")
    assert "/v1/phase" in spec["paths"] and "/v1/weights/sessions/{session_id}/chunks" in spec["paths"]


def test_no_shared_memory_segments_left_behind() -> None:
    # Every segment this test process created (the trainer side of all tests above) was unlinked.
    assert not shm_segments()


async def test_full_step_through_the_legacy_sglang_protocol() -> None:
    """SGLang ≤ 0.5.5 (what slime/verl pin): no bodies on pause, no update session, /get_weight_version.

    Its pause route reads no body and always aborts, so a node driving it says ``pause_mode: abort``
    (the default, retract, is refused by that protocol with a 502 naming the key)."""
    async with reference_engine("old", protocol="legacy") as engine, \
            daemon_node({"old": str(engine.url)}, pause_mode="abort") as node:
        client = node.client
        status = (await client.status())["engines"]["old"]
        assert (status["protocol"], status["engine_version"]) == ("legacy", "0.5.4")
        trained = build_model(QwenLikeConfig(), seed=7)
        await _full_step(client, 1, trained, bucket_mb=0.1)
        assert await _greedy(engine.url) == _local_greedy(trained)
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{engine.url}/get_weight_version")).json()["weight_version"] == "v1"


async def test_a_restarted_daemon_resumes_from_its_journal(engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    engines = {"ref0": str(engine.url)}
    journal = str(tmp_path / "journal.jsonl")
    async with daemon_node(engines, journal=journal) as node:
        await node.client.phase("train", 1)
    # A new daemon process on the same node: it must not release the engine's memory twice.
    async with daemon_node(engines, journal=journal) as node:
        client = node.client
        status = await client.status()
        assert status["node"] == {"phase": "train", "step": 1}
        assert status["engines"]["ref0"]["tags"]["kv_cache"] == "released"
        await client.phase("sync", 1)
        await WeightPusher(client).push(build_model(QwenLikeConfig(), seed=2).named_parameters(), version="v1")
        assert (await client.phase("rollout", 1))["engines"]["ref0"]["generation"] == "serving"
