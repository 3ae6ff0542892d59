"""A stranger's requests (issue 10): every caller mistake is a 4xx in the one error shape, answered before any
engine is touched, and leaves the node as it was; nothing is a 500; input is bounded before it is read.

One reference engine process serves the module; each test starts its own daemon in-process on an
OS-chosen loopback port (cheap), so a test's config (token, limits, plugins) is its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from support import daemon_node, engine_tags, reference_engine

from colocd.daemon.config import load_node_config
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.errors import ConfigError
from colocd.policies.document import policy_json_schema

pytestmark = pytest.mark.asyncio(loop_scope="module")

TOKEN = "s3cret"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# 238 bytes, five levels of nine: 9**5 strings once expanded (the alias bomb).
ALIAS_BOMB = (b'a: &a ["x","x","x","x","x","x","x","x","x"]\n'
              b"b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n"
              b"c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
              b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n"
              b"e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\n"
              b"f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[ReferenceEngineProcess]:
    async with reference_engine() as proc:
        yield proc


@pytest_asyncio.fixture(loop_scope="module")
async def client(engine: ReferenceEngineProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False) as node, node.http() as c:
        yield c


async def _engine_memory(engine: ReferenceEngineProcess) -> dict[str, Any]:
    """Which tags the engine holds and their bytes (not the process RSS, which moves on its own)."""
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        r = await http.get(f"{engine.url}/server_info")
        r.raise_for_status()
        return dict(engine_tags(r.json()))


def _is_error(response: httpx.Response, status: int, *, field: str | None = None) -> dict[str, Any]:
    """The one error shape, with a non-empty message; ``field`` when the caller's field is named."""
    assert response.status_code == status, response.text
    body = response.json()
    assert body["error"] and body["message"], body
    if field is not None:
        assert body.get("field") == field, body
    return dict(body)


