"""Engine SIGKILL mid-push: seconds until the trainer's ``torch.cuda.memory_allocated()`` is back at its
pre-push level (``colocd.trainer.leases``).

This process is the trainer; a reference engine holding the model's sink shapes on the same GPU is the consumer;
a daemon process forwards. One warm push first, then a push whose engine is SIGKILLed just before chunk
``kill_at`` goes out (earlier chunks in flight or loading). Measured: the pre-push level, the peak while the push
ran, when the push raised, and when the trainer's memory was back (polled every 5 ms), all from the kill.

    python3 -m benchmarks.ipc_reclaim --model qwen3-8b --out benchmarks/results/ipc-reclaim-qwen3-8b-h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from typing import Any

import torch

from colocd.api.client import AsyncColocdClient, SendablePart
from colocd.api.procs import DaemonProcess
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.trainer.leases import LEASE_GRACE_S
from colocd.trainer.push import DEFAULT_BUCKET_MB, DEFAULT_DEPTH, WeightPusher

from .sink import hf_shapes
from .sink_engine import sink_launch

__all__ = ["KillBeforeChunk", "engine_kill_mid_push", "main"]

_GiB = 1 << 30


class KillBeforeChunk(AsyncColocdClient):
    """A trainer client that SIGKILLs process ``pid`` just before it sends chunk ``seq`` of the first session
    opened once ``armed`` is set (the engine's crash)."""

    def __init__(self, url: str, *, pid: int, seq: int) -> None:
        super().__init__(url)
        self.pid, self.seq = pid, seq
        self.armed = False
        self.killed_at: float | None = None

    async def send_chunk(self, session_id: str, *, seq: int, rank: int, chunk: SendablePart) -> dict[str, Any]:
        if self.armed and seq == self.seq and self.killed_at is None:
            os.kill(self.pid, signal.SIGKILL)
            self.killed_at = time.monotonic()
        return await super().send_chunk(session_id, seq=seq, rank=rank, chunk=chunk)


async def engine_kill_mid_push(*, model: str, device: str = "cuda:0", bucket_mb: float | None = None,
                               depth: int | None = None, kill_at: int = 2, lease_grace_s: float = LEASE_GRACE_S,
                               watch_s: float = 10.0) -> dict[str, Any]:
    """One warm push, then one whose engine dies before chunk ``kill_at``; the trainer-memory timeline."""
    dev = torch.device(device)
    named = [(n, torch.randn(s, device=dev).to(torch.bfloat16)) for n, s in hf_shapes(model)]
    torch.cuda.synchronize(dev)
    workdir = tempfile.mkdtemp(prefix="colocd-ipc-reclaim-")
    engine_cfg = ReferenceEngineConfig.model_validate({
        "name": "ref0", "url": "http://127.0.0.1:0", "device": device,
        "launch": sink_launch(model, ready_timeout_s=600, log_file=f"{workdir}/engine.log")})
    options: dict[str, Any] = {"lease_grace_s": lease_grace_s, "bucket_mb": bucket_mb}
    if depth is not None:
        options["depth"] = depth
    async with ReferenceEngineProcess(engine_cfg) as engine:
        assert engine.url is not None and engine.pid is not None
        daemon_cfg = {"engines": [{"kind": "reference", "name": "ref0", "url": engine.url, "device": device}],
                      "timeouts": {"default_s": 120, "chunk_s": 120}}
        async with DaemonProcess(daemon_cfg, workdir=workdir) as daemon:
            client = KillBeforeChunk(daemon.url, pid=engine.pid, seq=kill_at)
            try:
                await client.wait_ready(120)
                await client.phase("train", 1)
                await client.phase("sync", 1)
                # One pusher for both pushes: what it keeps between pushes (the digest workspace) is in the
                # baseline, so what the killed push leaves above it is what that push stranded.
                pusher = WeightPusher(client, **options)
                await pusher.push(named, version="warm")
                torch.cuda.synchronize(dev)
                baseline = torch.cuda.memory_allocated(dev)
                client.armed = True
                push = asyncio.create_task(pusher.push(named, version="killed"))
                peak = baseline
                while not push.done():  # exports run on threads: sample the trainer's memory meanwhile
                    peak = max(peak, torch.cuda.memory_allocated(dev))
                    await asyncio.sleep(0.001)
                error = push.exception()
                raised_at = time.monotonic()
                at_raise = torch.cuda.memory_allocated(dev)
                back_at = raised_at if at_raise <= baseline else None
                while back_at is None and time.monotonic() - raised_at < watch_s:
                    await asyncio.sleep(0.005)  # polling the trainer's own allocator, bounded by watch_s
                    if torch.cuda.memory_allocated(dev) <= baseline:
                        back_at = time.monotonic()
                leases = pusher.leases.report()
                await pusher.aclose()
                metrics = await client.metrics()
            finally:
                await client.aclose()
    killed_at = client.killed_at
    return {
        "model": model, "nbytes": sum(t.numel() * t.element_size() for _, t in named),
        "bucket_mb": bucket_mb, "depth": depth, "kill_at_chunk": kill_at, "lease_grace_s": lease_grace_s,
        "killed": killed_at is not None, "error": repr(error),
        "baseline_bytes": baseline, "peak_bytes": peak, "at_raise_bytes": at_raise,
        "final_bytes": torch.cuda.memory_allocated(dev),
        "raised_after_kill_s": None if killed_at is None else raised_at - killed_at,
        "back_after_kill_s": None if killed_at is None or back_at is None else back_at - killed_at,
        "leases": leases,
        "metrics": [line for line in metrics.splitlines() if line.startswith("colocd_ipc_")],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.ipc_reclaim", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b", help="sink shapes of the engine and the trainer's tensors")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--bucket-mb", type=float, default=None,
                        help=f"default: WeightPusher's ({DEFAULT_BUCKET_MB} MiB)")
    parser.add_argument("--depth", type=int, default=None, help=f"default: WeightPusher's ({DEFAULT_DEPTH})")
    parser.add_argument("--kill-at", type=int, default=2, help="SIGKILL the engine before sending this chunk")
    parser.add_argument("--grace-s", type=float, default=LEASE_GRACE_S, help="WeightPusher(lease_grace_s=...)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args(argv)
    record = asyncio.run(engine_kill_mid_push(model=args.model, device=args.device, bucket_mb=args.bucket_mb,
                                              depth=args.depth, kill_at=args.kill_at, lease_grace_s=args.grace_s))
    record["command"] = "python3 -m benchmarks.ipc_reclaim " + " ".join(sys.argv[1:] if argv is None else argv)
    text = json.dumps(record, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(f"baseline {record['baseline_bytes'] / _GiB:.2f} GiB, peak {record['peak_bytes'] / _GiB:.2f} GiB, at the "
          f"error {record['at_raise_bytes'] / _GiB:.2f} GiB; back at baseline {record['back_after_kill_s']} s after "
          "the kill", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
