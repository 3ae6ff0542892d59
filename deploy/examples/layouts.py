"""Colocated layouts on one CPU node: N trainer ranks (torch.distributed, gloo) feed reference engines with TP.

    python deploy/examples/layouts.py --layout 4x2tp2 [--steps 2] [--bucket-mb 0.05]

Layouts are named <trainer ranks>x<engines>tp<tp_size> (``--list`` prints them):

    1x1tp1   one rank, one engine
    2x1tp2   two ranks feed the two TP ranks of one engine
    4x4tp1   four ranks, four TP=1 engines: rank r feeds engine e<r>
    4x2tp2   four ranks, two TP=2 engines: ranks 2k, 2k+1 feed engine e<k>'s TP ranks 0, 1
    4x1tp4   four ranks feed the four TP ranks of one engine

colocd (``colocd serve``, started here) launches the engines; engine TP rank t of e<k> runs on the CPU
"device" ``cpu:<i>`` (its ``device_ids``), and trainer rank i declares ``cpu:<i>``
(``WeightPusher(device_id=...)``), so every engine TP rank is fed by the trainer rank on its device
with no mapping in the config: the same rule that pairs GPU UUIDs on a GPU node (docs/client.md,
"Trainer author's guide: layouts").

Each rank holds a 1/N shard of every parameter, as FSDP does, and all-gathers each parameter to its
full tensor while its chunks stream (``full_tensors``: a collective per tensor, in the same order on
every rank). Rank 0 drives the phases, opens the session with the manifest, broadcasts its id and
commits after a barrier; after each step it checks every engine TP rank's checksum against the
trainer's weights and prints one JSON line. Exits 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import socket
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from colocd.api.client import AsyncColocdClient
from colocd.api.procs import DaemonProcess
from colocd.engines.chunks import dtype_name
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer import WeightPusher

Named = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True)
class Layout:
    ranks: int
    engines: tuple[tuple[str, tuple[str, ...]], ...]  # (name, the device id of each TP rank)


def _layout(ranks: int, engines: int, tp: int) -> Layout:
    return Layout(ranks, tuple((f"e{k}", tuple(f"cpu:{k * tp + t}" for t in range(tp))) for k in range(engines)))


LAYOUTS: dict[str, Layout] = {
    "1x1tp1": _layout(1, 1, 1),
    "2x1tp2": _layout(2, 1, 2),
    "4x4tp1": _layout(4, 4, 1),
    "4x2tp2": _layout(4, 2, 2),
    "4x1tp4": _layout(4, 1, 4),
}


def engine_configs(layout: Layout, *, seed: int = 0, launch: bool = True) -> list[dict[str, Any]]:
    """The node config's engines: reference engines on CPU, one declared device id per TP rank."""
    return [{"kind": "reference", "name": name, "tp_size": len(devices), "device_ids": list(devices), "seed": seed,
             **({"launch": {"ready_timeout_s": 180}} if launch else {})}
            for name, devices in layout.engines]


def trained_weights(step: int) -> Named:
    """Stand-in for a training step: deterministic new weights, the same on every rank."""
    return [(n, p.detach()) for n, p in build_model(QwenLikeConfig(), seed=1000 + step).named_parameters()]


