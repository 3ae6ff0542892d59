"""Where one fresh-bucket chunk's load goes inside an engine process, stage by stage, on a real CUDA IPC export.

``python3 -m benchmarks.chunk_load --model qwen3-8b --bucket-mib 4096 --pushes 6``

The trainer side (this process) flattens the model's tensors into fresh IPC-exported buckets exactly as
``WeightPusher``'s ``cuda_ipc`` transport does (``export_flattened_bucket``), one chunk at a time. A second process,
the consumer, does what the reference engine's ``update_weights_from_tensor`` does with each entry, timing each
stage apart: base64, unpickling (which opens the IPC handle and waits on the export's event), the views, the
device and name checks, the copy launches, the wait for the copies, and dropping the mapping (the IPC close).
Each push uses one way of building the views and queueing the copies, so the ways compare on the same bytes:

- ``current``: a list of views (``open_payload``) and ``WeightSink.load_weights``, the engine's general path.
- ``planned``: ``WeightSink.load_bucket``, views and copies by a plan cached per chunk shape
  (``benchmarks/load_plan.py``), what the reference engine does now on one TP rank.

No HTTP and no daemon: this isolates the engine's per-chunk CPU work that ``benchmarks.weights`` reports as
``decode``, ``copy_launch`` and ``other``. Prints a table (ms per push, summed over its chunks) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import torch

from colocd.engines.chunks import plan_chunks

from . import CHECKOUT
from .sink import hf_shapes

_WAYS = ("current", "planned")


def _consumer(model: str) -> None:
    """Read one JSON line per chunk ({"way", "entry"}), load it into a sink, answer the stages on stdout."""
    from colocd.engines.reference.payloads import _b64decode, _flattened_bucket, _on_device
    from colocd.engines.reference.safe_unpickle import safe_loads

    from .sink import WeightSink

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sink = WeightSink(model, device)
    for line in sys.stdin:
        msg = json.loads(line)
        t0 = time.perf_counter()
        raw = _b64decode(msg["entry"])
        t1 = time.perf_counter()
        obj = safe_loads(raw)
        t2 = time.perf_counter()
        if msg["way"] == "current":
            named = _on_device(_flattened_bucket(obj), device)
            t3 = time.perf_counter()
            sink.load_weights(named)
        else:
            t3, named = t2, []  # the plan's views are made with its copies
            sink.load_bucket(obj["flattened_tensor"], obj["metadata"])
        t4 = time.perf_counter()
        torch.cuda.synchronize(device)
        t5 = time.perf_counter()
        del named, obj
        t6 = time.perf_counter()
        t = {"b64": t1 - t0, "unpickle_open": t2 - t1, "views": t3 - t2, "checks": sink.last_load["checks_s"],
             "copy_launch": sink.last_load["copy_launch_s"], "sync": t5 - t4, "close": t6 - t5}
        sys.stdout.write(json.dumps(t) + "\n")
        sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-8b")
    p.add_argument("--bucket-mib", type=int, default=4096)
    p.add_argument("--pushes", type=int, default=6, help="per way; the first of each way is a warmup")
    p.add_argument("--out", default=None)
    p.add_argument("--consumer", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.consumer:
        _consumer(args.model)
        return 0
    from colocd.engines.sglang.payload import export_flattened_bucket

    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    params = [(n, torch.randn(s, dtype=torch.bfloat16, device=device)) for n, s in hf_shapes(args.model)]
    chunks = list(plan_chunks(params, args.bucket_mib << 20))  # WeightPusher's buckets
    child = subprocess.Popen([sys.executable, "-m", "benchmarks.chunk_load", "--consumer", "--model", args.model],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=CHECKOUT)
    assert child.stdin is not None and child.stdout is not None
    results: dict[str, list[dict[str, float]]] = {w: [] for w in _WAYS}
    for push in range(args.pushes):
        for way in _WAYS:
            per_push: dict[str, float] = {}
            for chunk in chunks:
                entry, lease = export_flattened_bucket(chunk)
                child.stdin.write(json.dumps({"way": way, "entry": entry}) + "\n")
                child.stdin.flush()
                stages = json.loads(child.stdout.readline())
                lease.release()
                for k, v in stages.items():
                    per_push[k] = per_push.get(k, 0.0) + v
            if push:
                results[way].append(per_push)
    child.stdin.close()
    child.wait(timeout=60)
    stages = list(results[_WAYS[0]][0])
    print(f"{args.model}, {len(chunks)} chunks of <= {args.bucket_mib} MiB; ms per push summed over its chunks, "
          f"median of {args.pushes - 1}")
    print(f"{'way':<10}" + "".join(f"{s:>14}" for s in stages) + f"{'total':>10}")
    summary: dict[str, dict[str, float]] = {}
    for way in _WAYS:
        med = {s: 1e3 * statistics.median(r[s] for r in results[way]) for s in stages}
        summary[way] = med
        print(f"{way:<10}" + "".join(f"{med[s]:>14.2f}" for s in stages) + f"{sum(med.values()):>10.2f}")
    if args.out:
        doc: dict[str, Any] = {"model": args.model, "chunks": len(chunks), "bucket_mib": args.bucket_mib,
                               "gpu": torch.cuda.get_device_name(device), "torch": torch.__version__,
                               "median_ms": summary, "pushes": results}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