async def _raw(url: str, head: str, body: bytes) -> tuple[str, float]:
    """Send a request by hand (the body may never be finished); return the reply and its latency."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    async def push() -> None:
        try:
            writer.write(head.encode() + body)
            await writer.drain()
        except OSError:
            pass  # the server answered and closed without reading the rest: the point of the test

    t0 = time.perf_counter()
    pushing = asyncio.ensure_future(push())
    reply = await asyncio.wait_for(reader.read(65536), 30)
    elapsed = time.perf_counter() - t0
    await pushing
    writer.close()
    return reply.decode(errors="replace"), elapsed


# -- the trainer report on /v1/phase ----------------------------------------------------------------

@pytest.mark.parametrize(("trainer", "field"), [
    ({"spans": [1]}, "trainer.spans.0"),
    ({"spans": [{"duration_s": "abc"}]}, "trainer.spans.0.duration_s"),
    ({"groups_report": 5}, "trainer.groups_report"),
    ({"groups": {"group_count": True}}, "trainer.groups.group_count"),
])
async def test_a_malformed_trainer_report_is_422_naming_the_field(
        client: httpx.AsyncClient, trainer: dict[str, Any], field: str) -> None:
    before = (await client.get("/v1/status")).json()
    _is_error(await client.post("/v1/phase", json={"step": 1, "phase": "train", "trainer": trainer}), 422,
              field=field)
    assert (await client.get("/v1/status")).json() == before


async def test_train_with_a_negative_group_count_is_422_before_any_engine_is_paused(
        client: httpx.AsyncClient, engine: ReferenceEngineProcess) -> None:
    memory = await _engine_memory(engine)
    before = (await client.get("/v1/status")).json()
    r = await client.post("/v1/phase", json={"step": 1, "phase": "train", "trainer": {"groups": {"group_count": -1}}})
    _is_error(r, 422, field="trainer.groups.group_count")
    assert (await client.get("/v1/status")).json() == before
    assert await _engine_memory(engine) == memory  # nothing released


# -- strict, bounded numbers ------------------------------------------------------------------------

@pytest.mark.parametrize("step", [True, 1e30, 2**63, 2**53, -1, "1", 1.0])
async def test_a_step_that_is_not_an_int_below_2_53_is_422(client: httpx.AsyncClient, step: Any) -> None:
    before = (await client.get("/v1/status")).json()
    _is_error(await client.post("/v1/phase", json={"step": step, "phase": "train"}), 422, field="step")
    assert (await client.get("/v1/status")).json() == before


async def test_a_one_shot_update_for_a_rank_the_engines_do_not_have_is_422_at_once(
        client: httpx.AsyncClient) -> None:
    chunk = {"seq": 0, "transport": "shm", "nbytes": 8,
             "handle": {"shm_name": "colocd-1-ab", "nbytes": 8, "layout": []}}  # well formed: the rank is at fault
    for rank, field in ((1, "chunks.0.rank"), (200_000, "chunks.0.rank")):
        t0 = time.perf_counter()
        r = await client.post("/v1/update_weights", json={"version": "v1", "chunks": [{**chunk, "rank": rank}]})
        body = _is_error(r, 422, field=field)
        assert time.perf_counter() - t0 < 5 and len(r.content) < 2000, body
    assert (await client.get("/healthz")).status_code == 200


# -- policy documents --------------------------------------------------------------------------------

async def test_a_policy_document_that_is_not_utf8_is_400_and_the_connection_stays_usable(
        client: httpx.AsyncClient) -> None:
    before = (await client.get("/v1/policies")).json()
    body = _is_error(await client.put("/v1/policies", content=b"\xff\xfeapiVersion: colocd/v1\n"), 400)
    assert "UTF-8" in body["message"]
    # Same keep-alive connection: the next request is answered, not reset.
    assert (await client.get("/v1/policies")).json() == before


async def test_a_yaml_alias_bomb_is_refused_without_stalling_the_daemon(client: httpx.AsyncClient) -> None:
    assert len(ALIAS_BOMB) < 300
    put = asyncio.ensure_future(client.put("/v1/policies", content=ALIAS_BOMB))
    t0 = time.perf_counter()
    probes = []
    while not put.done():
        p0 = time.perf_counter()
        assert (await client.get("/healthz")).status_code == 200
        probes.append(time.perf_counter() - p0)
    body = _is_error(await put, 400)
    assert "alias" in body["message"] or "nodes" in body["message"], body
    assert time.perf_counter() - t0 < 2.0
    assert max(probes, default=0.0) < 1.5, probes  # unbounded, the loop was blocked 4.4 s


@pytest.mark.parametrize(("document", "line", "column"), [
    (b"apiVersion: colocd/v1\n\x00\n", 2, 1),
    (b"apiVersion: colocd/v1\x07\n", 1, 22),
    (b"apiVersion: colocd/v1\npipeline: {policy: \x1b[31moverlap}\n", 2, 20),
], ids=["NUL", "BEL", "ESC"])
async def test_a_policy_document_with_a_control_character_is_400_naming_where_it_is(
        client: httpx.AsyncClient, document: bytes, line: int, column: int) -> None:
    before = (await client.get("/v1/policies")).json()
    body = _is_error(await client.put("/v1/policies", content=document), 400)
    assert (body["line"], body["column"]) == (line, column) and "U+00" in body["message"], body
    assert (await client.get("/v1/policies")).json() == before


async def test_a_flat_list_of_131k_nodes_is_refused_at_the_node_limit_without_stalling_the_daemon(
        client: httpx.AsyncClient) -> None:
    document = b"apiVersion: colocd/v1\nx: [" + b",".join([b"1"] * 131_000) + b"]\n"
    assert len(document) < 256 * 1024
    refusal_cpu_s = _refusal_cpu_s(document)
    gc.disable()  # a collection pause on the loop's thread is the test process's, not the daemon's work
    try:
        put = asyncio.ensure_future(client.put("/v1/policies", content=document))
        longest_turn = asyncio.ensure_future(_longest_loop_turn_cpu_s(put))
        t0 = time.perf_counter()
        answered_during = 0
        while not put.done():
            assert (await client.get("/healthz")).status_code == 200
            answered_during += not put.done()
        body = _is_error(await put, 400)
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    assert "limits.max_yaml_nodes" in body["message"], body
    assert elapsed < 2.0  # composed to the end first, it took 5-20 s
    assert answered_during > 0  # the daemon answered while it was refusing the document
    # The daemon's event loop (this test's: the daemon runs in-process) never spent a quarter of the refusal's
    # CPU in one turn: the document is refused off the loop. CPU, not wall: on a loaded 2-core machine a probe's
    # wall time is mostly waiting for a core and for the GIL the refusing thread holds.
    assert await longest_turn < refusal_cpu_s / 4, (await longest_turn, refusal_cpu_s)


def _refusal_cpu_s(document: bytes) -> float:
    """CPU seconds the refusal of ``document`` costs here, under the daemon's default limits."""
    from colocd.daemon.config import Limits
    from colocd.policies import PolicyError, YamlLimits, load_policy_yaml

    limits = Limits()
    t0 = time.thread_time()
    with pytest.raises(PolicyError, match=r"limits\.max_yaml_nodes"):
        load_policy_yaml(document, limits=YamlLimits(max_bytes=limits.max_policy_bytes,
                                                     max_aliases=limits.max_yaml_aliases,
                                                     max_nodes=limits.max_yaml_nodes))
    return time.thread_time() - t0