class ShardedModel:
    """What an FSDP rank holds: 1/world of every parameter's elements (flattened, zero-padded to a multiple of
    world). ``full_tensors`` all-gathers each parameter over ``group``, as ``DTensor.full_tensor()`` does."""

    def __init__(self, named: Named, rank: int, world: int, group: Any = None) -> None:
        self.group, self.world = group, world
        self.params: list[tuple[str, torch.Size, torch.dtype, int, torch.Tensor]] = []
        for name, t in named:
            flat = t.reshape(-1)
            per = -(-flat.numel() // world)
            padded = torch.zeros(per * world, dtype=t.dtype)
            padded[: flat.numel()] = flat
            self.params.append((name, t.shape, t.dtype, flat.numel(), padded[rank * per:(rank + 1) * per].clone()))

    def manifest(self) -> list[dict[str, Any]]:
        """Names, dtypes and global shapes: known without gathering anything."""
        return [{"name": n, "dtype": dtype_name(dt), "shape": list(shape)} for n, shape, dt, _, _ in self.params]

    def full_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape, _, numel, shard in self.params:  # the same order on every rank
            parts = [torch.empty_like(shard) for _ in range(self.world)]
            dist.all_gather(parts, shard, group=self.group)  # a collective: every rank runs it
            yield name, torch.cat(parts)[:numel].view(shape)


async def sync_weights(c: AsyncColocdClient, model: ShardedModel, step: int, *, bucket_mb: float) -> dict[str, Any]:
    """The guide's ``sync_weights`` (docs/client.md), on CPU: every rank calls it; rank 0 drives the node."""
    rank, world = dist.get_rank(), dist.get_world_size()
    session: list[Any] = [None]
    if rank == 0:
        await c.phase("sync", step)
        session = [(await c.open_session(str(step), step=step, ranks=world, manifest=model.manifest()))["session_id"]]
    dist.broadcast_object_list(session, src=0)
    pusher = WeightPusher(c, rank=rank, transport="inline", bucket_mb=bucket_mb, depth=2, device_id=f"cpu:{rank}")
    chunks, _ = await pusher.stream(session[0], model.full_tensors())
    plans: list[Any] = [None] * world
    dist.all_gather_object(plans, chunks)  # the barrier before commit; every rank has the same plan
    commit: dict[str, Any] = {}
    if rank == 0:
        commit = await c.commit(session[0], chunks)
        await c.phase("rollout", step)
    dist.barrier()
    return {"chunks": chunks, "plans": plans, "feeds": (pusher.last_join or {}).get("feeds"), "commit": commit}


def sglang_digest(t: torch.Tensor) -> str:
    """SGLang's ``/weights_checker`` checksum of one tensor: the first 8 bytes of the sha256 of its bytes."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(data).digest()[:8].hex()


async def engine_checksums(urls: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """Every engine TP rank's per-parameter checksums of its weights (``/weights_checker``'s ``ranks``)."""
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        out = {}
        for name, url in urls.items():
            body = (await http.post(f"{url}/weights_checker", json={"action": "checksum"})).json()
            out[name] = [r["checksums"] for r in body["ranks"]]
        return out


def rank_main(rank: int, world: int, master_port: int, daemon_url: str, engine_urls: dict[str, str], steps: int,
              bucket_mb: float) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{master_port}", rank=rank, world_size=world)
    try:
        asyncio.run(_rank_steps(rank, world, daemon_url, engine_urls, steps, bucket_mb))
    finally:
        dist.destroy_process_group()


async def _rank_steps(rank: int, world: int, daemon_url: str, engine_urls: dict[str, str], steps: int,
                      bucket_mb: float) -> None:
    async with AsyncColocdClient(daemon_url) as c:
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            if rank == 0:
                await c.phase("train", step)
            dist.barrier()
            named = trained_weights(step)  # "training": every rank ends the step with its shard of new weights
            result = await sync_weights(c, ShardedModel(named, rank, world), step, bucket_mb=bucket_mb)
            feeds = [None] * world
            dist.all_gather_object(feeds, result["feeds"])
            if rank != 0:
                continue
            want = {name: sglang_digest(t) for name, t in named}
            sums = await engine_checksums(engine_urls)
            ok = all(s == want for rank_sums in sums.values() for s in rank_sums)
            print(json.dumps({"step": step, "ok": ok, "chunks": result["chunks"],
                              "sources": result["commit"]["sources"],
                              "feeds": {r: [f"{f['engine']}/tp{f['tp_rank']}" for f in fs or []]
                                        for r, fs in enumerate(feeds)},
                              "engine_rank_checksums_match": {n: [s == want for s in v] for n, v in sums.items()},
                              "seconds": round(time.perf_counter() - t0, 2)}), flush=True)
            if not ok:
                raise SystemExit(f"step {step}: an engine TP rank does not hold the trainer's weights: {sums}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def run(layout_name: str, *, steps: int = 1, bucket_mb: float = 0.05) -> None:
    layout = LAYOUTS[layout_name]
    workdir = tempfile.mkdtemp(prefix=f"colocd-layout-{layout_name}-")
    config = {"engines": engine_configs(layout), "timeouts": {"start_s": 60, "chunk_s": 30}}
    async with DaemonProcess(config, workdir=workdir, ready_timeout_s=300) as daemon, \
            AsyncColocdClient(daemon.url) as c:
        await c.wait_ready(300)
        status = await c.status()
        urls = {n: str(e["launched"]["url"]) for n, e in status["engines"].items()}
        print(json.dumps({"layout": layout_name, "ranks": layout.ranks,
                          "engines": {n: list(d) for n, d in layout.engines}}), flush=True)
        await asyncio.to_thread(mp.spawn, rank_main, nprocs=layout.ranks, join=True,
                                args=(layout.ranks, _free_port(), daemon.url, urls, steps, bucket_mb))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", default="4x2tp2", choices=sorted(LAYOUTS))
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=0.05, help="small buckets: several chunks per step")
    parser.add_argument("--list", action="store_true", help="print the layouts and exit")
    args = parser.parse_args(argv)
    if args.list:
        for name, layout in LAYOUTS.items():
            print(name, json.dumps({"ranks": layout.ranks, "engines": {n: list(d) for n, d in layout.engines}}))
        return 0
    torch.set_num_threads(1)  # a small CPU node: one thread per process
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run(args.layout, steps=args.steps, bucket_mb=args.bucket_mb))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
