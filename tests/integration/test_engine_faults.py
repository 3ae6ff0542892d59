"""Engine faults leave the daemon's record right and the error clear (issue 5, item 6).

A real reference engine process runs behind ``FaultProxy``, a small ASGI app on loopback that
forwards every request and, for one route, answers with a fault a given number of times: an HTTP
500, SGLang's 400 "not idle" flush refusal, or no answer at all. The daemon is configured with the
proxy's URL and small per-step budgets.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from support import (
    Receive,
    Scope,
    Send,
    daemon_node,
    reference_engine,
    request_body,
    restartable_engine,
    serve_lifespan,
    served_checksums,
    weights_checksum,
)

from colocd.api.client import ColocdHTTPError
from colocd.engines.reference.launcher import ReferenceEngineProcess

DEADLINE_S = 60
pytestmark = pytest.mark.timeout(DEADLINE_S)  # a hung engine call fails its test, not the run
# SGLang's answers, as its http_server.py shapes them: a tokenizer-side exception is an
# ``{"error": {"message"}}`` body (http_server.py:2246); a refused flush is 400 text (http_server.py:1025).
ENGINE_500 = b'{"error": {"message": "RuntimeError: CUDA error: an illegal memory access was encountered"}}'
FLUSH_400 = b"Cache not flushed: requests are running or waiting.\n"


@dataclass
class Fault:
    """What the proxy answers instead of forwarding: a status and body, or (``hang``) nothing until released;
    ``forward``: the request reaches the engine first, so the engine acts and only its answer is lost."""

    remaining: int
    status: int = 500
    body: bytes = b""
    content_type: bytes = b"application/json"
    hang: bool = False
    forward: bool = False


class FaultProxy:
    """An ASGI app forwarding everything to ``upstream``, except the faults injected per path."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.rstrip("/")
        self.calls: Counter[str] = Counter()  # requests seen per path, faulted or forwarded
        self.hanging = asyncio.Event()  # set once a request is being held
        self._released = asyncio.Event()
        self._faults: dict[str, Fault] = {}
        self._http = httpx.AsyncClient(trust_env=False, timeout=30)

    def inject(self, path: str, fault: Fault) -> None:
        self._faults[path] = fault

    def heal(self) -> None:
        """The engine recovers: forward everything from now on."""
        self._faults.clear()

    def release(self) -> None:
        """Let held requests finish (a 503), so that the server can shut down."""
        self._released.set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send, self._http.aclose)
            return
        path = scope["path"]
        self.calls[path] += 1
        body = await request_body(receive)
        fault = self._faults.get(path)
        if fault is not None and fault.remaining > 0:
            fault.remaining -= 1
            if fault.forward:
                await self._forward(scope, body)
            if fault.hang:
                self.hanging.set()
                await self._released.wait()
                status, content_type, content = 503, b"text/plain", b"released at teardown"
            else:
                status, content_type, content = fault.status, fault.content_type, fault.body
        else:
            status, content_type, content = await self._forward(scope, body)
        await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", content_type)]})
        await send({"type": "http.response.body", "body": content})

    async def _forward(self, scope: Scope, body: bytes) -> tuple[int, bytes, bytes]:
        query = scope["query_string"].decode()
        headers = {k.decode(): v.decode() for k, v in scope["headers"] if k in (b"content-type", b"authorization")}
        url = self.upstream + scope["path"] + (f"?{query}" if query else "")
        response = await self._http.request(scope["method"], url, content=body, headers=headers)
        return response.status_code, response.headers.get("content-type", "").encode(), response.content


def record(status: dict[str, Any]) -> tuple[Any, ...]:
    """The daemon's record of ref0 in one comparable tuple: node phase/step, generation, weights, tags."""
    engine = status["engines"]["ref0"]
    return (status["node"]["phase"], status["node"]["step"], engine["generation"], engine["weights"],
            tuple(sorted(engine["tags"].items())))