async def _longest_loop_turn_cpu_s(until: asyncio.Future[Any]) -> float:
    """The most CPU time the event loop's thread spent between two turns of this task while ``until`` runs
    (everything else the loop ran in between: the daemon's request handling, the client's probes)."""
    longest, last = 0.0, time.thread_time()
    while not until.done():
        await asyncio.sleep(0)  # one loop turn, not a wait: the loop runs whatever is ready, then this task
        now = time.thread_time()
        longest, last = max(longest, now - last), now
    return longest


async def test_a_plugin_outside_the_allow_list_is_refused_before_its_module_is_imported(
        engine: ReferenceEngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "hostile_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass P: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    document = b"apiVersion: colocd/v1\nprocess_groups:\n  policy: hostile_plugin:P\n"
    async with daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False) as node, node.http() as c:
        body = _is_error(await c.put("/v1/policies", content=document), 400)
        assert body["field"] == "process_groups.policy" and "allow-list" in body["message"], body
    assert not marker.exists()


async def test_a_plugin_on_the_allow_list_is_imported(
        engine: ReferenceEngineProcess, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "listed_plugin.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass P: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    document = b"apiVersion: colocd/v1\nprocess_groups:\n  policy: listed_plugin:P\n"
    async with (daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False,
                            policy_plugins=["listed_plugin:*"]) as node,
                node.http() as c):
        body = _is_error(await c.put("/v1/policies", content=document), 400)  # P is not a policy class
        assert "ProcessGroupPolicy" in body["message"], body
    assert marker.exists()


@pytest.mark.parametrize("value", [True, "30"])
async def test_a_duration_that_is_not_a_number_is_400_naming_the_field(client: httpx.AsyncClient, value: Any) -> None:
    before = (await client.get("/v1/policies")).json()
    document = f"apiVersion: colocd/v1\ntimeouts:\n  chunk_s: {json.dumps(value)}\n".encode()
    body = _is_error(await client.put("/v1/policies", content=document), 400, field="timeouts.chunk_s")
    assert body["line"] == 3, body
    assert (await client.get("/v1/policies")).json() == before


def _durations() -> list[tuple[str, str, float, float]]:
    """Every duration the policy schema declares: (its section's YAML, its dotted field, floor, ceiling); the
    floor and the ceiling are 0 and inf where the schema leaves them out."""
    defs = policy_json_schema()["$defs"]
    found: dict[str, tuple[str, str, float, float]] = {}
    for model in defs.values():
        properties = model.get("properties", {})
        policy = properties.get("policy", {}).get("const")
        for name, prop in properties.items():
            number = next((p for p in prop.get("anyOf", [prop]) if p.get("type") == "number"), None)
            if not name.endswith("_s") or number is None:
                continue
            section = "timeouts" if model.get("title") == "Timeouts" else "process_groups"
            head = f"{section}:\n" + (f"  policy: {policy}\n" if policy else "")
            floor = float(number.get("minimum", number.get("exclusiveMinimum", 0.0)))
            found[f"{section}.{name}"] = (head, f"{section}.{name}", floor, float(number.get("maximum", math.inf)))
    return sorted(found.values(), key=lambda d: d[1])


