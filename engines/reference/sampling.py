"""Choosing the next token from one row of logits: greedy at temperature 0, else top-k/top-p/min-p sampling.

Sampling always runs on CPU with a per-request ``torch.Generator``, so a seeded request gives the
same tokens whatever device the model runs on and whatever else shares its batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["GREEDY", "SamplingConfig", "choose_token"]

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
