"""Weight sessions as a trainer meets them (issue 9 items 3-5, issue 10 item 6), against real processes.

The module's reference engine process (reset between tests) and a daemon per test, in the test's event loop
or, where the daemon must be another process, ``colocd serve``; trainers are ``AsyncColocdClient``s in the
test or, where one must die, a separate Python process. Every test ends the same way: the engine's
``/weights_checker`` checksum equals the last complete push, and a generation request sent while the
fault was visible (it waits at the engine's pause gate) answers only on the complete weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import torch
from support import (
    DaemonNode,
    InMemoryEngine,
    Receive,
    Scope,
    Send,
    chunk_part,
    daemon_node,
    in_process_daemon,
    request_body,
    serve_lifespan,
    served_checksums,
    shm_segments,
    weights_checksum,
)

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.daemon.node import Daemon
from colocd.daemon.states import NodePhase
from colocd.engines.base import ChunkLoad
from colocd.engines.chunks import ChunkLayout, plan_chunks
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.errors import RequestInvalid
from colocd.policies import Transport
from colocd.trainer.producer import ExportedPart, Producer
from colocd.trainer.push import WeightPusher, manifest_of

Named = list[tuple[str, torch.Tensor]]
DEADLINE_S = 60


def _model(seed: int) -> tuple[torch.nn.Module, Named]:
    model = build_model(QwenLikeConfig(), seed=seed)
    return model, list(model.named_parameters())


def _local_greedy(model: torch.nn.Module, n: int = 8) -> list[int]:
    ids = torch.tensor([[1]])
    with torch.no_grad():
        for _ in range(n):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, 1:].tolist()


async def _greedy(engine_url: str, n: int = 8) -> list[int]:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        r = await http.post(f"{engine_url}/generate", json={
            "input_ids": [1], "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        r.raise_for_status()
        return list(r.json()["output_ids"])


async def _blocked_generation(engine_url: str) -> asyncio.Task[list[int]]:
    """A generation sent while the engine is paused: it must wait at the pause gate, not answer now."""
    probe = asyncio.create_task(_greedy(engine_url))
    await asyncio.sleep(0.3)  # give it time to reach the engine (and to answer, if the gate were open)
    assert not probe.done(), "the engine answered a generation while its weights were being replaced"
    return probe


async def _finish_with(node: DaemonNode, model: torch.nn.Module, named: Named,
                       probe: asyncio.Task[list[int]], step: int = 1) -> None:
    """A complete push, then rollout: the engine serves exactly these weights, and so did the probe."""
    await WeightPusher(node.client, bucket_mb=0.05).push(named, version="good", step=step)
    await node.client.phase("rollout", step)
    assert await served_checksums(node.engine_url) == [weights_checksum(named)]
    expected = _local_greedy(model)
    assert await asyncio.wait_for(probe, DEADLINE_S) == expected
    assert await _greedy(node.engine_url) == expected


async def _pushed_then_released(node: DaemonNode, named: Named) -> None:
    """A complete push at step 1 (what complete means: no engine lists its parameters), then the next step's
    train released the weights: the node is in sync at step 2 with stale weights."""
    await WeightPusher(node.client, bucket_mb=0.05).push(named, version="v1", step=1)
    await node.client.phase("rollout", 1)
    await node.client.phase("train", 2)
    await node.client.phase("sync", 2)
    assert (await _engine_state(node.client))["weights"] == "stale"


async def _until(check: Callable[[], Awaitable[bool]], deadline_s: float = DEADLINE_S) -> None:
    """Poll ``check`` until it holds, within a deadline."""
    async with asyncio.timeout(deadline_s):
        while True:
            if await check():
                return
            await asyncio.sleep(0.1)  # polling cadence


async def _engine_state(client: AsyncColocdClient) -> dict[str, Any]:
    return dict((await client.status())["engines"]["ref0"])


async def _refused(call: Awaitable[Any], status: int) -> dict[str, Any]:
    with pytest.raises(ColocdHTTPError) as err:
        await call
    assert err.value.status == status, err.value.body
    return err.value.body


def _export(named: Named, *, transport: str = "inline", bucket_bytes: int = 20_000) -> list[ExportedPart]:
    producer = Producer(transport)
    return [producer.export(bucket) for bucket in plan_chunks(named, bucket_bytes)]


# --- leases -----------------------------------------------------------------------------------------

_DOOMED_TRAINER = """
import asyncio, json, sys
from colocd.api.client import AsyncColocdClient
from colocd.trainer.push import manifest_of
from colocd.engines.chunks import plan_chunks
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.producer import Producer

