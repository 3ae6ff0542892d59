"""The reference engine's model runner outside the engine: plain buffers and greedy decoding of one prompt, the
engine's code path without its server or scheduler (what engine outputs are compared with)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from colocd.engines.reference.model import QwenLikeForCausalLM, kv_pool_shape
from colocd.engines.reference.runner import ForwardInput, ModelRunner

__all__ = ["StaticBuffers", "generate_greedy"]


@dataclass(frozen=True, slots=True)
class StaticBuffers:
    """A KV pool and workspace sized for ``max_batch`` rows of ``max_seq`` tokens (the engine's are its
    ``MemoryRegions``)."""

    kv_pool: torch.Tensor
    workspace: torch.Tensor

    @classmethod
    def allocate(cls, model: QwenLikeForCausalLM, max_batch: int, max_seq: int) -> StaticBuffers:
        p = next(model.parameters())
        pool = torch.zeros(kv_pool_shape(model.config, max_batch, max_seq), dtype=p.dtype, device=p.device)
        workspace = torch.zeros((max_batch, model.config.vocab_size), dtype=torch.float32, device=p.device)
        return cls(pool, workspace)


def generate_greedy(
    runner: ModelRunner,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    slot: int = 0,
) -> list[int]:
    """Greedy decoding of one prompt through ``runner``."""
    out: list[int] = []
    pending, start = list(prompt), 0
    while len(out) < max_new_tokens:
        (res,) = runner.step([ForwardInput(slot=slot, tokens=pending, start=start)])
        out.append(res.token)
        if res.token == eos_id:
            break
        start += len(pending)
        pending = [res.token]
    return out
