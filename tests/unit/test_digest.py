"""Per-tensor weight digests (engines/digest.py): the exact function, and what it tells apart."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from colocd.engines import digest as D
from colocd.engines.digest import ROW, tensor_digests


def _reference(t: torch.Tensor) -> str:
    """The documented function in numpy uint64 arithmetic (wrapping modulo 2**64 by definition)."""
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    raw += b"\0" * (-len(raw) % 4)
    words = np.frombuffer(raw, dtype=np.int32).astype(np.int64).astype(np.uint64)
    g = torch.Generator().manual_seed(D._SEED)
    columns = (torch.randint(0, 1 << 62, (ROW,), generator=g, dtype=torch.int64) | 1).numpy().astype(np.uint64)
    rows = (torch.randint(0, 1 << 62, (D._ROWS,), generator=g, dtype=torch.int64) | 1).numpy().astype(np.uint64)
    total = 0
    for start in range(0, len(words), ROW):
        part = words[start : start + ROW]
        with np.errstate(over="ignore"):
            row_sum = int(np.sum(part * columns[: len(part)], dtype=np.uint64))
        total = (total + row_sum * int(rows[(start // ROW) % D._ROWS])) % (1 << 64)
    return D.digest_hex(total, t.numel() * t.element_size())


@pytest.mark.parametrize("tensor", [
    torch.randn(3),
    torch.randn(300, 1000).to(torch.bfloat16),
    torch.randint(-128, 127, (ROW * 17 + 5,), dtype=torch.int8),  # more rows than one block, and a tail
    torch.randn(7).half(),  # 14 bytes: a padded last word
    torch.tensor([True, False, True]),
    torch.empty(0),
], ids=["f32", "bf16-2d", "int8-many-rows", "f16-odd", "bool", "empty"])
def test_the_digest_is_the_documented_function_of_the_bytes(tensor: torch.Tensor) -> None:
    assert tensor_digests([("t", tensor)]) == {"t": _reference(tensor)}


def test_every_single_bit_flip_changes_the_digest() -> None:
    t = torch.randn(ROW + 333, dtype=torch.float32)
    before = tensor_digests([("t", t)])["t"]
    raw = t.view(torch.uint8)
    for byte in (0, 1, 4 * ROW - 1, 4 * ROW, raw.numel() - 1):
        for bit in (0, 7):
            flipped = raw.clone()
            flipped[byte] ^= 1 << bit
            assert tensor_digests([("t", flipped.view(torch.float32))])["t"] != before, (byte, bit)


def test_the_digest_reads_bytes_so_dtype_views_agree_and_sizes_differ() -> None:
    t = torch.randn(64, 64).to(torch.bfloat16)
    views = tensor_digests([("bf16", t), ("int16", t.view(torch.int16)), ("u8", t.view(torch.uint8)),
                            ("flat", t.reshape(-1)), ("strided", t.t().contiguous().t())])
    assert len(set(views.values())) == 1
    padded = torch.cat([t.reshape(-1), torch.zeros(2, dtype=torch.bfloat16)])
    assert tensor_digests([("p", padded)])["p"] != views["bf16"]  # trailing zeros: another byte count


def test_swapped_rows_and_a_transposed_copy_are_told_apart() -> None:
    t = torch.randn(2 * ROW // 64, 64)
    swapped = torch.cat([t[ROW // 64 :], t[: ROW // 64]])
    square = torch.randn(128, 128)
    got = tensor_digests([("t", t), ("swapped", swapped), ("sq", square), ("sq_t", square.t().contiguous())])
    assert got["t"] != got["swapped"] and got["sq"] != got["sq_t"]


def test_a_misaligned_view_digests_like_its_copy() -> None:
    base = torch.randn(1001).to(torch.bfloat16)
    odd = base[1:]  # starts 2 bytes into its storage: no int32 view of it exists
    assert tensor_digests([("v", odd)]) == tensor_digests([("v", odd.clone())])


def test_one_batch_is_one_answer_per_name_in_order() -> None:
    named = [(f"t{i}", torch.full((i + 1,), float(i))) for i in range(5)]
    together = tensor_digests(named)
    assert list(together) == [n for n, _ in named]
    assert together == {n: tensor_digests([(n, t)])[n] for n, t in named}


@pytest.mark.parametrize("widen", D.WIDEN)
@pytest.mark.parametrize("scratch_rows", [1, 3, 64])
def test_the_digest_does_not_depend_on_the_scratch_size_or_the_widening(scratch_rows: int, widen: str) -> None:
    # 7 whole rows and a tail, beside a one-row tensor and an empty one: passes and batch segments line up.
    long = torch.randint(-(1 << 31), (1 << 31) - 1, (ROW * 7 + 11,), dtype=torch.int32)
    named = [("short", torch.randn(5)), ("long", long), ("empty", torch.empty(0)), ("row", torch.randn(ROW))]
    got = tensor_digests(named, {}, scratch_rows=scratch_rows, widen=widen)
    assert got == {n: _reference(t) for n, t in named}


def test_the_fused_kernel_is_refused_for_tensors_off_cuda() -> None:
    with pytest.raises(ValueError, match="kernel"):
        tensor_digests([("t", torch.randn(8))], widen=D.KERNEL)