async def main(url):
    named = list(build_model(QwenLikeConfig(), seed=11).named_parameters())
    async with AsyncColocdClient(url) as c:
        s = await c.open_session("doomed", step=1, ranks=1, depth=2, manifest=manifest_of(named))
        producer, kept = Producer("shm"), []
        for seq, bucket in enumerate(list(plan_chunks(named, 20_000))[:3]):
            chunk = producer.export(bucket)
            await c.send_chunk(s["session_id"], seq=seq, rank=0, chunk=chunk)
            kept.append(chunk)  # acked, never released: this trainer dies first
        print(json.dumps({"session_id": s["session_id"], "segments": [k.handle["shm_name"] for k in kept]}),
              flush=True)
        await asyncio.sleep(3600)

asyncio.run(main(sys.argv[1]))
"""


async def test_a_killed_trainers_session_expires_and_the_next_push_needs_no_manual_call(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, timeouts={"session_idle_s": 1.5}, synced_at=1,
                           loads_shm=True) as node:
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _DOOMED_TRAINER, node.url, stdout=asyncio.subprocess.PIPE)
        assert trainer.stdout is not None
        async with asyncio.timeout(DEADLINE_S):
            started = json.loads(await trainer.stdout.readline())
        assert set(started["segments"]) <= shm_segments(trainer.pid)
        trainer.send_signal(signal.SIGKILL)
        await trainer.wait()
        killed_at = time.monotonic()
        probe = await _blocked_generation(node.engine_url)

        sid = started["session_id"]
        async def lapsed() -> bool:
            return bool((await node.client.status())["weight_session"]["state"] != "open")

        await _until(lapsed)
        assert time.monotonic() - killed_at >= 1.0  # not before its idle time
        session = (await node.client.status())["weight_session"]
        assert session["id"] == sid and session["state"] == "expired" and "idle limit" in session["error"]

        async def unlinked() -> bool:  # as the expired session closes, after its engines' updates ended
            return not set(started["segments"]) & shm_segments(trainer.pid)

        await _until(unlinked)  # the dead trainer's segments are unlinked
        engine = await _engine_state(node.client)
        assert (engine["generation"], engine["weights"], engine["weight_version"]) == ("paused", "stale", "default")
        gone = await _refused(node.client.commit(sid, 3), 410)
        assert gone["error"] == "SessionGone" and gone["session_state"] == "expired"
        assert 'outcome="expired"' in await node.client.metrics()

        model, named = _model(seed=5)
        await _finish_with(node, model, named, probe)


# --- complete updates -------------------------------------------------------------------------------


_LIVE_TRAINER = """
import asyncio, json, sys
from colocd.api.client import AsyncColocdClient
from colocd.engines.chunks import plan_chunks
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.producer import Producer

async def main(url):
    named = list(build_model(QwenLikeConfig(), seed=12).named_parameters())
    async with AsyncColocdClient(url) as c:
        sid = (await c.open_session("kept", step=1, ranks=1))["session_id"]
        await c.join_session(sid, rank=0, device_id="cpu:0")  # declares this process (its pid)
        producer = Producer("shm")
        kept = [producer.export(bucket) for bucket in list(plan_chunks(named, 20_000))[:2]]
        for seq, chunk in enumerate(kept):  # sent and acked, never released: this trainer lives on
            await c.send_chunk(sid, seq=seq, rank=0, chunk=chunk)
        print(json.dumps({"session_id": sid, "segments": [k.handle["shm_name"] for k in kept]}), flush=True)
        await asyncio.to_thread(sys.stdin.read)  # alive until the test closes its stdin
        producer.close()

