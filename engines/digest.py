"""Per-tensor weight digests: what the trainer computes at export and an engine reports after loading.

A digest is a function of a tensor's raw bytes (read as 32-bit words), computed with torch integer ops on the
tensor's device, one host sync per batch. Equal bytes give equal digests on every device (integer arithmetic
modulo 2**64 does not depend on the reduction order).

The function: the bytes, zero-padded to whole 32-bit words ``x_i`` (signed), laid out in rows of ``ROW``
words; ``H = sum_r u_r * sum_j w_j * x_{r,j}  (mod 2**64)`` with fixed-seed odd weights ``w`` (one per
column) and ``u`` (one per row), then the byte count is mixed in (so a truncation or zero-padding shows).

Collision properties (it detects accidents, not adversaries: the weights are public):

- any change confined to one 32-bit word is always detected (``u_r * w_j`` is odd, a word difference is
  nonzero and below 2**32 in magnitude, so their product is nonzero modulo 2**64);
- a different byte count is always detected by the length mix, up to a 2**-64 coincidence;
- any other change (a different tensor, stale weights, a shifted or transposed copy, a half-written
  buffer) collides only if the weighted sum of the word differences is 0 modulo 2**64: for differences
  that do not conspire with the fixed weights, about 2**-64;
- it is linear: two corruptions whose weighted differences cancel collide. Crafting them is easy for
  someone who reads this file, never the effect of a bug.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import torch

__all__ = ["DIGEST_HEX_CHARS", "KERNEL", "ROW", "SCRATCH_ROWS", "WIDEN", "DigestCache", "digest_hex",
           "kernel_available", "tensor_digests"]

ROW = 1 << 18  # words per row: one column weight each (2 MiB of int64 weights per device)
_ROWS = 1 << 16  # row weights: rows beyond this reuse them cyclically (tensors over 64 GiB)
# Rows per product pass (a row is 1 MiB of tensor bytes): the int64 products land in a reused scratch of
# SCRATCH_ROWS x 2 MiB per device, so a tensor up to 16 MiB takes one pass.
SCRATCH_ROWS = 16
WIDEN = ("multiply", "copy")  # how torch's kernels widen the words to int64 (``_row_sums``)
# ``widen="kernel"``: one fused Triton kernel per tensor (CUDA only) writes only per-row sums; default where it runs.
KERNEL = "kernel"
_SEED = 0x636F6C6F6364  # "colocd"
_MASK = (1 << 64) - 1
_LENGTH_MIX = 0x9E3779B97F4A7C15  # the 64-bit golden ratio
DIGEST_HEX_CHARS = 16


class _Workspace(NamedTuple):
    columns: torch.Tensor  # (ROW,) odd int64 weights
    rows: torch.Tensor  # (_ROWS,) odd int64 weights
    scratch: torch.Tensor  # (scratch rows, ROW) int64, reused: a fresh one per pass costs page faults on CPU


DigestCache = dict[torch.device, _Workspace]


def _workspace(device: torch.device, cache: DigestCache, scratch_rows: int = SCRATCH_ROWS) -> _Workspace:
    found = cache.get(device)
    if found is None or found.scratch.shape[0] != scratch_rows:
        if found is not None:
            columns, rows = found.columns, found.rows
        else:
            g = torch.Generator().manual_seed(_SEED)
            # Odd weights below 2**62, drawn on the CPU (the same on every machine), then moved.
            columns = (torch.randint(0, 1 << 62, (ROW,), generator=g, dtype=torch.int64) | 1).to(device)
            rows = (torch.randint(0, 1 << 62, (_ROWS,), generator=g, dtype=torch.int64) | 1).to(device)
        scratch = torch.empty((scratch_rows, ROW), dtype=torch.int64, device=device)
        found = _Workspace(columns, rows, scratch)
        cache[device] = found
    return found


def _words(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words, zero-padded to a whole word (a view where the bytes allow it)."""
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
    pad = -flat.numel() % 4
    if pad or flat.data_ptr() % 4:
        padded = torch.zeros(flat.numel() + pad, dtype=torch.uint8, device=flat.device)
        padded[: flat.numel()].copy_(flat)
        flat = padded
    return flat.view(torch.int32)