DURATIONS = _durations()


@pytest.mark.parametrize("duration", DURATIONS, ids=[d[1] for d in DURATIONS])
async def test_every_duration_in_the_policy_schema_has_a_floor_and_a_ceiling(
        duration: tuple[str, str, float, float]) -> None:
    _, field, floor, ceiling = duration
    # A wait may be none at all; every other duration is a budget or an interval, and has a floor above 0.
    assert floor > 0 or field.endswith("_wait_s"), f"{field} has no floor above 0"
    assert math.isfinite(ceiling), f"{field} has no ceiling"


@pytest.mark.parametrize("duration", DURATIONS, ids=[d[1] for d in DURATIONS])
async def test_a_duration_outside_its_bounds_is_400_naming_the_field(
        client: httpx.AsyncClient, duration: tuple[str, str, float, float]) -> None:
    head, field, floor, ceiling = duration
    before = (await client.get("/v1/policies")).json()
    for value in (floor / 2 if floor > 0 else -1.0, 1e-9 if floor > 0 else -1e-9, ceiling * 2):
        # Written as YAML 1.1 floats (PyYAML reads 1e-09 as a string).
        document = f"apiVersion: colocd/v1\n{head}  {field.split('.')[1]}: {value:.6e}\n".encode()
        body = _is_error(await client.put("/v1/policies", content=document), 400, field=field)
        assert repr(value) in body["message"], body
    assert (await client.get("/v1/policies")).json() == before


async def test_a_health_interval_of_a_nanosecond_is_400_naming_its_floor(
        client: httpx.AsyncClient) -> None:
    document = b"apiVersion: colocd/v1\ntimeouts:\n  health_interval_s: 1.0e-9\n"
    body = _is_error(await client.put("/v1/policies", content=document), 400, field="timeouts.health_interval_s")
    assert "greater than or equal to 0.05" in body["message"], body


async def test_the_health_interval_at_its_floor_is_accepted(client: httpx.AsyncClient) -> None:
    floor = next(d[2] for d in DURATIONS if d[1] == "timeouts.health_interval_s")
    document = f"apiVersion: colocd/v1\ntimeouts:\n  health_interval_s: {floor:.6e}\n".encode()
    assert (await client.put("/v1/policies", content=document)).status_code == 200


async def test_a_node_config_duration_that_is_a_boolean_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("timeouts:\n  chunk_s: true\n")
    with pytest.raises(ConfigError, match=r"timeouts\.chunk_s"):
        load_node_config(path)


# -- bodies: the token first, then the size, before the body is read ----------------------------------

async def test_an_unauthenticated_100_mb_body_is_401_before_it_is_read(engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False) as node, node.http() as c:
        head = ("POST /v1/phase HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Content-Length: {100 * 1024 * 1024}\r\n\r\n")
        reply, elapsed = await _raw(str(c.base_url), head, b"{" * 1024)  # 1 KiB of the promised 100 MB
    assert reply.startswith("HTTP/1.1 401"), reply
    assert '"error": "Unauthorized"' in reply and elapsed < 5