asyncio.run(main(sys.argv[1]))
"""


async def test_an_aborted_sessions_segments_are_unlinked_when_its_live_trainer_declared_its_pid_at_join(
        pooled_engine: ReferenceEngineProcess) -> None:
    # The trainer is another process than the daemon: only the pid it declared at join proves its segments its own.
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1, loads_shm=True) as node:
        trainer = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _LIVE_TRAINER, node.url, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE)
        assert trainer.stdin is not None and trainer.stdout is not None
        try:
            async with asyncio.timeout(DEADLINE_S):
                started = json.loads(await trainer.stdout.readline())
            segments = set(started["segments"])
            assert segments <= shm_segments(trainer.pid)
            await node.client.abort(started["session_id"])
            assert trainer.returncode is None  # the trainer lives on
            assert not segments & shm_segments(trainer.pid)  # the daemon proved them this trainer's
        finally:
            trainer.stdin.close()
            async with asyncio.timeout(DEADLINE_S):
                await trainer.wait()


async def test_a_partial_commit_after_a_release_is_refused_naming_the_missing_tensors(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1) as node:
        model, named = _model(seed=5)
        await _pushed_then_released(node, named)
        probe = await _blocked_generation(node.engine_url)
        sid = (await node.client.open_session("ten", step=2, ranks=1))["session_id"]  # no manifest declared
        (chunk,) = _export(named[:10], bucket_bytes=1 << 30)
        try:
            await node.client.send_chunk(sid, seq=0, rank=0, chunk=chunk)
            refused = await _refused(node.client.commit(sid, 1), 422)
        finally:
            chunk.release()
        assert refused["field"] == "manifest" and "weights were discarded" in refused["message"]
        missing = [n for n, _ in named[10:]]
        assert f"{min(missing)!r}" in refused["message"] and f"({len(missing)} in all)" in refused["message"]
        assert (await node.client.status())["weight_session"]["state"] == "open"  # nothing committed
        assert (await _engine_state(node.client))["weights"] == "updating"
        await _refused(node.client.phase("rollout", 2), 409)

        await node.client.abort(sid)
        await _refused(node.client.phase("rollout", 2), 409)  # ten tensors of a thousand are not weights
        await _finish_with(node, model, named, probe, step=2)


async def test_a_declared_partial_manifest_after_a_release_is_refused_at_open_changing_nothing(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1) as node:
        model, named = _model(seed=5)
        await _pushed_then_released(node, named)
        probe = await _blocked_generation(node.engine_url)
        before = await node.client.status()
        refused = await _refused(node.client.open_session("ten", ranks=1, manifest=manifest_of(named[:10])), 422)
        assert refused["field"] == "manifest" and f"{min(n for n, _ in named[10:])!r}" in refused["message"]
        refused = await _refused(
            node.client.open_session("ten", ranks=1, manifest=manifest_of(named[:10]), partial=True), 409)
        assert "partial update needs intact weights" in refused["message"]
        after = await node.client.status()
        assert after["engines"] == before["engines"] and after["weight_session"] == before["weight_session"]
        await _finish_with(node, model, named, probe, step=2)


async def test_a_partial_update_on_clean_weights_needs_partial_true_and_then_works(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1) as node:
        model, named = _model(seed=5)
        await WeightPusher(node.client, bucket_mb=0.05).push(named, version="v1", step=1)
        await node.client.phase("rollout", 1)
        await node.client.sleep(tags=["kv_cache", "cuda_graph"])  # paused, weights kept: clean
        assert (await _engine_state(node.client))["weights"] == "clean"
        with torch.no_grad():
            for _, t in named[:3]:
                t.add_(1.0)
        probe = await _blocked_generation(node.engine_url)

        refused = await _refused(WeightPusher(node.client).push(named[:3], version="v1p"), 422)
        assert "partial: true" in refused["message"]
        assert (await _engine_state(node.client))["weight_version"] == "v1"

        await WeightPusher(node.client).push(named[:3], version="v1p", partial=True)
        await node.client.resume(tags=["kv_cache", "cuda_graph"])
        engine = await _engine_state(node.client)
        assert (engine["generation"], engine["weights"], engine["weight_version"]) == ("serving", "clean", "v1p")
        assert await served_checksums(node.engine_url) == [weights_checksum(named)]
        assert await asyncio.wait_for(probe, DEADLINE_S) == _local_greedy(model)


# --- no chunk outlives its session ------------------------------------------------------------------



@dataclass
class SlowLoadProxy:
    """Forwards everything to the engine; the ``nth`` chunk (update_weights_from_tensor) is held until
    ``release`` is set and then forwarded anyway, whether or not the daemon still waits: an engine whose load
    is slow, finishing at a moment the test chooses."""

    upstream: str
    nth: int
    release: asyncio.Event = field(default_factory=asyncio.Event)
    chunks_seen: int = 0
    late_replies: list[tuple[int, str]] = field(default_factory=list)
    late_answered: asyncio.Event = field(default_factory=asyncio.Event)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        body = await request_body(receive)
        late = False
        if scope["path"] == "/update_weights_from_tensor":
            self.chunks_seen += 1
            if self.chunks_seen == self.nth:
                late = True
                await self.release.wait()  # the engine "loads slowly": the daemon gives up meanwhile
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k.lower() not in (b"host", b"content-length")}
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            reply = await http.request(scope["method"], self.upstream + scope["path"], content=body, headers=headers,
                                       params=scope["query_string"].decode() or None)
        if late:
            self.late_replies.append((reply.status_code, reply.text))
            self.late_answered.set()
        await send({"type": "http.response.start", "status": reply.status_code,
                    "headers": [(b"content-type", reply.headers.get("content-type", "application/json").encode())]})
        await send({"type": "http.response.body", "body": reply.content})


async def test_a_late_chunk_never_lands_in_the_next_session(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    proxies: list[SlowLoadProxy] = []

    def via(url: str) -> SlowLoadProxy:
        proxies.append(SlowLoadProxy(url, nth=2))
        return proxies[0]

    # chunk_s fails the first session; it also bounds every chunk of the next one, so it leaves room for a busy CPU.
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=via, timeouts={"chunk_s": 3.0, "quiesce_s": 0.3},
                           synced_at=1) as node:
        _, stale_named = _model(seed=99)
        chunks = _export(stale_named)  # the chunks outlive the session: only the engine can refuse
        try:
            sid_a = (await node.client.open_session("late", step=1, ranks=1, depth=1,
                                                    manifest=manifest_of(stale_named)))["session_id"]
            await node.client.send_chunk(sid_a, seq=0, rank=0, chunk=chunks[0])
            timeout = await _refused(node.client.send_chunk(sid_a, seq=1, rank=0, chunk=chunks[1]), 504)
            assert timeout["error"] == "ChunkTimeout"
            assert (timeout["engine"], timeout["stage"], timeout["budget_s"]) == ("ref0", "load_chunk", 3.0)
            assert "'ref0'" in timeout["message"] and "did not consume" in timeout["message"]
            session = (await node.client.status())["weight_session"]
            assert session["state"] == "failed" and session["tainted"] == ["ref0"]
            probe = await _blocked_generation(node.engine_url)

            model, named = _model(seed=5)
            # No engine tells one session's chunk from another's: while the old session's load is on its way,
            # the next session does not open (409 naming the engine), and nothing changed.
            busy = await _refused(node.client.open_session("good", step=1, ranks=1, manifest=manifest_of(named)), 409)
            assert "'ref0'" in busy["message"] and sid_a in busy["message"], busy
            proxies[0].release.set()  # the old session's chunk reaches the engine now, before the next session
            async with asyncio.timeout(DEADLINE_S):
                await proxies[0].late_answered.wait()
            async with asyncio.timeout(DEADLINE_S):
                while True:  # the daemon sees the engine's answer a moment after the proxy sent it
                    try:
                        opened = await node.client.open_session("good", step=1, ranks=1, manifest=manifest_of(named))
                        break
                    except ColocdHTTPError as exc:
                        if exc.status != 409:
                            raise
                        await asyncio.sleep(0.05)
            sid = opened["session_id"]
            sent, _ = await WeightPusher(node.client, bucket_mb=0.05).stream(sid, named)
            await node.client.commit(sid, sent)
            await node.client.phase("rollout", 1)
            assert await served_checksums(node.engine_url) == [weights_checksum(named)]
            assert await asyncio.wait_for(probe, DEADLINE_S) == _local_greedy(model)
        finally:
            proxies[0].release.set()
            for chunk in chunks:
                chunk.release()


# --- caller mistakes: 4xx before any engine call, nothing changed -------------------------------------


async def test_unreadable_chunk_handles_are_422_before_any_engine_call(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1, loads_shm=True) as node:
        model, named = _model(seed=5)
        probe = await _blocked_generation(node.engine_url)
        sid = (await node.client.open_session("v1", step=1, ranks=1, manifest=manifest_of(named)))["session_id"]
        (good,) = _export(named[:2], transport="shm", bucket_bytes=1 << 30)
        layout = good.handle["layout"]
        wrong_shape = [{**layout[0], "shape": [3, 3]}, *layout[1:]]
        past_end = [{**layout[0], "offset": good.nbytes}, *layout[1:]]
        unknown = [{**layout[0], "name": "model.not_a_parameter"}, *layout[1:]]
        bad: list[tuple[dict[str, Any], int, str]] = [
            ({"shm_name": "../../etc/passwd"}, good.nbytes, "handle.shm_name"),
            ({"shm_name": "colocd-no-such-segment"}, good.nbytes, "handle.shm_name"),
            ({}, 10**12, "nbytes"),
            ({"layout": past_end}, good.nbytes, "handle.layout"),
            ({"layout": unknown}, good.nbytes, "handle.layout"),
            ({"layout": wrong_shape}, good.nbytes, "handle.layout"),
            ({"layout": "not a list"}, good.nbytes, "handle.layout"),
        ]
        try:
            before = await node.client.status()
            for change, nbytes, expected_field in bad:
                chunk = ExportedPart("shm", nbytes, {**good.handle, **change}, good.layout)
                refused = await _refused(node.client.send_chunk(sid, seq=0, rank=0, chunk=chunk), 422)
                assert expected_field in str(refused), (change, refused)
            after = await node.client.status()
            assert after["engines"] == before["engines"]
            assert after["weight_session"]["state"] == "open" and after["weight_session"]["chunks_consumed"] == 0
        finally:
            good.release()
        await node.client.abort(sid)
        assert (await _engine_state(node.client))["weights"] == "stale"  # it was before: released in train
        await _finish_with(node, model, named, probe)


async def test_a_chunk_the_engine_refuses_is_422_with_its_words_and_the_engine_stays_paused(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1) as node:
        model, named = _model(seed=5)
        probe = await _blocked_generation(node.engine_url)
        sid = (await node.client.open_session("v1", step=1, ranks=1))["session_id"]  # no manifest to check against
        (chunk,) = _export([("model.not_a_parameter", torch.zeros(4))], bucket_bytes=1 << 30)
        try:
            refused = await _refused(node.client.send_chunk(sid, seq=0, rank=0, chunk=chunk), 422)
        finally:
            chunk.release()
        assert refused["error"] == "PayloadRejected" and refused["engine"] == "ref0"
        assert "unknown parameter 'model.not_a_parameter'" in refused["message"]
        assert (await node.client.status())["weight_session"]["state"] == "failed"
        engine = await _engine_state(node.client)
        assert (engine["generation"], engine["weights"]) == ("paused", "stale")
        await _refused(node.client.phase("rollout", 1), 409)
        await _finish_with(node, model, named, probe)


async def test_sequence_mistakes_are_422_naming_them_and_leave_the_session_open(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1) as node:
        model, named = _model(seed=5)
        probe = await _blocked_generation(node.engine_url)
        sid = (await node.client.open_session("good", step=1, ranks=1, depth=2,
                                              manifest=manifest_of(named)))["session_id"]
        (ahead,) = _export(named[:1], bucket_bytes=1 << 30)
        try:
            gap = await _refused(node.client.send_chunk(sid, seq=5, rank=0, chunk=ahead), 422)
        finally:
            ahead.release()
        assert gap["field"] == "seq" and "chunk 5" in gap["message"] and "has not sent chunk 0" in gap["message"]

        pusher = WeightPusher(node.client, bucket_mb=0.05, depth=2)
        sent, _ = await pusher.stream(sid, named)
        wrong = await _refused(node.client.commit(sid, sent + 3), 422)
        assert wrong["field"] == "num_chunks" and f"engines consumed {sent}" in wrong["message"]
        assert (await node.client.status())["weight_session"]["state"] == "open"

        await node.client.commit(sid, sent)
        await node.client.phase("rollout", 1)
        assert await served_checksums(node.engine_url) == [weights_checksum(named)]
        assert await asyncio.wait_for(probe, DEADLINE_S) == _local_greedy(model)


async def test_a_committed_session_refuses_chunks_and_commit_with_410_and_abort_with_409(
        pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, synced_at=1) as node:
        model, named = _model(seed=5)
        report = await WeightPusher(node.client, bucket_mb=0.05).push(named, version="good", step=1)
        before = await node.client.status()
        (extra,) = _export(named[:1], bucket_bytes=1 << 30)
        try:
            sid = report.session_id
            late = await _refused(node.client.send_chunk(sid, seq=report.chunks, rank=0, chunk=extra), 410)
        finally:
            extra.release()
        assert late["session_state"] == "committed"
        again = await _refused(node.client.commit(report.session_id, report.chunks), 410)
        assert again["session_state"] == "committed"
        assert "cannot be aborted" in (await _refused(node.client.abort(report.session_id), 409))["message"]
        after = await node.client.status()
        assert after["engines"] == before["engines"] and after["weight_session"] == before["weight_session"]
        metrics = await node.client.metrics()
        assert 'colocd_weight_sessions_total{outcome="committed"} 1.0' in metrics
        assert 'colocd_weight_sessions_total{outcome="aborted"} 0.0' in metrics  # declared at 0, never counted
        await node.client.phase("rollout", 1)
        assert await served_checksums(node.engine_url) == [weights_checksum(named)]
        assert await _greedy(node.engine_url) == _local_greedy(model)


@pytest.fixture(autouse=True)
def _no_leaked_segments() -> Any:
    mine = f"colocd-{os.getpid()}-"
    yield
    assert not shm_segments(mine), "this test left shared-memory segments behind"


# --- engines that cannot list their parameters (SGLang): the last complete push is the reference ---------


class UnlistedEngine(InMemoryEngine):
    """An engine adapter that, like SGLang, cannot say what its parameters are; loads always succeed."""

    incarnation = "unlisted-0"  # the same process throughout


async def test_without_a_parameter_list_the_first_push_after_a_discard_must_match_the_last_complete_one(
        tmp_path: Any) -> None:
    journal = str(tmp_path / "journal.jsonl")
    _, named = _model(seed=5)
    full = manifest_of(named)
    # A CUDA-IPC pickle the daemon cannot look into: its layout says which tensors it holds.
    handle = {"payload_b64": "", "layout": ChunkLayout.for_tensors(named).to_json()}

    async def step(daemon: Daemon, s: int) -> None:
        await daemon.transitions.transition(NodePhase.TRAIN, s)
        await daemon.transitions.transition(NodePhase.SYNC, s)

    async with in_process_daemon({"e0": UnlistedEngine("e0")}, journal=journal) as daemon:
        await step(daemon, 1)
        first = await daemon.sessions.open(step=1, version="v1", ranks=1, manifest=full)
        await daemon.sessions.submit_chunk(first.id, 0, chunk_part(0, "cuda_ipc", 8, handle))
        await daemon.sessions.commit(first.id, 1)  # nothing to compare with yet: recorded as complete
        await daemon.transitions.transition(NodePhase.ROLLOUT, 1)
        await step(daemon, 2)
        first_missing = min(n for n, _ in named[10:])  # messages list names in sorted order
        with pytest.raises(RequestInvalid, match=rf"missing {first_missing!r}") as err:
            await daemon.sessions.open(step=2, version="v2", ranks=1, manifest=full[:10])
        assert err.value.field == "manifest"

    async with in_process_daemon({"e0": UnlistedEngine("e0")}, journal=journal) as restarted:
        with pytest.raises(RequestInvalid, match=rf"\({len(named) - 10} in all\)"):
            await restarted.sessions.open(step=2, version="v2", ranks=1, manifest=full[:10])
        assert (await restarted.sessions.open(step=2, version="v2", ranks=1, manifest=full)).manifest is not None


class InlineOnlyEngine(UnlistedEngine):
    """Loads only ``inline`` chunks, as a real SGLang on CPU does; counts every load it is asked for."""

    transports = frozenset({Transport.INLINE})

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.loads = 0

    async def load_weights(self, load: ChunkLoad) -> None:
        self.loads += 1


async def test_a_chunk_by_a_transport_the_engine_does_not_load_is_refused_before_any_engine_call(
        tmp_path: Any) -> None:
    engine = InlineOnlyEngine("e0")
    _, named = _model(seed=6)
    async with in_process_daemon({"e0": engine}) as daemon:
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
        await daemon.transitions.transition(NodePhase.SYNC, 1)
        session = await daemon.sessions.open(step=1, version="v1", ranks=1)
        assert session.transports() == (Transport.INLINE,)
        with pytest.raises(RequestInvalid, match=r"travels by disk.*'e0' does not load \(it accepts: inline\)") as err:
            await daemon.sessions.submit_chunk(session.id, 0,
                                               chunk_part(0, Transport.DISK, 8, {"path": "/etc/hostname"}))
        assert err.value.field == "transport" and engine.loads == 0
        chunk = Producer("inline").export(named)  # what the engine loads: accepted, and the session goes on
        await daemon.sessions.submit_chunk(session.id, 0, chunk_part(0, Transport.INLINE, chunk.nbytes, chunk.handle))
        assert engine.loads == 1


async def test_a_first_chunk_refused_before_it_is_accepted_leaves_its_rank_unjoined(tmp_path: Any) -> None:
    engine = InlineOnlyEngine("e0")
    async with in_process_daemon({"e0": engine}) as daemon:
        await daemon.transitions.transition(NodePhase.TRAIN, 1)
        await daemon.transitions.transition(NodePhase.SYNC, 1)
        session = await daemon.sessions.open(step=1, version="v1", ranks=1)
        before = session.stats()
        with pytest.raises(RequestInvalid) as err:  # the rank never joined: this chunk would have joined it
            await daemon.sessions.submit_chunk(session.id, 0,
                                               chunk_part(0, Transport.DISK, 8, {"path": "/etc/hostname"}))
        assert err.value.field == "transport"
        assert session.stats() == before
