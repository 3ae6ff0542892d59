"""``python3 -m benchmarks.readme_push``: the README's trainer snippet against ``WeightPusher()``, same run.

    python3 -m benchmarks.readme_push --model qwen3-8b --device cuda --out benchmarks/results/readme-push-h200.json
    python3 -m benchmarks.readme_push --model tiny --device cpu        # smoke run

What a user types (``TrainerClient(url).push_weights(named, version=...)``, every tuning argument at its
default) and the async ``WeightPusher()`` at its defaults push the same tensors through one real daemon to one
reference engine (sink shapes), alternating, fresh values before every push and the engine's checksums checked
after it. The device-copy floor of the same bytes is measured in the same run, so both figures are ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import torch

from colocd.api.client import AsyncColocdClient
from colocd.api.procs import DaemonProcess
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.trainer import TrainerClient
from colocd.trainer.push import WeightPusher

from .records import write_record
from .sink import MODEL_SHAPES
from .sink_engine import sink_launch
from .weights import _make_tensors, _refill, measure_floor

__all__ = ["main", "run_readme_bench"]

Named = Sequence[tuple[str, torch.Tensor]]


def _readme_push(url: str, named: Named, versions: Sequence[str]) -> list[tuple[float, int]]:
    """The README's snippet, one client for the whole loop: (seconds, chunks) per push."""
    out: list[tuple[float, int]] = []
    with TrainerClient(url) as c:
        for version in versions:
            t0 = time.perf_counter()
            report = c.push_weights(named, version=version)
            out.append((time.perf_counter() - t0, report.chunks))
    return out


async def _checked(http: httpx.AsyncClient, engine_url: str, named: Named, expected: list[list[int]]) -> bool:
    sink = (await http.get(f"{engine_url}/colocd/sink")).raise_for_status().json()
    return bool([sink["checksums"][name] for name, _ in named] == expected)


async def run_readme_bench(model: str, device_name: str, repeats: int, out: str | None) -> dict[str, Any]:
    if model not in MODEL_SHAPES:
        raise ValueError(f"unknown model {model!r}; known: {sorted(MODEL_SHAPES)}")
    device = torch.device(device_name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    named = _make_tensors(model, device)
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    floor_s = measure_floor(named, device, max(repeats, 5))
    workdir = tempfile.mkdtemp(prefix="colocd-readme-bench-")
    engine_cfg = ReferenceEngineConfig.model_validate({
        "name": "ref0", "url": "http://127.0.0.1:0", "device": device_name,
        "launch": sink_launch(model, ready_timeout_s=600, log_file=f"{workdir}/engine.log"),
    })
    times: dict[str, list[float]] = {"readme": [], "pusher": []}
    chunks: dict[str, int] = {}
    verified = True
    async with ReferenceEngineProcess(engine_cfg) as engine:
        assert engine.url is not None
        daemon_cfg = {"engines": [{"kind": "reference", "name": "ref0", "url": engine.url, "device": device_name}],
                      "timeouts": {"default_s": 600, "chunk_s": 600}}
        async with (
            DaemonProcess(daemon_cfg, workdir=workdir) as daemon,
            AsyncColocdClient(daemon.url) as client,
            httpx.AsyncClient(timeout=600, trust_env=False) as http,
        ):
            await client.wait_ready(120)
            await client.phase("train", 1)
            await client.phase("sync", 1)
            async with WeightPusher(client) as pusher:
                for i in range(repeats + 1):  # the first round of each is a warm-up
                    expected = _refill(named, 1000 + 2 * i)
                    t0 = time.perf_counter()
                    report = await pusher.push(named, version=f"pusher-{i}")
                    pusher_s = time.perf_counter() - t0
                    verified &= await _checked(http, engine.url, named, expected)
                    expected = _refill(named, 1001 + 2 * i)
                    [(readme_s, readme_chunks)] = await asyncio.to_thread(
                        _readme_push, daemon.url, named, [f"readme-{i}"])
                    verified &= await _checked(http, engine.url, named, expected)
                    chunks = {"pusher": report.chunks, "readme": readme_chunks}
                    print(f"  round {i + 1}/{repeats + 1}{' (warm-up)' if i == 0 else ''}: WeightPusher() "
                          f"{pusher_s * 1e3:.1f} ms, README snippet {readme_s * 1e3:.1f} ms", flush=True)
                    if i:
                        times["pusher"].append(pusher_s)
                        times["readme"].append(readme_s)
    best = {k: min(v) for k, v in times.items()}
    median = {k: statistics.median(v) for k, v in times.items()}
    record: dict[str, Any] = {
        "command": " ".join(["python3 -m benchmarks.readme_push", *sys.argv[1:]]),
        "model": model, "bytes": nbytes, "device": str(device),
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "floor_s": floor_s, "chunks": chunks,
        "best_s": best, "median_s": median, "all_s": times, "verified": verified,
        "readme_over_pusher_median": median["readme"] / median["pusher"],
        "readme_over_floor_median": median["readme"] / floor_s,
        "pusher_over_floor_median": median["pusher"] / floor_s,
        "date": time.strftime("%Y-%m-%d"),
    }
    print(f"{'path':<16}{'chunks':>7}{'best ms':>10}{'median ms':>11}{'x floor':>9}")
    for path, label in (("pusher", "WeightPusher()"), ("readme", "README snippet")):
        print(f"{label:<16}{chunks[path]:>7}{best[path] * 1e3:>10.1f}{median[path] * 1e3:>11.1f}"
              f"{median[path] / floor_s:>9.2f}")
    print(f"floor (one device copy of {nbytes / 1e9:.2f} GB): {floor_s * 1e3:.2f} ms; README / WeightPusher() = "
          f"{record['readme_over_pusher_median']:.2f}x (median); every push verified: {verified}", flush=True)
    if out:
        write_record(Path(out), record)
    return record


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.readme_push", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="tiny", help=f"checkpoint shapes: {', '.join(sorted(MODEL_SHAPES))}")
    p.add_argument("--device", default="cpu", help="where the trainer's tensors live (cpu, cuda)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds (after one warm-up round)")
    p.add_argument("--out", default=None, help="write the JSON record here")
    args = p.parse_args(argv)
    record = asyncio.run(run_readme_bench(args.model, args.device, args.repeats, args.out))
    print(json.dumps({k: record[k] for k in ("readme_over_pusher_median", "verified")}))
    return 0 if record["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
