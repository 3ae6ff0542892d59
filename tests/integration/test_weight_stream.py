"""The weight stream: multi-rank gather, the in-flight window, abort, timeouts, transports, the benchmark.

The gather and window rules are exercised on ``WeightSession`` with in-memory engines (exact
control over when each load finishes); the transports and the HTTP path against real reference
engine processes and an in-process daemon on loopback.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from support import EnginePool, chunk_part, daemon_node, served_checksums, shm_segments, weights_checksum

from benchmarks.weights import BenchSettings, run_weights_bench
from colocd.api.client import ColocdHTTPError
from colocd.daemon.metrics import Metrics
from colocd.daemon.states import EngineRecord, SessionState
from colocd.daemon.trace import Trace
from colocd.daemon.weights import WeightSession
from colocd.daemon.worker import EngineHandle
from colocd.engines.base import ChunkLoad, ChunkPart
from colocd.engines.chunks import ChunkLayout, SharedSegment
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.engines.sglang.adapter import _load_format
from colocd.errors import ChunkTimeout, EngineRejected, PayloadRejected, RequestInvalid, SessionGone, WeightSyncError
from colocd.policies import Transport
from colocd.trainer.push import WeightPusher

# --- WeightSession against in-memory engines -----------------------------------------------------


class FakeEngine:
    """An in-memory engine adapter: records every load; with ``gated`` each load waits for its release."""

    transports = frozenset(Transport)  # it reads no payload, so any transport will do

    def __init__(
        self,
        name: str,
        *,
        tp: int = 1,
        gated: bool = False,
        fail_at: int | None = None,
        gpu_uuids: list[str] | None = None,
    ) -> None:
        self.name, self.tp, self.gated, self.fail_at = name, tp, gated, fail_at
        self.gpu_uuids = gpu_uuids or []
        self.loads: list[tuple[int, tuple[int, ...], tuple[str, ...]]] = []
        self.started: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.release: defaultdict[int, asyncio.Event] = defaultdict(asyncio.Event)
        self.cancelled: list[int] = []
        self.active = self.max_active = 0

    async def load_weights(self, load: ChunkLoad) -> None:
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        self.started[load.seq].set()
        try:
            if self.gated:
                await self.release[load.seq].wait()
            if load.seq == self.fail_at:
                raise EngineRejected(self.name, f"update_weights_from_tensor#{load.seq}: boom", status=400)
            self.loads.append(
                (load.seq, tuple(p.rank for p in load.payloads), tuple(str(p.handle.wire.get("data"))
                                                                    for p in load.payloads))
            )
        except asyncio.CancelledError:
            self.cancelled.append(load.seq)
            raise
        finally:
            self.active -= 1


def _session(
    engines: list[FakeEngine],
    *,
    ranks: int,
    depth: int = 2,
    timeout_s: float = 10.0,
    sources: dict[str, tuple[int, ...]] | None = None,
    start_s: float | None = None,
    idle_s: float | None = None,
) -> WeightSession:
    handles = [
        EngineHandle(
            adapter=e,  # type: ignore[arg-type]
            state=EngineRecord(e.name),
            config=ReferenceEngineConfig(name=e.name, url="http://127.0.0.1:9", tp_size=e.tp, gpu_uuids=e.gpu_uuids),
        )
        for e in engines
    ]
    return WeightSession(
        step=1,
        version="v1",
        ranks=ranks,
        engines=handles,
        depth=depth,
        chunk_timeout_s=timeout_s,
        trace=Trace(1, "weights"),
        metrics=Metrics(),
        sources=sources,
        start_timeout_s=start_s,
        idle_s=idle_s,
    )


def _part(rank: int, seq: int, **handle: Any) -> ChunkPart:
    # cuda_ipc: a payload the daemon cannot look into (no segment), with the layout every chunk carries: chunk
    # seq holds tensor t<seq> on every rank.
    layout = [{"name": f"t{seq}", "dtype": "float32", "shape": [1], "offset": 0}]
    return chunk_part(rank=rank, transport="cuda_ipc", nbytes=100,
                      handle={"payload_b64": "", "layout": layout, "data": f"r{rank}c{seq}", **handle})


def _shm_part(rank: int, names: list[str]) -> ChunkPart:
    """A part whose layout the daemon reads (shm), in a segment of its own: it names the tensors it carries."""
    named = [(n, torch.zeros(4)) for n in names]
    layout = ChunkLayout.for_tensors(named)
    segment = SharedSegment.create(layout.nbytes)
    _SEGMENTS.append(segment)
    return chunk_part(rank=rank, transport="shm", nbytes=layout.nbytes,
                      handle={"shm_name": segment.name, "nbytes": layout.nbytes, "layout": layout.to_json()})


_SEGMENTS: list[SharedSegment] = []


@pytest.fixture(autouse=True)
def _unlink_segments() -> Iterator[None]:
    yield
    while _SEGMENTS:
        segment = _SEGMENTS.pop()
        segment.close()
        segment.unlink()


async def _settle() -> None:
    """Let every runnable task run until none can make progress (no timers involved)."""
    for _ in range(100):
        await asyncio.sleep(0)


async def test_each_engine_gets_every_chunk_once_in_order_from_the_ranks_it_needs() -> None:
    tp2, a, b = FakeEngine("tp2", tp=2), FakeEngine("a"), FakeEngine("b")
    session = _session([tp2, a, b], ranks=2, sources={"b": (1,)})

    acks = await asyncio.gather(*(session.submit(seq, _part(rank, seq)) for seq in range(6) for rank in (1, 0)))
    await session.drain(6)

    for engine in (tp2, a, b):
        assert [seq for seq, _, _ in engine.loads] == list(range(6)), engine.name
    assert tp2.loads[3] == (3, (0, 1), ("r0c3", "r1c3"))  # TP rank r gets trainer rank r's part
    assert a.loads[3] == (3, (0,), ("r0c3",))
    assert b.loads[3] == (3, (1,), ("r1c3",))
    assert {ack.engines for ack in acks if ack.rank == 0} == {("tp2", "a")}
    assert {ack.engines for ack in acks if ack.rank == 1} == {("tp2", "b")}
    stats = session.stats()
    assert stats["chunks_consumed"] == 6 and stats["open_chunks"] == []
    assert all(1 <= n <= 2 for n in stats["max_in_flight"].values())


async def test_window_is_respected_and_a_slow_engine_holds_back_every_rank() -> None:
    fast, slow = FakeEngine("fast"), FakeEngine("slow", gated=True)
    session = _session([fast, slow], ranks=1, depth=2)
    # A trainer that runs ahead: all six chunks submitted at once.
    tasks = [asyncio.create_task(session.submit(seq, _part(0, seq))) for seq in range(6)]
    await _settle()

    assert sorted(slow.started) == [0, 1] and slow.max_active == 2
    assert [seq for seq, _, _ in fast.loads] == [0, 1]  # the fast engine is held to the window too
    assert session.stats()["open_chunks"] == [0, 1]  # chunks 2.. are not even accepted yet
    assert not any(t.done() for t in tasks)  # no ack before the slow engine consumed the chunk

    slow.release[0].set()
    await _settle()
    assert tasks[0].done() and not tasks[1].done()
    assert sorted(slow.started) == [0, 1, 2] and session.stats()["open_chunks"] == [1, 2]

    for seq in range(1, 6):
        slow.release[seq].set()
    await asyncio.gather(*tasks)
    await session.drain(6)
    in_flight = session.stats()["max_in_flight"]
    assert in_flight["slow"] == 2 and in_flight["fast"] <= 2
    assert slow.max_active == 2 and [seq for seq, _, _ in slow.loads] == list(range(6))


async def test_a_rank_that_never_sends_its_part_times_out_naming_it() -> None:
    session = _session([FakeEngine("tp2", tp=2)], ranks=2, timeout_s=0.2)
    with pytest.raises(ChunkTimeout, match=r"waiting for chunk 0 from rank 1, which never sent it"):
        await session.submit(0, _part(0, 0))
    assert session.state is SessionState.FAILED
    with pytest.raises(SessionGone, match="is failed"):  # a chunk for a failed session: 410
        await session.submit(1, _part(1, 1))


async def test_a_missing_part_of_an_earlier_chunk_is_named_by_the_later_chunks_timeout() -> None:
    session = _session([FakeEngine("tp2", tp=2)], ranks=2, timeout_s=0.2)
    results = await asyncio.gather(
        session.submit(1, _part(1, 1)),
        session.submit(0, _part(0, 0)),
        session.submit(1, _part(0, 1)),
        return_exceptions=True,
    )
    assert all(isinstance(r, WeightSyncError | SessionGone) for r in results)
    assert any(isinstance(r, ChunkTimeout) and "chunk 0 from rank 1" in str(r) for r in results), results


async def test_a_rank_cannot_run_ahead_of_a_lagging_rank_and_the_wait_names_the_laggard() -> None:
    a, b = FakeEngine("a"), FakeEngine("b")  # rank 0 feeds a, rank 1 feeds b
    session = _session([a, b], ranks=2, depth=2, timeout_s=0.2, sources={"b": (1,)})
    acks = await asyncio.gather(session.submit(0, _part(0, 0)), session.submit(1, _part(0, 1)))
    assert [ack.engines for ack in acks] == [("a",), ("a",)]  # acked once its own engine consumed it
    with pytest.raises(ChunkTimeout, match=r"chunk 2 waits for the window \(2 chunks from chunk 0\): "
                                           r"engine 'b' is waiting for chunk 0 from rank 1, which never sent it"):
        await session.submit(2, _part(0, 2))
    assert [seq for seq, _, _ in a.loads] == [0, 1]


async def test_a_rank_that_feeds_no_engine_is_refused_and_the_commit_does_not_wait_for_it() -> None:
    engine = FakeEngine("a")  # tp 1: fed by rank 0 alone; rank 1 feeds nothing
    session = _session([engine], ranks=2, timeout_s=0.2)
    joined = await session.join(1, "cpu:1")
    assert joined.to_json()["streams"] is False and joined.feeds == ()
    with pytest.raises(RequestInvalid, match=r"rank 1 \(device 'cpu:1'\) feeds no engine TP rank"):
        await session.submit(0, _part(1, 0))  # no ack for bytes nobody loads
    ack = await session.submit(0, _part(0, 0))
    assert ack.engines == ("a",)
    await session.drain(1)
    assert session.state is SessionState.OPEN and [seq for seq, _, _ in engine.loads] == [0]


async def test_a_rank_that_has_not_started_is_waited_for_until_the_start_deadline_not_one_chunk_budget() -> None:
    session = _session([FakeEngine("tp2", tp=2)], ranks=2, timeout_s=0.1, start_s=5.0, idle_s=0.1)
    first = asyncio.create_task(session.submit(0, _part(0, 0)))
    await asyncio.sleep(0.4)  # the fault: rank 1 starts four chunk budgets (and idle limits) late
    assert not first.done() and session.start_overdue() is None and not session.expired()
    assert session.stats()["late_ranks"] == [1]
    await session.submit(0, _part(1, 0))
    assert (await first).engines == ("tp2",)
    await session.drain(1)


async def test_past_the_start_deadline_the_rank_that_never_started_is_named() -> None:
    session = _session([FakeEngine("tp2", tp=2)], ranks=2, timeout_s=0.1, start_s=0.3)
    with pytest.raises(ChunkTimeout, match=r"rank 1 did not start .* within start_s=0.3s") as err:
        await session.submit(0, _part(0, 0))
    assert (err.value.stage, err.value.rank, err.value.budget_s) == ("start", 1, 0.3)
    assert session.state is SessionState.FAILED


async def test_a_started_rank_that_stops_sending_gets_the_chunk_budget_not_the_start_deadline() -> None:
    session = _session([FakeEngine("tp2", tp=2)], ranks=2, timeout_s=0.2, start_s=30.0)
    await asyncio.gather(session.submit(0, _part(0, 0)), session.submit(0, _part(1, 0)))
    with pytest.raises(ChunkTimeout, match=r"waiting for chunk 1 from rank 1, which never sent it") as err:
        await session.submit(1, _part(0, 1))
    assert err.value.stage == "gather"


async def test_chunks_from_ranks_that_carry_other_tensors_than_the_first_ranks_are_refused_naming_both() -> None:
    session = _session([FakeEngine("tp2", tp=2)], ranks=2)
    ok = asyncio.create_task(session.submit(0, _shm_part(0, ["a", "b"])))
    await _settle()
    with pytest.raises(RequestInvalid, match=r"chunk 0 from rank 1 carries other tensors than rank 0's chunk 0 "
                                             r"\(missing 'b', extra 'c'"):
        await session.submit(0, _shm_part(1, ["a", "c"]))
    assert session.state is SessionState.OPEN  # refused before it was accepted: rank 1 may send the right one
    await session.submit(0, _shm_part(1, ["a", "b"]))
    await ok


async def test_abort_fails_every_waiting_rank_and_quiesce_names_the_engine_whose_loads_it_abandoned() -> None:
    engine = FakeEngine("slow", gated=True)
    session = _session([engine], ranks=1, depth=2)
    tasks = [asyncio.create_task(session.submit(seq, _part(0, seq))) for seq in range(3)]
    await _settle()
    await session.abort("trainer gave up")
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, WeightSyncError | SessionGone) and "trainer gave up" in str(r) for r in results)
    assert session.state is SessionState.ABORTED
    await _settle()
    assert engine.cancelled == []  # the engine's calls are not abandoned by the abort itself
    assert await session.quiesce(0.05) == ["slow"]  # they never returned: the engine is tainted
    # ... and run on to the engine's answer, counted on the engine until then: no next session opens there
    # while one could still land (worker.late_loads).
    await _settle()
    assert engine.cancelled == [] and engine.loads == []
    (handle,) = session.engines
    assert sorted(handle.loads_in_flight.values()) == [session.id, session.id]
    for gate in engine.release.values():
        gate.set()
    await _settle()
    assert handle.loads_in_flight == {} and sorted(seq for seq, _, _ in engine.loads) == [0, 1]


async def test_quiesce_waits_for_a_load_that_returns_late() -> None:
    engine = FakeEngine("slow", gated=True)
    session = _session([engine], ranks=1, depth=1)
    task = asyncio.create_task(session.submit(0, _part(0, 0)))
    await _settle()
    await session.abort("trainer gave up")
    asyncio.get_running_loop().call_later(0.05, engine.release[0].set)
    assert await session.quiesce(5.0) == []  # returned within the budget: nothing tainted
    assert [seq for seq, _, _ in engine.loads] == [0] and engine.cancelled == []
    assert isinstance(await asyncio.gather(task, return_exceptions=True), list)


async def test_an_engine_that_stalls_past_the_budget_is_named_and_its_load_is_left_running_for_quiesce() -> None:
    engine = FakeEngine("stuck", gated=True)
    session = _session([engine], ranks=1, depth=1, timeout_s=0.2)
    with pytest.raises(ChunkTimeout, match=r"chunk 0: engine 'stuck' did not consume it within 0.2s"):
        await session.submit(0, _part(0, 0))
    assert session.state is SessionState.FAILED
    await _settle()
    assert engine.active == 1 and engine.cancelled == []  # the rank's timeout does not cancel the engine's call
    engine.release[0].set()
    assert await session.quiesce(5.0) == []  # it returned: nothing tainted
    assert [seq for seq, _, _ in engine.loads] == [0] and engine.cancelled == []


async def test_an_engine_failure_fails_the_session_for_every_rank() -> None:
    session = _session([FakeEngine("bad", fail_at=1)], ranks=1)
    results = await asyncio.gather(*(session.submit(s, _part(0, s)) for s in range(3)), return_exceptions=True)
    assert not isinstance(results[0], BaseException)
    # The engine answered 400 to the chunk: the caller's payload, 422 with the engine's words.
    assert isinstance(results[1], PayloadRejected) and "boom" in str(results[1]) and results[1].engine == "bad"
    assert session.state is SessionState.FAILED and "boom" in str(session.error)


async def test_a_chunk_from_another_gpu_is_refused_naming_the_unserved_gpu_and_loads_nothing() -> None:
    engine = FakeEngine("a", gpu_uuids=["GPU-aaaa"])
    session = _session([engine], ranks=1)
    # The rank joins with its first chunk, on the GPU its handle names; no rank is left for GPU-aaaa.
    with pytest.raises(RequestInvalid, match=r"engine 'a' TP rank 0 on device 'GPU-aaaa' has no trainer rank on it"):
        await session.submit(0, _part(0, 0, device_uuid="GPU-bbbb"))
    assert session.state is SessionState.OPEN and engine.loads == []
    assert (await session.submit(0, _part(0, 0, device_uuid="GPU-aaaa"))).seq == 0  # from the right GPU: loaded


async def test_a_gpu_uuid_matches_whether_spelled_as_nvml_or_as_torch_does() -> None:
    session = _session([FakeEngine("a", gpu_uuids=["GPU-58a8d8b1-AAAA"])], ranks=1)  # nvidia-smi's spelling
    joined = await session.join(0, "58a8d8b1-aaaa")  # torch's (and SGLang's): str(device_properties.uuid)
    assert joined.feeds == (("a", 0),)


async def test_with_an_explicit_mapping_a_handle_from_another_gpu_is_refused_naming_both() -> None:
    session = _session([FakeEngine("a", gpu_uuids=["GPU-aaaa"])], ranks=1, sources={"a": (0,)})
    with pytest.raises(WeightSyncError, match=r"GPU GPU-bbbb, but engine 'a' TP rank 0 runs on GPU GPU-aaaa"):
        await session.submit(0, _part(0, 0, device_uuid="GPU-bbbb"))
    assert session.state is SessionState.FAILED


def test_feed_ranks_name_one_distinct_trainer_rank_per_tp_rank() -> None:
    with pytest.raises(ValueError, match="feed_ranks has 1 entries for tp_size 2"):
        ReferenceEngineConfig(name="e", url="http://127.0.0.1:1", tp_size=2, feed_ranks=[0])
    with pytest.raises(ValueError, match="distinct"):
        ReferenceEngineConfig(name="e", url="http://127.0.0.1:1", tp_size=2, feed_ranks=[1, 1])
    assert ReferenceEngineConfig(name="e", url="http://127.0.0.1:1", tp_size=2, feed_ranks=[5, 4]).feed_ranks == [5, 4]


def test_each_transport_reaches_the_engine_in_its_load_format() -> None:
    def fmt(transport: str, **handle: Any) -> str | None:
        return _load_format(ChunkLoad(0, (chunk_part(0, transport, 1, {"payload_b64": "", **handle}),), 1))

    assert fmt("cuda_ipc", load_format="flattened_bucket") == "flattened_bucket"
    assert fmt("cuda_ipc", load_format="direct") is None  # SGLang's default: a list of (name, tensor)


# --- over HTTP, real reference engines ---------------------------------------------------------------


# Engine i on device cpu:i, fed by trainer rank i.
OWN_DEVICES = {"ref0": ["cpu:0"], "ref1": ["cpu:1"]}


def own_devices(engines: dict[str, str]) -> list[dict[str, Any]]:
    """The node config's entries for ``engines``, each on its device of ``OWN_DEVICES``."""
    return [{"kind": "reference", "name": n, "url": url, "device_ids": OWN_DEVICES[n]} for n, url in engines.items()]