async def test_a_body_over_the_limit_is_413_whether_declared_or_streamed(engine: ReferenceEngineProcess) -> None:
    async with (daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False,
                            limits={"max_body_bytes": 4096}) as node,
                node.http() as c):
        declared = await c.post("/v1/phase", content=b" " * 5000, headers={"content-type": "application/json"})
        assert "max_body_bytes" in _is_error(declared, 413)["message"]
        head = ("POST /v1/phase HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                f"Authorization: Bearer {TOKEN}\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunks = b"".join(b"400\r\n" + b" " * 1024 + b"\r\n" for _ in range(8)) + b"0\r\n\r\n"
        reply, _ = await _raw(str(c.base_url), head, chunks)
        assert reply.startswith("HTTP/1.1 413"), reply
        ok = await c.post("/v1/phase", json={"step": 0, "phase": "sync"})  # a small body still goes through
        assert ok.status_code == 409, ok.text


# -- weight-update groups: checked before any engine joins --------------------------------------------

async def test_a_weight_group_with_an_unreachable_master_is_422_within_seconds(
        engine: ReferenceEngineProcess) -> None:
    async with (daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False,
                            timeouts={"master_reach_s": 1.0}) as node,
                node.http() as c):
        t0 = time.perf_counter()
        r = await c.post("/v1/weights/groups", json={"master_address": "127.0.0.1", "master_port": 1,
                                                     "backend": "gloo"})
        _is_error(r, 422, field="master_port")
        assert time.perf_counter() - t0 < 5
        r = await c.post("/v1/weights/groups", json={"master_address": "no-such-host.invalid", "master_port": 29500,
                                                     "backend": "gloo"})
        _is_error(r, 422, field="master_address")
        r = await c.post("/v1/weights/groups", json={"master_address": "\x80", "master_port": 29500,
                                                     "backend": "gloo"})
        _is_error(r, 422, field="master_address")  # once a 500 (found by the fuzz test): not an IDNA host name
        assert (await c.get("/v1/weights/groups")).json()["groups"] == {}


async def test_a_weight_group_whose_master_port_is_not_a_tcpstore_is_422_within_seconds(
        engine: ReferenceEngineProcess) -> None:
    async with (daemon_node({"ref0": str(engine.url)}, token=TOKEN, ready=False,
                            timeouts={"master_reach_s": 1.0, "group_s": 5.0}) as node,
                node.http() as c):
        http_port = int(str(c.base_url).rstrip("/").rsplit(":", 1)[1])  # this daemon's own HTTP port
        t0 = time.perf_counter()
        r = await c.post("/v1/weights/groups", json={"master_address": "127.0.0.1", "master_port": http_port,
                                                     "backend": "gloo", "world_size": 2})
        body = _is_error(r, 422, field="master_port")
        assert "not a torch TCPStore" in body["message"], body
        assert time.perf_counter() - t0 < 4  # a 504 after the engines' rendezvous timed out, before
        assert (await c.get("/v1/weights/groups")).json()["groups"] == {}


async def test_the_nccl_backend_on_a_cpu_engine_is_422_before_it_joins(client: httpx.AsyncClient) -> None:
    r = await client.post("/v1/weights/groups", json={"master_address": "127.0.0.1", "master_port": 1,
                                                      "backend": "nccl"})
    assert "cpu" in _is_error(r, 422, field="backend")["message"]
    assert (await client.get("/v1/weights/groups")).json()["groups"] == {}


# -- one error shape, honest routing --------------------------------------------------------------------

async def test_framework_errors_use_the_error_shape(client: httpx.AsyncClient) -> None:
    _is_error(await client.get("/no/such/route"), 404)
    _is_error(await client.post("/v1/phase", content=b'{"step":', headers={"content-type": "application/json"}), 400)
    _is_error(await client.post("/v1/phase", content=b'\xff{"step": 1}',
                                headers={"content-type": "application/json"}), 400)
    _is_error(await client.post("/v1/phase", json={"step": 1}), 422, field="phase")
    _is_error(await client.post("/v1/phase", json={"step": 1, "phase": "train"}, headers={"Authorization": "x"}), 401)


async def test_allow_lists_every_method_of_a_path(client: httpx.AsyncClient) -> None:
    options = await client.options("/v1/weights/groups")
    assert options.status_code == 204
    assert {"GET", "POST"} <= set(options.headers["allow"].split(", "))
    patched = await client.patch("/v1/weights/groups")
    _is_error(patched, 405)
    assert {"GET", "POST"} <= set(patched.headers["allow"].split(", "))