RESIDENT = (("cuda_graph", "resident"), ("kv_cache", "resident"), ("weights", "resident"))


async def test_release_answered_500_is_502_naming_engine_and_route_and_a_retry_succeeds_once_it_recovers(
        pooled_engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=FaultProxy) as n:
        n.front.inject("/release_memory_occupation", Fault(remaining=1, status=500, body=ENGINE_500))
        with pytest.raises(ColocdHTTPError) as err:
            await n.client.phase("train", 1)
        body = err.value.body
        assert err.value.status == 502 and body["engine"] == "ref0", body
        assert "'ref0'" in body["message"] and "release_memory_occupation" in body["message"]
        assert "HTTP 500" in body["message"] and "illegal memory access" in body["message"]
        # Paused (that step succeeded), nothing released: the record matches the engine's own account.
        assert record(await n.client.status()) == ("rollout", 0, "paused", "clean", RESIDENT)
        assert set((await n.engine_memory()).values()) == {True}

        n.front.heal()
        reply = await n.client.phase("train", 1)
        assert set(reply["engines"]["ref0"]["tags"].values()) == {"released"}
        assert set((await n.engine_memory()).values()) == {False}
        assert n.front.calls["/release_memory_occupation"] == 2
        assert n.front.calls["/pause_generation"] == 1  # the retry did not pause twice


async def test_flush_refused_a_few_times_is_retried_with_backoff_and_the_transition_succeeds(
        pooled_engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=FaultProxy, timeouts={"flush_s": 10}) as n:
        n.front.inject("/flush_cache", Fault(remaining=3, status=400, body=FLUSH_400, content_type=b"text/plain"))
        reply = await n.client.phase("train", 1)
        assert set(reply["engines"]["ref0"]["tags"].values()) == {"released"}
        assert n.front.calls["/flush_cache"] == 4
        flush = next(s for s in reply["trace"]["spans"] if s["name"] == "flush_cache")
        assert flush["ok"] and flush["duration_s"] >= 0.01 + 0.02 + 0.04  # three growing waits, not a hot loop


async def test_flush_that_never_succeeds_is_504_naming_flush_cache_and_its_budget_and_only_the_pause_happened(
        pooled_engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=FaultProxy, timeouts={"flush_s": 0.5}) as n:
        n.front.inject("/flush_cache", Fault(remaining=10**6, status=400, body=FLUSH_400, content_type=b"text/plain"))
        with pytest.raises(ColocdHTTPError) as err:
            await n.client.phase("train", 1)
        body = err.value.body
        assert err.value.status == 504, body
        assert (body["engine"], body["stage"], body["budget_s"]) == ("ref0", "flush_cache", 0.5)
        assert "'ref0'" in body["message"] and "flush_cache exceeded its 0.5s budget" in body["message"]
        assert record(await n.client.status()) == ("rollout", 0, "paused", "clean", RESIDENT)
        assert n.front.calls["/release_memory_occupation"] == 0
        assert n.front.calls["/flush_cache"] > 3  # retried, with waits in between

        n.front.heal()
        assert (await n.client.phase("train", 1))["phase"] == "train"


async def test_engine_hanging_on_a_call_is_504_naming_the_stage_and_budget_while_the_daemon_keeps_serving(
        pooled_engine: ReferenceEngineProcess) -> None:
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=FaultProxy, timeouts={"pause_s": 0.5}) as n:
        n.front.inject("/pause_generation", Fault(remaining=1, hang=True))
        train = asyncio.ensure_future(n.client.phase("train", 1))
        await n.front.hanging.wait()
        status = await n.client.status()  # answered while the engine call hangs
        assert status["busy_with"] == "train@1"
        with pytest.raises(ColocdHTTPError) as err:
            await train
        body = err.value.body
        assert err.value.status == 504, body
        assert (body["engine"], body["stage"], body["budget_s"]) == ("ref0", "pause_generation", 0.5)
        assert "pause_generation exceeded its 0.5s budget" in body["message"]
        after = await n.client.status()
        assert after["busy_with"] is None
        assert record(after) == ("rollout", 0, "serving", "clean", RESIDENT)  # the pause was never confirmed
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{n.url}/healthz")).status_code == 200
        assert (await n.client.phase("train", 1))["phase"] == "train"  # the engine answers again


