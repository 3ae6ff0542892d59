"""One batched model step over the KV pool: prefill and decode rows together, then pick each row's token.

Sampling runs on CPU with a per-request ``torch.Generator``, so a seeded request gives the same tokens whatever
device the model runs on and whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .model import KVCacheView, QwenLikeForCausalLM

__all__ = ["GREEDY", "ForwardInput", "ForwardOutput", "ModelRunner", "RunnerBuffers", "SamplingConfig", "choose_token"]


_EPS = 1e-6  # SGLang treats temperatures below this as greedy (sampling_params.py _SAMPLING_EPS)


@dataclass(frozen=True, slots=True)
class SamplingConfig:
    """The sampling knobs the reference engine honours; ``top_k <= 0`` means no top-k cut."""

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS or self.top_k == 1


GREEDY = SamplingConfig(temperature=0.0)


def choose_token(logits: torch.Tensor, config: SamplingConfig, generator: torch.Generator | None) -> tuple[int, float]:
    """(token id, its log-probability under the raw logits) for a 1-D CPU float tensor of logits."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if config.greedy:
        token = int(torch.argmax(logits))
        return token, float(logprobs[token])
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if 0 < config.top_k < probs.numel():
        kth = torch.topk(probs, config.top_k).values[-1]
        probs = torch.where(probs >= kth, probs, torch.zeros_like(probs))
    if config.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token is always kept).
        drop_sorted = (cumulative - sorted_probs) >= config.top_p * cumulative[-1]
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop_sorted, 0.0))
    if config.min_p > 0.0:
        probs = torch.where(probs >= config.min_p * probs.max(), probs, torch.zeros_like(probs))
    # Garbage weights (resumed without a weight push) can give NaN logits: never let that crash
    # the scheduler, fall back to the argmax of whatever is finite.
    probs = torch.nan_to_num(probs, nan=0.0, posinf=0.0, neginf=0.0)
    if float(probs.sum()) <= 0.0:
        token = int(torch.argmax(torch.nan_to_num(logits, nan=float("-inf"))))
    else:
        token = int(torch.multinomial(probs, 1, generator=generator))
    return token, float(logprobs[token])


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
