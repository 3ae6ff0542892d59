"""A stand-in ``sgl_kernel`` for running SGLang's CPU engine in colocd's test environment only.

PyPI has only CUDA builds of sgl-kernel, yet with ``SGLANG_USE_CPU_ENGINE=1`` SGLang imports a few of its
CPU ops at module import. This module registers no ``torch.ops.sgl_kernel`` op, so SGLang's
``cpu_has_amx_support()`` is False and every layer takes its plain-torch ``forward_native`` path. Of the
names SGLang imports from here, only :func:`assign_req_to_token_pool_cpu` is called for a text model; every
other name is a function that raises ``NotImplementedError`` when called, naming itself.

Never install this next to a real sgl-kernel, and never in production: it exists so CI can run a real
SGLang server on a CPU machine (scripts/install-sglang-cpu.sh puts it into that server's venv).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn

import torch

__version__ = "0.0.0+colocd-test-shim"


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """For each request i: ``req_to_token[req_pool_indices[i], start[i]:end[i]]`` = its run of ``out_cache_loc``.

    The runs are consecutive in ``out_cache_loc`` in request order: request i's run starts after the
    lengths of requests 0..i-1 (the contract of SGLang's Triton ``assign_req_to_token_pool`` kernel).
    """
    del pool_len  # the row length; req_to_token's own shape says it
    starts = start_offset.tolist()
    ends = end_offset.tolist()
    rows = req_pool_indices.tolist()
    offset = 0
    for row, start, end in zip(rows, starts, ends, strict=True):
        n = end - start
        req_to_token[row, start:end] = out_cache_loc[offset:offset + n].to(req_to_token.dtype)
        offset += n


def _missing(name: str) -> Callable[..., NoReturn]:
    def op(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"sgl_kernel.{name}: colocd's CPU test shim implements only "
                                  "assign_req_to_token_pool_cpu")
    op.__name__ = name
    return op


def __getattr__(name: str) -> Callable[..., NoReturn]:
    if name.startswith("__"):
        raise AttributeError(name)
    return _missing(name)
