"""One batched model step over the KV pool: prefill and decode rows together, then pick each row's token.

Runs on the engine's model thread; knows nothing of requests' lifetimes, stop rules or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .model import KVCacheView, QwenLikeForCausalLM
from .sampling import GREEDY, SamplingConfig, choose_token

__all__ = ["ForwardInput", "ForwardOutput", "ModelRunner", "RunnerBuffers"]


class RunnerBuffers(Protocol):
    """Where the runner's preallocated tensors live (``MemoryRegions`` in the engine)."""

    @property
    def kv_pool(self) -> torch.Tensor: ...

    @property
    def workspace(self) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class ForwardInput:
    """One row: the tokens not yet in the pool for ``slot``, starting at position ``start``."""

    slot: int
    tokens: Sequence[int]
    start: int
    sampling: SamplingConfig = GREEDY
    generator: torch.Generator | None = None
    prompt_logprobs: bool = False


@dataclass(frozen=True, slots=True)
class ForwardOutput:
    """The row's next token, its log-probability, and (if asked) the logprob of each input token
    after the first given the ones before it."""

    token: int
    logprob: float
    prompt_logprobs: list[float] | None = None


class ModelRunner:
    """Runs ``step`` for a batch; the caller owns slot assignment and what happens between steps."""

    def __init__(self, model: QwenLikeForCausalLM, buffers: RunnerBuffers) -> None:
        self.model, self.buffers = model, buffers

    @torch.no_grad()
    def step(self, rows: Sequence[ForwardInput]) -> list[ForwardOutput]:
        if not rows:
            return []
        device = next(self.model.parameters()).device
        width = max(len(r.tokens) for r in rows)
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        positions = torch.zeros((len(rows), width), dtype=torch.long)
        valid = torch.zeros((len(rows), width), dtype=torch.bool)
        for b, r in enumerate(rows):
            n = len(r.tokens)
            ids[b, :n] = torch.tensor(r.tokens, dtype=torch.long)
            positions[b, :n] = torch.arange(r.start, r.start + n)
            valid[b, :n] = True
        view = KVCacheView(self.buffers.kv_pool, torch.tensor([r.slot for r in rows], dtype=torch.long, device=device),
                           valid.to(device))
        logits = self.model(ids.to(device), positions.to(device), view)
        last = torch.tensor([len(r.tokens) - 1 for r in rows], device=device)
        workspace = self.buffers.workspace[: len(rows)]
        workspace.copy_(logits[torch.arange(len(rows), device=device), last])
        rows_cpu = workspace.cpu()
        out = []
        for b, r in enumerate(rows):
            token, logprob = choose_token(rows_cpu[b], r.sampling, r.generator)
            prompt_lp: list[float] | None = None
            if r.prompt_logprobs and len(r.tokens) > 1:
                lp = torch.log_softmax(logits[b, : len(r.tokens) - 1].float(), dim=-1).cpu()
                prompt_lp = lp.gather(1, torch.tensor(r.tokens[1:], dtype=torch.long)[:, None]).squeeze(1).tolist()
            out.append(ForwardOutput(token, logprob, prompt_lp))
        return out
