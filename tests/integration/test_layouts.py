"""Colocated layouts with real processes on CPU (issue 16): every engine TP rank is fed by the trainer rank on its
device, every rank learns what it feeds, what each rank sends is checked, and late ranks have a start deadline.

Four trainer rank processes (gloo; tests/layout_ranks.py) and six reference engine processes serve
the module: two TP=2 engines (``tp2a`` on cpu:0,1, ``tp2b`` on cpu:2,3) and four TP=1 engines (``tp1_<i>`` on
cpu:<i>), from tests/support.py's pool, reset after each test. Each test runs an in-process daemon over the
engines of its layout; trainer rank r declares ``cpu:<r>``.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import layout_ranks
import pytest
from support import DaemonNode, EnginePool, daemon_node, served_checksums, weights_checksum

from colocd.api.client import ColocdHTTPError
from colocd.trainer.push import manifest_of

DEADLINE_S = 120.0
WORLD = 4
ENGINES = {"tp2a": ["cpu:0", "cpu:1"], "tp2b": ["cpu:2", "cpu:3"],
           **{f"tp1_{i}": [f"cpu:{i}"] for i in range(4)}}


@pytest.fixture
async def engines(engine_pool: EnginePool) -> AsyncIterator[dict[str, str]]:
    """name → URL of each module engine (the module's pool: started at first use, reset after each test)."""
    async with engine_pool.lent(**{name: {"tp_size": len(devices), "launch": {"ready_timeout_s": DEADLINE_S}}
                                   for name, devices in ENGINES.items()}) as urls:
        yield urls


@dataclass
class Ranks:
    """The trainer rank processes; ``run`` sends one stream command to some of them and gathers the replies."""

    conns: list[Any]

    async def run(self, commands: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        for rank, command in commands.items():
            self.conns[rank].send(command)

        def reply(rank: int) -> dict[str, Any]:
            if not self.conns[rank].poll(DEADLINE_S):
                raise AssertionError(f"trainer rank {rank} did not reply within {DEADLINE_S}s")
            return dict(self.conns[rank].recv())

        replies = await asyncio.gather(*(asyncio.to_thread(reply, r) for r in commands))
        return dict(zip(commands, replies, strict=True))


@pytest.fixture(scope="module")
def ranks() -> Iterator[Ranks]:
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pipes = [ctx.Pipe() for _ in range(WORLD)]
    procs = [ctx.Process(target=layout_ranks.serve_rank, args=(r, WORLD, port, pipes[r][1]), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    conns = [ours for ours, _ in pipes]
    for r, conn in enumerate(conns):
        assert conn.poll(DEADLINE_S), f"trainer rank {r} did not start"
        assert conn.recv() == {"ready": r}
    try:
        yield Ranks(conns)
    finally:
        for conn in conns:
            conn.send(None)
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def layout(engines: dict[str, str], names: list[str]) -> list[dict[str, Any]]:
    """The node config's entries for the named module engines, each with its TP size and devices."""
    return [{"kind": "reference", "name": n, "url": engines[n], "tp_size": len(ENGINES[n]), "device_ids": ENGINES[n]}
            for n in names]


async def to_sync(n: DaemonNode, step: int = 1) -> None:
    await n.client.phase("train", step)
    await n.client.phase("sync", step)


async def open_session(n: DaemonNode, version: str, ranks: int, seed: int, *, step: int = 1) -> str:
    manifest = manifest_of(layout_ranks.trained_weights(seed))
    return str((await n.client.open_session(version, step=step, ranks=ranks, manifest=manifest))["session_id"])


async def rank_checksums(n: DaemonNode) -> dict[str, list[str]]:
    return {name: await served_checksums(url) for name, url in n.engine_urls.items()}


def stream(url: str, sid: str, rank: int, seed: int, mode: str = "sharded", **extra: Any) -> dict[str, Any]:
    return {"url": url, "session_id": sid, "seed": seed, "mode": mode, "device_id": f"cpu:{rank}", **extra}


async def push(n: DaemonNode, ranks: Ranks, count: int, seed: int, version: str, *, group: str = "world",
               mode: str = "sharded", step: int = 1) -> dict[int, dict[str, Any]]:
    """A complete push from ranks 0..count-1 at ``step``, committed and rolled out; every engine TP rank holds it.
    After a failed session the node is still in ``sync`` at that step: the push opens the next session there."""
    if (await n.client.status())["node"] != {"phase": "sync", "step": step}:
        await to_sync(n, step)
    sid = await open_session(n, version, count, seed, step=step)
    replies = await ranks.run({r: stream(n.url, sid, r, seed, mode, group=group)
                               for r in range(count)})
    assert all(reply["ok"] for reply in replies.values()), replies
    chunks = {reply["chunks"] for reply in replies.values()}
    assert len(chunks) == 1, replies  # the same chunk plan on every rank, streaming or not
    commit = await n.client.commit(sid, chunks.pop())
    await n.client.phase("rollout", step)
    want = weights_checksum(layout_ranks.trained_weights(seed))
    assert await rank_checksums(n) == {name: [want] * len(ENGINES[name]) for name in n.engine_urls}
    assert all(e["weight_version"] == version for e in commit["engines"].values())
    return replies


def feeds(reply: dict[str, Any]) -> list[str]:
    return [f"{f['engine']}/{f['tp_rank']}" for f in reply["join"]["feeds"]]


# --- the layouts, with no mapping in the config ------------------------------------------------------


async def test_four_ranks_feed_two_tp2_engines_each_tp_rank_from_the_rank_on_its_device(
        engines: dict[str, str], ranks: Ranks) -> None:
    async with daemon_node(layout(engines, ["tp2a", "tp2b"])) as n:
        replies = await push(n, ranks, 4, seed=1, version="4x2tp2")
    assert [feeds(replies[r]) for r in range(4)] == [["tp2a/0"], ["tp2a/1"], ["tp2b/0"], ["tp2b/1"]]
    assert all(reply["acked"] == list(range(reply["chunks"])) for reply in replies.values())


async def test_four_ranks_feed_four_tp1_engines_rank_r_feeding_engine_r(
        engines: dict[str, str], ranks: Ranks) -> None:
    async with daemon_node(layout(engines, [f"tp1_{i}" for i in range(4)])) as n:
        replies = await push(n, ranks, 4, seed=2, version="4x4tp1")
    assert [feeds(replies[r]) for r in range(4)] == [[f"tp1_{r}/0"] for r in range(4)]


async def test_two_ranks_feed_one_tp2_engine(engines: dict[str, str], ranks: Ranks) -> None:
    async with daemon_node(layout(engines, ["tp2a"])) as n:
        replies = await push(n, ranks, 2, seed=3, version="2x1tp2", group="pair")
    assert [feeds(replies[r]) for r in range(2)] == [["tp2a/0"], ["tp2a/1"]]


async def test_ranks_whose_device_carries_no_engine_rank_are_told_so_send_nothing_and_still_gather(
        engines: dict[str, str], ranks: Ranks) -> None:
    async with daemon_node(layout(engines, ["tp2a"])) as n:
        replies = await push(n, ranks, 4, seed=4, version="4x1tp2")  # ranks 2, 3 are on cpu:2, cpu:3
    for r in (2, 3):
        assert replies[r]["join"]["streams"] is False and replies[r]["join"]["feeds"] == []
        assert replies[r]["nbytes"] == 0 and replies[r]["acked"] == []  # no ack for bytes nobody loads
    assert replies[0]["nbytes"] > 0 and replies[0]["acked"]


async def test_an_explicit_mapping_in_the_node_config_overrides_the_device_rule(
        engines: dict[str, str], ranks: Ranks) -> None:
    names = [f"tp1_{i}" for i in range(4)]
    config = {"engines": [{"kind": "reference", "name": name, "url": engines[name], "feed_ranks": [3 - i]}
                          for i, name in enumerate(names)]}
    async with daemon_node(**config) as n:
        replies = await push(n, ranks, 4, seed=5, version="reversed", mode="replicated")
    assert [feeds(replies[r]) for r in range(4)] == [[f"tp1_{3 - r}/0"] for r in range(4)]


async def test_a_last_join_that_leaves_an_engine_device_unserved_is_refused_naming_it_and_changes_nothing(
        engines: dict[str, str]) -> None:
    async with daemon_node(layout(engines, [f"tp1_{i}" for i in range(4)])) as n:
        await to_sync(n)
        sid = await open_session(n, "unserved", 4, seed=6)
        for r in range(3):
            joined = await n.client.join_session(sid, rank=r, device_id=f"cpu:{r}")
            assert joined["feeds"] == [{"engine": f"tp1_{r}", "tp_rank": 0}]
        before = await n.client.status()
        with pytest.raises(ColocdHTTPError) as refused:
            await n.client.join_session(sid, rank=3, device_id="cpu:9")  # the last rank, on no engine's device
        assert refused.value.status == 422 and refused.value.body["field"] == "device_id"
        assert "engine 'tp1_3' TP rank 0 on device 'cpu:3' has no trainer rank" in refused.value.body["message"]
        after = await n.client.status()
        idle = {"idle_for_s": after["weight_session"]["idle_for_s"]}  # the session's idle clock ticks on its own
        assert after["weight_session"] == {**before["weight_session"], **idle}
        assert after["engines"] == before["engines"]
        # The rank may join again on the device it was meant to have: the session was not spent.
        joined = await n.client.join_session(sid, rank=3, device_id="cpu:3")
        assert joined["feeds"] == [{"engine": "tp1_3", "tp_rank": 0}]
        await n.client.abort(sid)


# --- what each rank sends is checked ---------------------------------------------------------------------


async def test_ranks_sending_disjoint_halves_are_refused_at_the_gather_and_the_engine_keeps_its_version(
        engines: dict[str, str], ranks: Ranks) -> None:
    async with daemon_node(layout(engines, ["tp2a"])) as n:
        await push(n, ranks, 2, seed=7, version="good", group="pair")
        await to_sync(n, 2)
        sid = await open_session(n, "halves", 2, seed=8, step=2)
        replies = await ranks.run({r: stream(n.url, sid, r, 8, "disjoint", of=2) for r in range(2)})
        # The second part of a chunk to arrive is refused (422); that rank aborts, and a rank still waiting sees 410.
        assert sorted({reply["status"] for reply in replies.values()}) in ([422], [410, 422]), replies
        message = next(reply["body"]["message"] for reply in replies.values() if reply["status"] == 422)
        assert "carries other tensors than rank" in message and "same chunk plan" in message
        engine = (await n.client.status())["engines"]["tp2a"]
        assert (engine["weight_version"], engine["generation"]) == ("good", "paused")
        with pytest.raises(ColocdHTTPError) as gone:
            await n.client.commit(sid, 1)
        assert gone.value.status == 410
        await push(n, ranks, 2, seed=9, version="after-halves", group="pair", step=2)


async def test_ranks_that_all_send_half_the_manifest_are_refused_at_commit_naming_each_tp_ranks_missing_tensors(
        engines: dict[str, str], ranks: Ranks) -> None:
    async with daemon_node(layout(engines, ["tp2a", "tp2b"])) as n:
        await push(n, ranks, 4, seed=10, version="good")
        await to_sync(n, 2)
        sid = await open_session(n, "half", 4, seed=11, step=2)
        replies = await ranks.run({r: stream(n.url, sid, r, 11, "half") for r in range(4)})
        assert all(reply["ok"] for reply in replies.values()), replies
        with pytest.raises(ColocdHTTPError) as refused:
            await n.client.commit(sid, replies[0]["chunks"])
        body = refused.value.body
        assert refused.value.status == 422 and body["field"] == "manifest"
        assert "never received" in body["message"]
        assert "TP rank 0 (device 'cpu:0', fed by trainer rank 0) lacks" in body["message"]
        assert "TP rank 1 (device 'cpu:1', fed by trainer rank 1) lacks" in body["message"]
        await n.client.abort(sid)
        for engine in (await n.client.status())["engines"].values():
            assert (engine["weight_version"], engine["generation"], engine["weights"]) == ("good", "paused", "stale")
        await push(n, ranks, 4, seed=12, version="after-half", step=2)


@pytest.mark.parametrize("transport", ["inline"])
async def test_ranks_streaming_disjoint_halves_to_their_own_engines_never_commit_on_any_transport(
        engines: dict[str, str], ranks: Ranks, transport: str) -> None:
    names = ["tp1_0", "tp1_1"]  # rank r feeds engine tp1_<r> alone; each engine needs the full manifest
    async with daemon_node(layout(engines, names)) as n:
        await push(n, ranks, 2, seed=20, version="good", group="pair")
        await to_sync(n, 2)
        sid = await open_session(n, "halves", 2, seed=21, step=2)
        replies = await ranks.run({r: stream(n.url, sid, r, 21, "disjoint", of=2, transport=transport)
                                   for r in range(2)})
        refusals = [reply["body"]["message"] for reply in replies.values() if reply.get("status") == 422]
        assert refusals and "carries other tensors than rank" in refusals[0], replies
        with pytest.raises(ColocdHTTPError) as gone:
            await n.client.commit(sid, 1)
        assert gone.value.status == 410  # the refused rank aborted it: nothing committed, nothing half-written
        for engine in (await n.client.status())["engines"].values():
            assert (engine["weight_version"], engine["generation"]) == ("good", "paused")
        await push(n, ranks, 2, seed=22, version="after-halves", group="pair", step=2)


async def test_a_rank_whose_chunk_is_refused_aborts_walks_its_gathers_and_every_rank_ends_with_the_named_error(
        engines: dict[str, str], ranks: Ranks) -> None:
    # The docs' FSDP recipe over four ranks (every tensor is an all-gather over all of them); ranks 1 and 2 feed
    # engines tp1_1 and tp1_2, ranks 0 and 3 feed nothing and only gather. Rank 1 sends its first tensor in the
    # wrong dtype: its first chunk is refused, and unless it runs every gather left, ranks 0 and 3 hang in one.
    names = ["tp1_1", "tp1_2"]
    async with daemon_node(layout(engines, names)) as n:
        await push(n, ranks, WORLD, seed=23, version="good")
        await to_sync(n, 2)
        sid = await open_session(n, "retyped", WORLD, seed=24, step=2)
        replies = await ranks.run({r: stream(n.url, sid, r, 24, retype_first=r == 1) for r in range(WORLD)})
        assert (replies[1]["status"], replies[1]["body"]["field"]) == (422, "handle.layout"), replies
        assert "chunk 0 from rank 1: layout disagrees with the manifest" in replies[1]["body"]["message"]
        for r in (0, 2, 3):  # told at its next chunk (rank 2) or at the end of its gathers (0, 3)
            assert replies[r]["status"] == 410, replies
            assert "rank 1 stopped" in replies[r]["body"]["message"]
            assert "layout disagrees with the manifest" in replies[r]["body"]["message"]
        session = (await n.client.status())["weight_session"]
        assert session["state"] == "aborted" and "rank 1 stopped" in session["error"]
        # Every rank ran every gather: the next push's collectives line up, and it commits.
        await push(n, ranks, WORLD, seed=25, version="after-refusal", step=2)


# --- deadlines -----------------------------------------------------------------------------------------


async def test_a_late_rank_within_the_start_deadline_succeeds_and_beyond_it_fails_naming_the_rank(
        engines: dict[str, str], ranks: Ranks) -> None:
    names = [f"tp1_{i}" for i in range(4)]
    # chunk_s alone would fail a 1.5 s late start; the start deadline covers it.
    async with daemon_node(layout(engines, names), timeouts={"chunk_s": 0.5, "start_s": 6.0}) as n:
        await to_sync(n)
        sid = await open_session(n, "late-ok", 4, seed=13)
        replies = await ranks.run({r: stream(n.url, sid, r, 13, "replicated",
                                             delay_s=1.5 if r == 3 else 0) for r in range(4)})
        assert all(reply["ok"] for reply in replies.values()), replies
        await n.client.commit(sid, replies[0]["chunks"])
        await n.client.phase("rollout", 1)
        want = weights_checksum(layout_ranks.trained_weights(13))
        assert await rank_checksums(n) == {name: [want] for name in names}

    async with daemon_node(layout(engines, names), timeouts={"chunk_s": 0.5, "start_s": 1.0}) as n:
        await to_sync(n)
        sid = await open_session(n, "late-fail", 4, seed=14)
        replies = await ranks.run({r: stream(n.url, sid, r, 14, "replicated",
                                             delay_s=2.5 if r == 3 else 0) for r in range(4)})
        assert not any(reply["ok"] for reply in replies.values()), replies
        session = (await n.client.status())["weight_session"]
        assert session["state"] == "failed"
        assert "rank 3 did not start" in session["error"] and "start_s=1.0s" in session["error"]
        # The ranks that started were told why the session ended (a 504 naming the late rank to the one whose
        # wait ran out, the session's error to the others); the late rank finds it gone.
        for r in range(3):
            assert "rank 3 did not start" in replies[r]["body"]["message"], replies[r]
            if replies[r]["status"] == 504:
                assert (replies[r]["body"]["stage"], replies[r]["body"]["rank"]) == ("start", 3)
        assert replies[3]["status"] == 410, replies[3]
        await push(n, ranks, 4, seed=15, version="after-late", mode="replicated")