@pytest.mark.parametrize(("stage", "before", "phase", "weights_now"), [
    ("resume_memory", ["train"], "sync", True),  # sync resumes the weights train released
    ("release_memory", [], "train", False),  # a second release would kill SGLang
], ids=["resume", "release"])
async def test_a_memory_call_whose_answer_is_lost_leaves_the_memory_unknown_the_engine_unready_and_no_blind_retry(
        pooled_engine: ReferenceEngineProcess, stage: str, before: list[str], phase: str, weights_now: bool) -> None:
    route = f"/{stage}_occupation"
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=FaultProxy,
                           timeouts={"resume_s": 0.5, "release_s": 0.5}) as n:
        for earlier in before:
            await n.client.phase(earlier, 1)
        n.front.inject(route, Fault(remaining=1, hang=True, forward=True))
        with pytest.raises(ColocdHTTPError) as err:
            await n.client.phase(phase, 1)
        assert err.value.status == 504 and err.value.body["stage"] == stage, err.value.body
        assert (await n.engine_memory())["weights"] is weights_now  # the engine did act

        async with httpx.AsyncClient(trust_env=False) as http:
            readyz = await http.get(f"{n.url}/readyz")
        assert readyz.status_code == 503
        (problem,) = readyz.json()["problems"]
        assert "'ref0'" in problem and stage in problem and "unknown" in problem, problem
        ref0 = (await n.client.status())["engines"]["ref0"]
        assert set(ref0["tags"].values()) == {"unknown"} and stage in ref0["memory_unknown"], ref0

        with pytest.raises(ColocdHTTPError) as again:
            await n.client.phase(phase, 1)
        assert again.value.status == 409 and "unknown" in again.value.body["message"], again.value.body
        assert n.front.calls[route] == 1  # not sent again blindly


async def test_an_engine_restarted_after_its_memory_became_unknown_is_ready_again_and_the_next_step_passes() -> None:
    """The way out of an unknown memory state is an engine restart: no call by hand, and the next full step passes
    with the trainer's weights served."""
    from colocd.engines.reference.model import QwenLikeConfig, build_model
    from colocd.trainer.push import WeightPusher

    async with (restartable_engine() as engine,
                daemon_node({"ref0": engine.url}, via=FaultProxy,
                            timeouts={"resume_s": 0.5, "health_interval_s": 0.1}) as n):
        await n.client.phase("train", 1)
        n.front.inject("/resume_memory_occupation", Fault(remaining=1, hang=True, forward=True))
        with pytest.raises(ColocdHTTPError) as err:
            await n.client.phase("sync", 1)
        assert err.value.status == 504 and await n.client.ready() is False

        await engine.restart(drivable=True)
        deadline = asyncio.get_running_loop().time() + 30
        while not await n.client.ready():
            assert asyncio.get_running_loop().time() < deadline, (await n.client.status())["engines"]["ref0"]
            await asyncio.sleep(0.05)  # polling the daemon's readiness with a deadline
        assert (await n.client.status())["engines"]["ref0"]["memory_unknown"] is None

        named = list(build_model(QwenLikeConfig(), seed=7).named_parameters())
        await n.client.phase("sync", 1)
        await WeightPusher(n.client, bucket_mb=0.05).push(named, version="v1", step=1)
        await n.client.phase("rollout", 1)
        assert await served_checksums(engine.url) == [weights_checksum(named)]
        assert n.front.calls["/resume_memory_occupation"] >= 2  # the restarted engine was resumed by the sync


