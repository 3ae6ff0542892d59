"""What the verified commit costs on one device, without a daemon: ``python -m colocd.bench.digests``.

    python -m colocd.bench.digests --model qwen3-8b --device cuda --out bench/results/digests-qwen3-8b-h200.json

Makes the checkpoint's tensors (HF names and shapes, random bf16) on the device, then times, best of
``--repeats``: every tensor's digest (engines/digest.py, one host sync: what the trainer adds to a push and the
engine to a commit under ``verify: full``), the ``sample`` subset's, and one device copy of the same bytes (the
floor a push cannot beat). Checks that the CPU computes the same digests from the same bytes.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Sequence
from typing import Any

import torch

from ..daemon.verify import sample_names
from ..engines.digest import DigestCache, tensor_digests
from ..engines.reference.sink import MODEL_SHAPES, hf_shapes

__all__ = ["main", "measure"]


def _best(fn: Any, device: torch.device, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best


def measure(model: str, device: torch.device, repeats: int) -> dict[str, Any]:
    """The record: seconds and GB/s of full and sampled digests against one copy, and CPU agreement."""
    gen = torch.Generator(device=device).manual_seed(0)
    named = [(n, torch.randn(s, generator=gen, device=device).to(torch.bfloat16)) for n, s in hf_shapes(model)]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    cache: DigestCache = {}
    full = tensor_digests(named, cache)  # warm: weight vectors on the device
    picked = set(sample_names(full, "v1"))
    subset = [(n, t) for n, t in named if n in picked]
    dst = [torch.empty_like(t) for _, t in named]

    def copy() -> None:
        for d, (_, t) in zip(dst, named, strict=True):
            d.copy_(t)

    full_s = _best(lambda: tensor_digests(named, cache), device, repeats)
    sample_s = _best(lambda: tensor_digests(subset, cache), device, repeats)
    copy_s = _best(copy, device, repeats)
    largest = max(named, key=lambda p: p[1].numel())
    check: Sequence[tuple[str, torch.Tensor]] = [*named[:3], largest]
    on_cpu = tensor_digests([(n, t.cpu()) for n, t in check])
    return {
        "model": model, "device": str(device), "tensors": len(named), "bytes": nbytes, "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "full_s": full_s, "full_gb_per_s": nbytes / full_s / 1e9,
        "sample_tensors": len(subset), "sample_s": sample_s,
        "copy_s": copy_s, "full_x_copy": full_s / copy_s,
        "cpu_agrees": all(on_cpu[n] == full[n] for n, _ in check), "cpu_checked": [n for n, _ in check],
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m colocd.bench.digests", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    record = measure(args.model, device, args.repeats)
    print(json.dumps(record, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if record["cpu_agrees"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