async def test_two_ranks_stream_to_two_engines_every_tensor_once_byte_identical(engine_pool: EnginePool) -> None:
    model = build_model(QwenLikeConfig(), seed=7)
    named = list(model.named_parameters())
    segments_before = shm_segments()  # this process's own; a leak is what this test adds
    async with engine_pool.lent(ref0={}, ref1={}) as engines, daemon_node(own_devices(engines), synced_at=1) as node:
        client = node.client
        for transport, depth in (("inline", 2), ("inline", 1)):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.5)  # new values for each push: each must deliver its own bytes
            sid = (await client.open_session(f"v-{transport}", ranks=2, depth=depth))["session_id"]
            pushers = [WeightPusher(client, transport=transport, bucket_mb=0.02, depth=depth, rank=r) for r in (0, 1)]
            # Each trainer rank holds the full (replicated) tensors, as SGLang requires per GPU.
            (chunks, _), _ = await asyncio.gather(*(p.stream(sid, named) for p in pushers))
            commit = await client.commit(sid, chunks)

            for url in engines.values():
                assert await served_checksums(url) == [weights_checksum(named)], (transport, url)
            loads = defaultdict(list)
            for span in commit["trace"]["spans"]:
                if span["name"] == "load_chunk":
                    loads[span["engine"]].append(span["attrs"]["seq"])
            every_chunk_once = list(range(chunks))
            assert {e: sorted(s) for e, s in loads.items()} == {"ref0": every_chunk_once, "ref1": every_chunk_once}
            assert all(1 <= n <= depth for n in commit["max_in_flight"].values()), commit["max_in_flight"]
            assert commit["engines"]["ref1"]["weight_version"] == f"v-{transport}"
            assert commit["sources"] == {"ref0": [0], "ref1": [1]}  # each engine fed by the rank on its device
            for r, pusher in enumerate(pushers):
                assert pusher.last_join is not None
                assert pusher.last_join["feeds"] == [{"engine": f"ref{r}", "tp_rank": 0}]
                assert len(pusher.chunk_log) == chunks  # every rank was acked for every chunk it sent
    assert shm_segments() <= segments_before