async def test_status_says_unknown_for_what_it_cannot_know_of_an_engine_that_stopped_answering() -> None:
    # Its own engine: it dies. What status said before is kept as last_known; nothing of it is claimed as now.
    async with (reference_engine() as engine,
                daemon_node({"ref0": str(engine.url)}, via=FaultProxy, timeouts={"health_interval_s": 0.05}) as n):
        assert (await n.client.status())["engines"]["ref0"]["weights"] == "clean"
        assert engine.process is not None
        await engine.process.stop(grace_s=0.1)
        while (ref0 := (await n.client.status())["engines"]["ref0"])["healthy"]:  # noqa: ASYNC110 - the health
            await asyncio.sleep(0.05)  # loop's next tick, bounded by the test's deadline
        assert (ref0["generation"], ref0["weights"], ref0["weight_version"]) == ("unknown", "unknown", None), ref0
        assert set(ref0["tags"].values()) == {"unknown"}, ref0
        assert ref0["last_known"]["generation"] == "serving" and ref0["last_known"]["weights"] == "clean", ref0


async def test_right_after_a_chunk_failed_on_a_dead_engine_status_says_the_engine_is_unhealthy() -> None:
    from colocd.engines.reference.model import QwenLikeConfig, build_model
    from colocd.trainer.push import WeightPusher

    # Its own engine: it dies. No health tick in this test: what status says came from the failure.
    async with (reference_engine() as engine,
                daemon_node({"ref0": str(engine.url)}, via=FaultProxy, timeouts={"health_interval_s": 600}) as n):
        await n.client.phase("train", 1)
        await n.client.phase("sync", 1)
        assert (await n.client.status())["engines"]["ref0"]["healthy"] is True
        session = (await n.client.open_session("v1", step=1, ranks=1))["session_id"]
        assert engine.process is not None
        await engine.process.stop(grace_s=0.1)  # the engine dies with the session open: its first chunk fails
        with pytest.raises(ColocdHTTPError) as failed:
            await WeightPusher(n.client, bucket_mb=0.05).stream(
                session, list(build_model(QwenLikeConfig(), seed=1).named_parameters()))
        assert failed.value.status in (502, 503), failed.value.body
        ref0 = (await n.client.status())["engines"]["ref0"]
        assert ref0["healthy"] is False and ref0["last_error"]
        assert await n.client.ready() is False


async def test_a_failed_transition_is_left_to_the_trainer_not_retried_by_the_health_loop(
        pooled_engine: ReferenceEngineProcess) -> None:
    """The desired state of a step holds for that step's sync only: once it failed, the record (what the engine
    is) is what every health tick drives toward, so the engine stays as the failure left it until asked again."""
    async with daemon_node({"ref0": str(pooled_engine.url)}, via=FaultProxy, timeouts={"health_interval_s": 0.05}) as n:
        n.front.inject("/release_memory_occupation", Fault(remaining=1, status=500, body=ENGINE_500))
        with pytest.raises(ColocdHTTPError):
            await n.client.phase("train", 1)
        n.front.heal()
        n.front.calls = ticks = _CallsUntil(n.front.calls, more=20)  # several health ticks, each observing
        await ticks.reached.wait()  # bounded by the test's deadline
        assert n.front.calls["/release_memory_occupation"] == 1
        assert record(await n.client.status()) == ("rollout", 0, "paused", "clean", RESIDENT)
        assert set((await n.engine_memory()).values()) == {True}


class _CallsUntil(Counter[str]):
    """The proxy's call counts, with an event set once ``more`` calls came after ``start``."""

    def __init__(self, start: Counter[str], *, more: int) -> None:
        super().__init__(start)
        self._target = start.total() + more
        self.reached = asyncio.Event()

    def __setitem__(self, path: str, count: int) -> None:
        super().__setitem__(path, count)
        if self.total() >= self._target:
            self.reached.set()
