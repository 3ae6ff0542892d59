"""One batched model step over the KV pool: prefill and decode rows together, then pick each row's token.

Runs on the engine's model thread; knows nothing of requests' lifetimes, stop rules or HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from .model import KVCacheView, QwenLikeForCausalLM, kv_pool_shape
from .sampling import GREEDY, SamplingConfig, choose_token

__all__ = ["ForwardInput", "ForwardOutput", "ModelRunner", "RunnerBuffers", "StaticBuffers", "generate_greedy"]


class RunnerBuffers(Protocol):
    """Where the runner's preallocated tensors live (``MemoryRegions`` in the engine)."""

    @property
    def kv_pool(self) -> torch.Tensor: ...

    @property
    def workspace(self) -> torch.Tensor: ...


@dataclass(frozen=True, slots=True)
class StaticBuffers:
    """Plain buffers for using the runner outside the engine (tests, the trainer's evaluation)."""

    kv_pool: torch.Tensor
    workspace: torch.Tensor

    @classmethod
    def allocate(cls, model: QwenLikeForCausalLM, max_batch: int, max_seq: int) -> StaticBuffers:
        p = next(model.parameters())
        pool = torch.zeros(kv_pool_shape(model.config, max_batch, max_seq), dtype=p.dtype, device=p.device)
        workspace = torch.zeros((max_batch, model.config.vocab_size), dtype=torch.float32, device=p.device)
        return cls(pool, workspace)


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
        self.model = model
        self.buffers = buffers

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
        view = KVCacheView(
            pool=self.buffers.kv_pool,
            slots=torch.tensor([r.slot for r in rows], dtype=torch.long, device=device),
            valid=valid.to(device),
        )
        logits = self.model(ids.to(device), positions.to(device), view)
        last = torch.tensor([len(r.tokens) - 1 for r in rows], device=device)
        workspace = self.buffers.workspace[: len(rows)]
        workspace.copy_(logits[torch.arange(len(rows), device=device), last])
        rows_cpu = workspace.cpu()
        out = []
        for b, r in enumerate(rows):
            token, logprob = choose_token(rows_cpu[b], r.sampling, r.generator)
            prompt_lp = None
            if r.prompt_logprobs and len(r.tokens) > 1:
                lp = torch.log_softmax(logits[b, : len(r.tokens) - 1].float(), dim=-1).cpu()
                nxt = torch.tensor(r.tokens[1:], dtype=torch.long)
                prompt_lp = lp.gather(1, nxt[:, None]).squeeze(1).tolist()
            out.append(ForwardOutput(token, logprob, prompt_lp if r.prompt_logprobs else None))
        return out


def generate_greedy(
    runner: ModelRunner,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    slot: int = 0,
) -> list[int]:
    """Greedy decoding of one prompt through ``runner``: the engine's code path, without its server."""
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