@pytest.mark.parametrize("on_gpu", [{"device": "cuda:0"}, {"gpus": [0]}], ids=["device", "gpus"])
async def test_an_engine_whose_config_puts_it_on_a_gpu_it_names_no_uuid_of_is_fed_by_rank_position(
        engine_pool: EnginePool, on_gpu: dict[str, Any]) -> None:
    # SGLang reports no device identity: with no gpu_uuids the TP ranks' GPUs are unknown (never cpu:<rank>),
    # so the trainer rank joining on its GPU's UUID feeds TP rank 0 by position.
    async with engine_pool.lent(ref0={}) as engines, daemon_node(
            [{"kind": "reference", "name": "ref0", "url": engines["ref0"], **on_gpu}], synced_at=1) as node:
        sid = (await node.client.open_session("v-gpu", ranks=1))["session_id"]
        join = await node.client.join_session(sid, rank=0, device_id="GPU-728cdde1-58bf-b2cc-ddca-715e920e0518")
        assert join["streams"] and join["feeds"] == [{"engine": "ref0", "tp_rank": 0}], join
        await node.client.abort(sid)


async def test_a_session_opened_without_a_depth_takes_the_policys_even_for_a_model_smaller_than_one_bucket(
        engine_pool: EnginePool) -> None:
    # The policy's chunk count assumes its own 4 GiB buckets; ranks that choose smaller ones still get its overlap.
    named = list(build_model(QwenLikeConfig(), seed=8).named_parameters())
    async with engine_pool.lent(ref0={}) as engines, daemon_node(engines, synced_at=1) as node:
        client = node.client
        await WeightPusher(client, transport="inline", bucket_mb=0.02, depth=2).push(named, version="known-size")
        await client.phase("rollout", 1)
        await client.phase("train", 2)
        plan = (await client.phase("sync", 2))["directives"]["pipeline"]
        assert plan["depth"] == 1 and "depth capped at 1 chunks" in plan["reason"], plan  # the sync's size is known
        opened = await client.open_session("v-default-depth", ranks=1)
        join = await client.join_session(opened["session_id"], rank=0, device_id="cpu:0")
        assert opened["depth"] == join["depth"] == 2
        await client.abort(opened["session_id"])