def _row_count(words: int) -> int:
    return -(-words // ROW)


def _product(words: torch.Tensor, columns: torch.Tensor, out: torch.Tensor, widen: str) -> None:
    if widen == "multiply":
        torch.mul(words, columns, out=out)
    else:
        out.copy_(words).mul_(columns)


def _row_sums(words: torch.Tensor, ws: _Workspace, out: torch.Tensor, widen: str) -> None:
    """``out[r] = sum_j w_j x_{r,j}`` modulo 2**64 for every row ``r`` of ``words`` (the last may be short).
    ``widen``: ``multiply`` casts inside the product (CUDA), ``copy`` widens first and multiplies in place (CPU,
    where a mixed-dtype multiply makes a temporary); the same sums, relying on int64 wrapping modulo 2**64."""
    n = words.numel()
    whole = n // ROW
    step = ws.scratch.shape[0]
    for start in range(0, whole, step):  # one pass for a tensor up to `step` rows
        stop = min(start + step, whole)
        block = ws.scratch[: stop - start]
        _product(words[start * ROW : stop * ROW].view(stop - start, ROW), ws.columns, block, widen)
        torch.sum(block, 1, out=out[start:stop])
    tail = n - whole * ROW
    if tail:
        last = ws.scratch[0, :tail]
        _product(words[whole * ROW :], ws.columns[:tail], last, widen)
        torch.sum(last.view(1, tail), 1, out=out[whole : whole + 1])


# The fused kernel: each program sums SPAN words of one row into one partial; torch sums a row's partials. Bit for
# bit ``_row_sums``' (int64 wraps modulo 2**64 in Triton as in torch).
_SPAN = 1 << 14
_BLOCK = 1024
_kernel: Any = None  # the compiled Triton kernel, built on first use (None: not tried; False: no Triton here)


def _build_kernel() -> Any:
    import triton
    import triton.language as tl

    # Unannotated but for the constexprs: Triton reads a parameter's annotation as a type it must know.
    @triton.jit  # type: ignore[untyped-decorator]
    def row_partials(words, columns, out, n, ROW_: tl.constexpr, SPAN: tl.constexpr,  # type: ignore[no-untyped-def]
                     BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1)
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for start in range(0, SPAN, BLOCK):
            cols = part * SPAN + start + tl.arange(0, BLOCK)
            index = row * ROW_ + cols
            x = tl.load(words + index, mask=index < n, other=0).to(tl.int64)
            acc += x * tl.load(columns + cols)
        tl.store(out + row * (ROW_ // SPAN) + part, tl.sum(acc, axis=0))

    return row_partials


def kernel_available() -> bool:
    """Whether ``widen="kernel"`` can run: Triton imports and a CUDA device is there."""
    global _kernel
    if _kernel is None:
        try:
            _kernel = _build_kernel() if torch.cuda.is_available() else False
        except ImportError:
            _kernel = False
    return _kernel is not False


def _kernel_row_sums(words: torch.Tensor, ws: _Workspace, out: torch.Tensor) -> None:
    """``_row_sums``' result in one fused kernel launch plus one row sum of its partials (CUDA tensors)."""
    rows = out.numel()
    if rows == 0:
        return
    parts = ROW // _SPAN
    partials = torch.empty(rows * parts, dtype=torch.int64, device=words.device)
    _kernel[(rows, parts)](words, ws.columns, partials, words.numel(), ROW_=ROW, SPAN=_SPAN, BLOCK=_BLOCK)
    torch.sum(partials.view(rows, parts), 1, out=out)


def _segments(counts: list[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """For the rows of a batch (``counts`` rows per tensor): each row's tensor and its row index modulo ``_ROWS``."""
    sizes = torch.tensor(counts, dtype=torch.int64)
    segment = torch.repeat_interleave(torch.arange(len(counts)), sizes)
    starts = torch.cumsum(sizes, 0) - sizes
    index = (torch.arange(int(sizes.sum())) - torch.repeat_interleave(starts, sizes)) % _ROWS
    return segment.to(device), index.to(device)


def _weighted_totals(row_sums: torch.Tensor, counts: list[int], ws: _Workspace,
                     segments: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Per tensor ``sum_r u_r * row_sums[r]`` over its own rows, for the whole batch at once."""
    segment, index = segments if segments is not None else _segments(counts, row_sums.device)
    weighted = row_sums * ws.rows[index]
    return torch.zeros(len(counts), dtype=torch.int64, device=row_sums.device).index_add_(0, segment, weighted)


def tensor_digests(named: Iterable[tuple[str, torch.Tensor]], cache: DigestCache | None = None,
                   scratch_rows: int = SCRATCH_ROWS, widen: str | None = None) -> dict[str, str]:
    """Every tensor's digest by name, computed where each tensor lives; one host sync for the batch. ``cache`` keeps the
    weight vectors and scratch per device between calls; ``widen`` (``_row_sums``, or ``kernel``) changes speed, never a
    digest."""
    if widen not in (None, KERNEL, *WIDEN):
        raise ValueError(f"widen must be one of {(*WIDEN, KERNEL)}, not {widen!r}")
    cache = {} if cache is None else cache
    names: list[str] = []
    sizes: list[int] = []
    by_device: dict[torch.device, list[tuple[int, torch.Tensor]]] = {}
    for i, (name, t) in enumerate(named):
        names.append(name)
        sizes.append(t.numel() * t.element_size())
        by_device.setdefault(t.device, []).append((i, _words(t)))
    totals: list[tuple[list[int], torch.Tensor]] = []
    for device, entries in by_device.items():
        fused = device.type == "cuda" and kernel_available()
        how = widen or ((KERNEL if fused else "multiply") if device.type == "cuda" else "copy")
        if how == KERNEL and not fused:
            raise ValueError(f"widen={KERNEL!r} needs CUDA tensors and Triton (tensors on {device})")
        ws = _workspace(device, cache, scratch_rows if how != KERNEL else 1)
        counts = [_row_count(w.numel()) for _, w in entries]
        segments = _segments(counts, device)
        row_sums = torch.empty(sum(counts), dtype=torch.int64, device=device)
        at = 0
        for (_, w), rows in zip(entries, counts, strict=True):
            if how == KERNEL:
                _kernel_row_sums(w, ws, row_sums[at : at + rows])
            else:
                _row_sums(w, ws, row_sums[at : at + rows], how)
            at += rows
        totals.append(([i for i, _ in entries], _weighted_totals(row_sums, counts, ws, segments)))
    values: list[int] = [0] * len(names)
    for indices, on_device in totals:
        for i, v in zip(indices, on_device.tolist(), strict=True):
            values[i] = int(v) & _MASK
    return {n: digest_hex(v, nbytes) for n, v, nbytes in zip(names, values, sizes, strict=True)}


def digest_hex(weighted_sum: int, nbytes: int) -> str:
    """The wire form: the weighted sum with the byte count mixed in, as 16 hex digits."""
    mixed = (weighted_sum ^ ((nbytes * _LENGTH_MIX) & _MASK)) & _MASK
    return f"{mixed:0{DIGEST_HEX_CHARS}x}"
