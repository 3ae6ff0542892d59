"""Trainer rank processes for tests/integration/test_layouts.py: one process per rank, joined by gloo.

Each process stays up for the module and runs commands sent over a pipe: stream one session's
weights through the daemon with ``WeightPusher`` (its own device id), producing them in one of these
modes:

- ``sharded``: the rank holds a 1/N shard of every parameter and all-gathers each to its full tensor
  over its group while the chunks stream (FSDP's ``full_tensor``; deploy/examples/layouts.py);
- ``replicated``: the rank holds the full tensors (no collective);
- ``half``: the first half of the parameters, the same on every rank;
- ``disjoint``: rank r of k its own 1/k of the parameters.

``transport`` picks the rank's producer (default ``inline``); ``retype_first`` makes the rank send its first
tensor as float64 after producing it (a converter bug on one rank: its first chunk is refused). A rank
whose stream raised (the stream has aborted the session and walked its tensors by then) aborts the
session too, as docs/client.md tells a trainer to do, then replies with the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy" / "examples"))
from layouts import ShardedModel, trained_weights  # the example's FSDP stand-in

from colocd.api.client import AsyncColocdClient, ColocdHTTPError, DaemonUnreachable
from colocd.trainer.push import WeightPusher

GROUPS = {"world": None, "pair": [0, 1]}  # process groups every rank builds at start


def serve_rank(rank: int, world: int, master_port: int, conn: Connection) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    groups = {name: (None if ranks is None else dist.new_group(ranks)) for name, ranks in GROUPS.items()}
    conn.send({"ready": rank})
    try:
        while (command := conn.recv()) is not None:
            conn.send(asyncio.run(_stream(rank, command, groups)))
    finally:
        dist.destroy_process_group()


def _source(rank: int, command: dict[str, Any], groups: dict[str, Any]) -> Any:
    named = trained_weights(command["seed"])
    mode = command["mode"]
    if mode == "sharded":
        members = GROUPS[command.get("group", "world")]
        world = len(members) if members is not None else dist.get_world_size()
        return ShardedModel(named, rank, world, groups[command.get("group", "world")]).full_tensors()
    if mode == "replicated":
        return iter(named)
    if mode == "half":
        return iter(named[: len(named) // 2])
    if mode == "disjoint":
        return iter(named[rank::command["of"]])
    raise ValueError(f"unknown mode {mode!r}")


def _retyped_first(source: Any) -> Any:
    for i, (name, tensor) in enumerate(source):
        yield name, (tensor.double() if i == 0 else tensor)


async def _stream(rank: int, command: dict[str, Any], groups: dict[str, Any]) -> dict[str, Any]:
    source = _source(rank, command, groups)
    if command.get("retype_first"):
        source = _retyped_first(source)
    if command.get("delay_s"):
        await asyncio.sleep(command["delay_s"])  # the fault under test: this rank starts late
    sid = command["session_id"]
    async with AsyncColocdClient(command["url"]) as c:
        pusher = WeightPusher(c, rank=rank, transport=command.get("transport", "inline"),
                              bucket_mb=command.get("bucket_mb", 0.05), depth=2,
                              device_id=command["device_id"])
        try:
            chunks, nbytes = await pusher.stream(sid, source)
        except ColocdHTTPError as exc:
            with contextlib.suppress(ColocdHTTPError, DaemonUnreachable):
                await c.abort(sid)
            return {"ok": False, "status": exc.status, "body": exc.body, "join": pusher.last_join}
        return {"ok": True, "chunks": chunks, "nbytes": nbytes, "join": pusher.last_join,
                "acked": [r.seq for r in pusher.chunk_log]}