async def test_a_pusher_deeper_than_the_session_keeps_within_the_window_its_join_reply_names(
        engine_pool: EnginePool, monkeypatch: pytest.MonkeyPatch) -> None:
    # The daemon refuses a chunk past the session's window (422 naming seq) when it arrives before the chunk
    # that would open the window; so the pusher must never have more outstanding than the session allows.
    named = list(build_model(QwenLikeConfig(), seed=6).named_parameters())
    async with engine_pool.lent(ref0={}) as engines, daemon_node(engines, synced_at=1) as node:
        client = node.client
        outstanding, most = 0, 0
        send_chunk = client.send_chunk

        async def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal outstanding, most
            outstanding += 1
            most = max(most, outstanding)
            try:
                return await send_chunk(*args, **kwargs)
            finally:
                outstanding -= 1

        monkeypatch.setattr(client, "send_chunk", counted)
        sid = (await client.open_session("v-window", ranks=1, depth=1))["session_id"]
        pusher = WeightPusher(client, transport="inline", bucket_mb=0.02, depth=4)
        chunks, _ = await pusher.stream(sid, named)
        assert pusher.last_join is not None and pusher.last_join["depth"] == 1
        assert chunks > 4 and most == 1
        await client.commit(sid, chunks)
        assert await served_checksums(engines["ref0"]) == [weights_checksum(named)]


