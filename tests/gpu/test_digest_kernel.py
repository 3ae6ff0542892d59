"""The fused digest kernel (engines/digest.py ``widen="kernel"``, Triton) gives every digest bit for bit as torch's
kernels do, on CUDA tensors of every shape class: empty, under a word, a tail, exactly a row, rows and a tail,
several dtypes, many in one batch; and it is CUDA's default where Triton imports."""

from __future__ import annotations

import pytest
import torch

from colocd.engines import digest as D
from colocd.engines.digest import ROW, tensor_digests

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator(device="cuda").manual_seed(3)
    words = torch.randint(-(1 << 31), (1 << 31) - 1, (ROW * 5 + 7,), dtype=torch.int32, device="cuda", generator=g)
    return [
        ("empty", torch.empty(0, device="cuda")),
        ("three_bytes", torch.tensor([1, 2, 3], dtype=torch.uint8, device="cuda")),
        ("short_bf16", torch.randn(5, device="cuda", generator=g).to(torch.bfloat16)),
        ("one_row", torch.randn(ROW, device="cuda", generator=g)),
        ("rows_and_tail", words),
        ("matrix_bf16", torch.randn(1537, 4099, device="cuda", generator=g).to(torch.bfloat16)),
        ("extreme_words", torch.tensor([-(1 << 31), (1 << 31) - 1] * (ROW + 3), dtype=torch.int32, device="cuda")),
    ]


def test_the_kernel_gives_every_digest_as_torchs_kernels_and_the_cpu_do() -> None:
    assert D.kernel_available()
    named = _tensors()
    kernel = tensor_digests(named, {}, widen=D.KERNEL)
    assert kernel == tensor_digests(named, {}, widen="multiply")
    assert kernel == tensor_digests([(n, t.cpu()) for n, t in named], {})


def test_the_kernel_is_cudas_default_and_a_changed_word_changes_the_digest() -> None:
    named = _tensors()
    default = tensor_digests(named, {})
    assert default == tensor_digests(named, {}, widen=D.KERNEL)
    words = named[4][1].clone()
    words[ROW * 3 + 1] += 1
    assert tensor_digests([("rows_and_tail", words)], {})["rows_and_tail"] != default["rows_and_tail"]
