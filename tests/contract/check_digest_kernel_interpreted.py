"""The fused digest kernel's arithmetic without a GPU: Triton's interpreter runs ``engines/digest.py``'s kernel on
CPU tensors (numpy's int64, which wraps as CUDA's does), and every row sum must equal torch's.

Not collected by pytest (the suite's venv has no Triton: a CUDA build of torch brings it). Run it with Triton on
the path, e.g. ``pip install --no-deps --target /tmp/tri triton`` then
``PYTHONPATH=/tmp/tri python tests/contract/check_digest_kernel_interpreted.py``; exit 1 on any difference.
The GPU spec ``tests/gpu/test_digest_kernel.py`` holds the compiled kernel to the same.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch

from colocd.engines import digest as D


def main() -> int:
    D._kernel = D._build_kernel()
    g = torch.Generator().manual_seed(3)
    cases = {
        "three_bytes": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "short_bf16": torch.randn(5, generator=g).to(torch.bfloat16),
        "one_row": torch.randn(D.ROW, generator=g),
        "rows_and_tail": torch.randint(-(1 << 31), (1 << 31) - 1, (D.ROW * 3 + 7,), dtype=torch.int32, generator=g),
        "extreme_words": torch.tensor([-(1 << 31), (1 << 31) - 1] * (D.ROW + 3), dtype=torch.int32),
        "matrix_bf16": torch.randn(257, 4099, generator=g).to(torch.bfloat16),
    }
    differ = []
    for name, t in cases.items():
        words = D._words(t)
        rows = D._row_count(words.numel())
        ws = D._workspace(torch.device("cpu"), {}, 4)
        torch_sums, kernel_sums = (torch.empty(rows, dtype=torch.int64) for _ in range(2))
        D._row_sums(words, ws, torch_sums, "copy")
        D._kernel_row_sums(words, ws, kernel_sums)
        same = torch.equal(torch_sums, kernel_sums)
        print(f"{name}: {rows} rows, {'same' if same else 'DIFFERENT'}")
        if not same:
            differ.append(name)
    print("every row sum the same" if not differ else f"different: {differ}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