def _abort_after(
    named: list[tuple[str, torch.Tensor]], n: int, reached: asyncio.Event
) -> Iterator[tuple[str, torch.Tensor]]:
    for i, item in enumerate(named):
        if i == n:
            reached.set()
        yield item


async def test_abort_mid_stream_keeps_the_old_version_paused_and_leaks_no_shared_memory(
        engine_pool: EnginePool) -> None:
    model = build_model(QwenLikeConfig(), seed=3)
    segments_before = shm_segments()  # this process's own; a leak is what this test adds
    async with engine_pool.lent(ref0={}) as engines, daemon_node(engines, synced_at=1) as node:
        client = node.client
        sid = (await client.open_session("v1", ranks=1, depth=2))["session_id"]
        reached = asyncio.Event()
        pusher = WeightPusher(client, transport="inline", bucket_mb=0.005, depth=2)
        stream = asyncio.create_task(pusher.stream(sid, _abort_after(list(model.named_parameters()), 12, reached)))
        await reached.wait()  # chunks are in flight when the trainer gives up
        aborted = await client.abort(sid)
        with pytest.raises(ColocdHTTPError) as err:
            await stream
        assert err.value.status == 410 and "aborted" in err.value.body["message"]
        assert aborted["state"] == "aborted"

        engine = (await client.status())["engines"]["ref0"]
        assert engine["weight_version"] == "default"
        assert engine["weights"] == "stale" and engine["generation"] == "paused"
        with pytest.raises(ColocdHTTPError) as err:
            await client.phase("rollout", 1)
        assert err.value.status == 409
    assert shm_segments() <= segments_before