async def test_openapi_declares_the_error_statuses_with_the_error_model(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    phase = spec["paths"]["/v1/phase"]["post"]["responses"]
    assert {"400", "401", "409", "413", "422", "502", "503", "504"} <= set(phase)
    assert phase["409"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert phase["422"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "404" in spec["paths"]["/v1/weights/sessions/{session_id}/commit"]["post"]["responses"]


async def test_openapi_declares_metrics_as_the_prometheus_text_it_serves(client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    declared = spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    served = (await client.get("/metrics")).headers["content-type"]
    assert list(declared) == ["text/plain; version=0.0.4"], declared
    assert served.startswith("text/plain; version=0.0.4"), served


async def test_a_session_for_a_step_other_than_the_nodes_is_422_naming_step(
        pooled_engine: ReferenceEngineProcess) -> None:
    # Its own engine (the pool's, reset afterwards): this test moves the node to sync.
    async with daemon_node({"ref0": str(pooled_engine.url)}, token=TOKEN, ready=False) as node, node.http() as c:
        assert (await c.post("/v1/phase", json={"step": 3, "phase": "train"})).status_code == 200
        assert (await c.post("/v1/phase", json={"step": 3, "phase": "sync"})).status_code == 200
        before = (await c.get("/v1/status")).json()
        for step in (2, 4, 0):
            body = _is_error(await c.post("/v1/weights/sessions", json={"version": "v1", "step": step}), 422,
                             field="step")
            assert "node's step 3" in body["message"], body
        assert (await c.get("/v1/status")).json() == before
        opened = await c.post("/v1/weights/sessions", json={"version": "v1", "step": 3})
        assert opened.status_code == 200 and opened.json()["step"] == 3, opened.text
        assert (await c.post(f"/v1/weights/sessions/{opened.json()['session_id']}/abort")).status_code == 200


_OTHER_COLOCD_PROCESS = """
import sys, time
from colocd.engines.chunks import SharedSegment
segment = SharedSegment.create(64)  # another colocd process's live segment, nothing to do with the session
print(segment.name, flush=True)
time.sleep(3600)
"""


@asynccontextmanager
async def _another_process_segment() -> AsyncIterator[str]:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _OTHER_COLOCD_PROCESS,
                                                stdout=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(60):
            name = (await proc.stdout.readline()).decode().strip()
        assert name, "the other process exited before creating its segment"
        yield name
    finally:
        proc.kill()
        await proc.wait()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{name}")


@pytest.fixture
def other_program_segment() -> Iterator[str]:
    """A /dev/shm file of another program (a database's, NCCL's), not in colocd's naming."""
    path = f"/dev/shm/hostile-victim-{os.getpid()}"
    with open(path, "wb") as f:
        f.write(b"\0" * 64)
    yield os.path.basename(path)
    os.unlink(path)


def _in_dev_shm(name: str) -> bool:
    return name in os.listdir("/dev/shm")


async def test_chunks_naming_what_is_not_the_trainers_are_refused_and_those_files_survive_the_abort(
        other_program_segment: str, pooled_engine: ReferenceEngineProcess) -> None:
    # Its own engine (the pool's, reset afterwards): this test moves the node to sync and opens a session.
    async with (daemon_node({"ref0": str(pooled_engine.url)}, token=TOKEN, ready=False, loads_shm=True) as node,
                node.http() as c,
                _another_process_segment() as colocd_segment):
        assert (await c.post("/v1/phase", json={"step": 1, "phase": "train"})).status_code == 200
        assert (await c.post("/v1/phase", json={"step": 1, "phase": "sync"})).status_code == 200
        session_id = (await c.post("/v1/weights/sessions", json={"version": "v1", "ranks": 1})).json()["session_id"]
        chunks = f"/v1/weights/sessions/{session_id}/chunks"
        shm = {"seq": 0, "rank": 0, "transport": "shm", "nbytes": 64}
        for chunk, field in (
            ({**shm, "handle": {"shm_name": other_program_segment, "nbytes": 64, "layout": []}},
             "handle.shm_name"),
            ({**shm, "handle": {"shm_name": colocd_segment, "layout": []}}, "handle.nbytes"),
            ({**shm, "handle": {"shm_name": colocd_segment, "nbytes": True, "layout": []}}, "handle.nbytes"),
            ({**shm, "handle": {"shm_name": colocd_segment, "nbytes": 63, "layout": []}}, "handle.nbytes"),
            # Payloads that are not base64 (the cuda_ipc case is tests/unit/test_chunk_handles.py: this CPU
            # engine refuses cuda_ipc by its transport first).
            ({"seq": 0, "rank": 0, "transport": "inline", "nbytes": 64,
              "handle": {"payload_b64": "not base64!"}}, "handle.payload_b64"),
            ({"seq": 0, "rank": 0, "transport": "cuda_ipc", "nbytes": 64,
              "handle": {"payload_b64": "not base64!"}}, "transport"),
        ):
            _is_error(await c.post(chunks, json=chunk), 422, field=field)
            assert (await c.get("/v1/status")).json()["weight_session"]["state"] == "open", chunk
        # A live colocd segment of a process that is not this session's trainer: the daemon may read it,
        # never remove it.
        await c.post(chunks, json={**shm, "handle": {"shm_name": colocd_segment, "nbytes": 64, "layout": []}})
        assert (await c.post(f"/v1/weights/sessions/{session_id}/abort")).status_code == 200
        assert _in_dev_shm(other_program_segment) and _in_dev_shm(colocd_segment)


async def test_openapi_declares_the_bearer_token_on_mutating_routes_and_links_a_session_to_its_routes(
        client: httpx.AsyncClient) -> None:
    spec = (await client.get("/openapi.json")).json()
    scheme = spec["components"]["securitySchemes"]["bearerAuth"]
    assert (scheme["type"], scheme["scheme"]) == ("http", "bearer")
    assert spec["paths"]["/v1/phase"]["post"]["security"] == [{"bearerAuth": []}]
    assert "security" not in spec["paths"]["/v1/status"]["get"]
    links = spec["paths"]["/v1/weights/sessions"]["post"]["responses"]["200"]["links"]
    commit = spec["paths"]["/v1/weights/sessions/{session_id}/commit"]["post"]["operationId"]
    assert links[commit]["parameters"] == {"path.session_id": "$response.body#/session_id"}
    assert "shm: {shm_name, nbytes, layout}" in spec["components"]["schemas"]["ChunkDescriptor"]["properties"][
        "handle"]["description"]


async def test_a_chunk_from_a_rank_outside_its_session_is_422_and_the_session_stays_open(
        pooled_engine: ReferenceEngineProcess) -> None:
    # Its own engine (the pool's, reset afterwards): this test moves the node to sync and opens a session.
    async with daemon_node({"ref0": str(pooled_engine.url)}, token=TOKEN, ready=False) as node, node.http() as c:
        assert (await c.post("/v1/phase", json={"step": 1, "phase": "train"})).status_code == 200
        assert (await c.post("/v1/phase", json={"step": 1, "phase": "sync"})).status_code == 200
        opened = await c.post("/v1/weights/sessions", json={"version": "v1", "ranks": 1})
        session_id = opened.json()["session_id"]
        before = (await c.get("/v1/status")).json()
        r = await c.post(f"/v1/weights/sessions/{session_id}/chunks",
                         json={"seq": 0, "rank": 1, "transport": "shm", "nbytes": 8,
                               "handle": {"shm_name": "colocd-1-ab", "nbytes": 8, "layout": []}})
        _is_error(r, 422, field="rank")
        after = (await c.get("/v1/status")).json()
        after["weight_session"].pop("idle_for_s", None)
        before["weight_session"].pop("idle_for_s", None)
        assert after == before and after["weight_session"]["state"] == "open"
        assert (await c.post(f"/v1/weights/sessions/{session_id}/abort")).status_code == 200
