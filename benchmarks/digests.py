"""What the verified commit costs on one device, without a daemon: ``python3 -m benchmarks.digests``.

    python3 -m benchmarks.digests --model qwen3-8b --device cuda --out benchmarks/results/digests-qwen3-8b-h200.json

Makes the checkpoint's tensors (HF names and shapes, random bf16) on the device, then times, best of
``--repeats``: every tensor's digest (engines/digest.py, one host sync: what the trainer adds to a push and the
engine to a commit under ``verify: full``), the ``sample`` subset's, and one device copy of the same bytes (the
floor a push cannot beat). Checks that the CPU computes the same digests from the same bytes.

Old against new on the same tensors: ``block_loop_digests`` is the earlier implementation of the same function
(nine kernels per 16-row block, kept here only to measure the ratio); the record's ``implementations`` gives
both, the current one at each ``--scratch-rows``, and checks all of them return the same digests.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from colocd.daemon.verify import sample_names
from colocd.engines import digest as D
from colocd.engines.digest import KERNEL, SCRATCH_ROWS, WIDEN, DigestCache, kernel_available, tensor_digests

from .sink import MODEL_SHAPES, hf_shapes

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


_OLD_BLOCK_ROWS = 16


def block_loop_digests(named: Sequence[tuple[str, torch.Tensor]], cache: dict[torch.device, Any]) -> dict[str, str]:
    """The earlier implementation of engines/digest.py's function: a Python loop over 16-row blocks, each copied to
    int64, multiplied in place, row-summed and weighted on its own (about nine kernels per 16 MiB of bytes)."""
    sums: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    sizes: list[int] = []
    for i, (_, t) in enumerate(named):
        sizes.append(t.numel() * t.element_size())
        if t.device not in cache:
            ws = D._workspace(t.device, {}, 1)
            cache[t.device] = (ws.columns, ws.rows,
                               torch.empty((_OLD_BLOCK_ROWS, D.ROW), dtype=torch.int64, device=t.device))
        columns, rows, scratch = cache[t.device]
        words = D._words(t)
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        whole = words.numel() // D.ROW
        for start in range(0, whole, _OLD_BLOCK_ROWS):
            stop = min(start + _OLD_BLOCK_ROWS, whole)
            block = scratch[: stop - start]
            block.copy_(words[start * D.ROW : stop * D.ROW].view(stop - start, D.ROW))
            per_row = block.mul_(columns).sum(1)
            index = torch.arange(start, stop, device=words.device) % D._ROWS
            total += (per_row * rows[index]).sum()
        tail = words[whole * D.ROW :]
        if tail.numel():
            total += (tail.to(torch.int64) * columns[: tail.numel()]).sum() * rows[whole % D._ROWS]
        sums.setdefault(t.device, []).append((i, total))
    values = [0] * len(named)
    for entries in sums.values():
        for (i, _), v in zip(entries, torch.stack([s for _, s in entries]).tolist(), strict=True):
            values[i] = int(v) & ((1 << 64) - 1)
    return {n: D.digest_hex(v, b) for (n, _), v, b in zip(named, values, sizes, strict=True)}


def compiled_digests(named: Sequence[tuple[str, torch.Tensor]], cache: DigestCache,
                     row_sums_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> dict[str, str]:
    """The same function with each tensor's whole rows in one compiled kernel (``row_sums_of``: widen, multiply
    and row-sum fused, so no int64 products reach memory); tails and the row weights as engines/digest.py does.
    A candidate only: measured here against the eager implementations before anything depends on a compiler."""
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    sizes = []
    for i, (_, t) in enumerate(named):
        sizes.append(t.numel() * t.element_size())
        by_device.setdefault(t.device, []).append((i, D._words(t)))
    values = [0] * len(named)
    for device, entries in by_device.items():
        ws = D._workspace(device, cache, 1)
        counts = [D._row_count(w.numel()) for _, w in entries]
        sums = torch.empty(sum(counts), dtype=torch.int64, device=device)
        at = 0
        for (_, w), rows in zip(entries, counts, strict=True):
            whole = w.numel() // D.ROW
            if whole:
                sums[at : at + whole] = row_sums_of(w[: whole * D.ROW].view(whole, D.ROW), ws.columns)
            if (tail := w.numel() - whole * D.ROW):
                sums[at + whole] = (w[whole * D.ROW :].to(torch.int64) * ws.columns[:tail]).sum()
            at += rows
        got = D._weighted_totals(sums, counts, ws).tolist()
        for (i, _), v in zip(entries, got, strict=True):
            values[i] = int(v) & ((1 << 64) - 1)
    return {n: D.digest_hex(v, b) for (n, _), v, b in zip(named, values, sizes, strict=True)}


def _fused_row_sums(block: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    return (block.to(torch.int64) * columns).sum(1)


def compare_implementations(named: Sequence[tuple[str, torch.Tensor]], device: torch.device, repeats: int,
                            scratch_rows: Sequence[int], compiled: bool = False) -> dict[str, Any]:
    """Old (``block_loop``) against new (``multiply@rows``, ``copy@rows``: engines/digest.py's two widenings at
    each scratch size; ``kernel``, its fused Triton kernel, on CUDA; the default is ``kernel`` on CUDA where Triton
    imports, else ``multiply``, ``copy`` on CPU; ``compiled`` where asked) on the same
    tensors: best seconds, GB/s, and whether every implementation returned the same digests."""
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    old_cache: dict[torch.device, Any] = {}
    runs: dict[str, Any] = {"block_loop": lambda: block_loop_digests(named, old_cache)}
    for widen in WIDEN:
        for rows in scratch_rows:
            cache: DigestCache = {}
            runs[f"{widen}@{rows}"] = lambda cache=cache, rows=rows, widen=widen: tensor_digests(
                named, cache, scratch_rows=rows, widen=widen)
    if device.type == "cuda" and kernel_available():
        kernel_cache: DigestCache = {}
        runs[KERNEL] = lambda: tensor_digests(named, kernel_cache, widen=KERNEL)
    if compiled:
        row_sums_of = torch.compile(_fused_row_sums, dynamic=True)
        compiled_cache: DigestCache = {}
        runs["compiled"] = lambda: compiled_digests(named, compiled_cache, row_sums_of)
    out: dict[str, Any] = {}
    answers = {}
    errors: dict[str, str] = {}
    for name, fn in runs.items():
        t0 = time.perf_counter()
        try:
            answers[name] = fn()  # warm: weight vectors and scratch on the device (and, compiled, the kernel)
        except Exception as exc:  # a candidate that cannot run here is reported, not fatal
            if name != "compiled":
                raise
            errors[name] = f"{type(exc).__name__}: {exc}"[:400]
            continue
        warm_s = time.perf_counter() - t0
        s = _best(fn, device, repeats)
        out[name] = {"s": s, "gb_per_s": nbytes / s / 1e9, "first_call_s": warm_s,
                     "scratch_mib": 0 if name in ("compiled", KERNEL) else
                     2 * (_OLD_BLOCK_ROWS if name == "block_loop" else int(name.split("@")[1]))}
        if device.type == "cuda":
            torch.cuda.empty_cache()
    first = next(iter(answers.values()))
    fused = min((k for k in out if k not in ("block_loop", "compiled")), key=lambda k: out[k]["s"])
    default = KERNEL if KERNEL in out else f"{'multiply' if device.type == 'cuda' else 'copy'}@{SCRATCH_ROWS}"
    return {"implementations": out, "errors": errors, "same_digests": all(a == first for a in answers.values()),
            "best_fused": fused, "speedup": out["block_loop"]["s"] / out[fused]["s"],
            "default": default if default in out else None,
            "default_speedup": out["block_loop"]["s"] / out[default]["s"] if default in out else None}


def measure(model: str, device: torch.device, repeats: int,
            scratch_rows: Sequence[int] = (SCRATCH_ROWS,), compiled: bool = False) -> dict[str, Any]:
    """The record: seconds and GB/s of full and sampled digests against one copy, old against new, and CPU
    agreement."""
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
    compared = compare_implementations(named, device, repeats, scratch_rows, compiled)
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
        **compared,
        "date": time.strftime("%Y-%m-%d"),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.digests", description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--scratch-rows", default=str(SCRATCH_ROWS),
                        help="comma-separated scratch sizes (rows of 2 MiB) to time the current digest at")
    parser.add_argument("--compiled", action="store_true",
                        help="also time a torch.compile'd fused row sum (a candidate; needs a working inductor)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    record = measure(args.model, device, args.repeats, [int(r) for r in args.scratch_rows.split(",")],
                     args.compiled)
    print(json.dumps(record, indent=2))
    print("digests of every tensor, same bytes: " + ", ".join(
        f"{k} {v['gb_per_s']:.1f} GB/s ({v['s'] * 1e3:.1f} ms, scratch {v['scratch_mib']} MiB)"
        for k, v in record["implementations"].items())
        + f"; new/old speedup {record['speedup']:.2f}x ({record['best_fused']}); same digests: "
        f"{record['same_digests']}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if record["cpu_agrees"] and record["same_digests"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