async def test_a_chunk_whose_export_fails_aborts_the_session_naming_that_error_and_still_pulls_every_tensor(
        engine_pool: EnginePool) -> None:
    named = list(build_model(QwenLikeConfig(), seed=5).named_parameters())
    pulled: list[str] = []

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named:
            pulled.append(name)  # producing a tensor may be a collective the other ranks run too
            yield name, tensor

    async with engine_pool.lent(ref0={}) as engines, daemon_node(engines, synced_at=1) as node:
        sid = (await node.client.open_session("v1", ranks=1, depth=2))["session_id"]
        pusher = WeightPusher(node.client, transport="cuda_ipc", bucket_mb=0.005, depth=2)  # CPU tensors: no bucket
        with pytest.raises(ValueError, match="cuda_ipc needs a chunk's tensors on one CUDA device"):
            await pusher.stream(sid, tensors())
        assert pulled == [name for name, _ in named]
        session = await node.client.session(sid)
        assert session["state"] == "aborted" and "rank 0 stopped: ValueError" in session["error"], session


async def test_a_rank_that_never_streams_fails_the_commit_with_504_naming_it(engine_pool: EnginePool) -> None:
    model = build_model(QwenLikeConfig(), seed=4)
    segments_before = shm_segments()  # this process's own; a leak is what this test adds
    # ref1 runs on cpu:1, so it needs trainer rank 1, which never joins: past start_s the commit names it.
    async with engine_pool.lent(ref0={}, ref1={}) as engines, daemon_node(
            own_devices(engines), timeouts={"chunk_s": 0.5, "start_s": 1.0}, synced_at=1) as node:
        client = node.client
        sid = (await client.open_session("v1", ranks=2, depth=2))["session_id"]
        # Two chunks: within rank 0's window, so only the commit notices that rank 1 sent nothing.
        chunks, _ = await WeightPusher(client, bucket_mb=0.2, rank=0).stream(sid, list(model.named_parameters()))
        assert chunks == 2
        with pytest.raises(ColocdHTTPError) as err:
            await client.commit(sid, chunks)
        body = err.value.body
        assert err.value.status == 504 and (body["stage"], body["rank"]) == ("start", 1), body
        assert "rank 1 did not start" in body["message"] and "'cpu:1'" in body["message"]
        assert (await client.status())["engines"]["ref0"]["weights"] == "stale"
    assert shm_segments() <= segments_before


async def test_bench_weights_cpu_smoke_run_verifies_every_variant(tmp_path: Any) -> None:
    out = tmp_path / "bench.json"
    record = await run_weights_bench(
        BenchSettings(
            model="tiny",
            device="cpu",
            variants=("serial", "overlap2", "per_tensor"),
            bucket_mb=1,
            repeats=1,
            warmup=0,
            out=str(out),
        )
    )
    ran = {v["name"]: v for v in record["variants"]}
    assert ran["serial"]["verified"] and ran["overlap2"]["verified"]
    assert ran["per_tensor"]["skipped"] == "needs CUDA"
    # Measured in the same run: control per chunk.
    assert record["targets"]["control_variant"] == "serial" and record["targets"]["control_ms_per_chunk"] > 0
    parts = ran["overlap2"]["breakdown"]
    assert all(parts[call] > 0 for call in ("open.begin", "stream.load", "commit.end"))
    assert set(record["copy_kernels_s"]) == {"copy_", "_foreach_copy_", "copy_tensors"}
    assert ran["serial"]["chunks"] >= 5 and record["floor_s"] > 0
    assert out.exists() and "overlap_speedup_vs_serial" in record["targets"]
    # The verified commit (default sync.verify: full) checked every push; its costs are in the record.
    assert ran["serial"]["verification"]["engines"]["ref0"]["status"] == "unsupported"  # as SGLang: no digests
    assert record["digests"]["cpu_agrees"] and record["digests"]["trainer_digest_s"] > 0
