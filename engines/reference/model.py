"""A tiny Qwen-style causal LM with Hugging Face parameter names, for the demo trainer (full sequences, autograd)
and the reference engine (incremental decoding into a KV pool the engine owns and passes in)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["KVCacheView", "QwenLikeConfig", "QwenLikeForCausalLM", "build_model", "kv_pool_shape"]


@dataclass(frozen=True, slots=True)
class QwenLikeConfig:
    """Shape of the model; defaults give a ~70k-parameter model that fits the 32-token char vocab."""

    vocab_size: int = 32
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    max_position: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "max_position"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model config: num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"model config: head_dim must be even for rotary embeddings, got {self.head_dim}")

    @classmethod
    def from_overrides(cls, overrides: Mapping[str, Any]) -> QwenLikeConfig:
        """Defaults with ``overrides`` applied; an unknown key is an error that names it."""
        known = {f.name: f.type for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise ValueError(f"model config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**dict(overrides))


def kv_pool_shape(config: QwenLikeConfig, num_slots: int, max_seq: int) -> tuple[int, ...]:
    """Shape of the KV pool a ``KVCacheView`` points into: [layer, k|v, slot, position, kv_head, dim]."""
    return (config.num_layers, 2, num_slots, max_seq, config.num_kv_heads, config.head_dim)


@dataclass(frozen=True, slots=True)
class KVCacheView:
    """Which pool slots a batch decodes into (row b owns ``pool[:, :, slots[b]]``); ``valid[b, t]`` is False for
    right-padding, whose tokens neither write K/V nor are attended to."""

    pool: torch.Tensor
    slots: torch.Tensor
    valid: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + self.eps) * self.weight


class RotaryEmbedding(nn.Module):
    """cos/sin tables computed from positions on the fly (no max-length cache to keep in sync)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        # Non-persistent like HF's: not a weight, never sent by a trainer, rebuilt from the config.
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.to(self.inv_freq.dtype)[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, T, heads, dim]; cos/sin: [B, T, dim]
    return x * cos[:, :, None, :] + _rotate_half(x) * sin[:, :, None, :]


class Attention(nn.Module):
    def __init__(self, config: QwenLikeConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        h = config.hidden_size
        self.q_proj = nn.Linear(h, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(h, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(h, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                kv: KVCacheView | None) -> torch.Tensor:
        b, t, _ = x.shape
        q = _apply_rope(self.q_proj(x).view(b, t, self.num_heads, self.head_dim), cos, sin)
        k = _apply_rope(self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        if kv is None:
            keys, values, key_pos = k, v, positions[:, None, :]
        else:
            layer = kv.pool[self.layer_idx]
            rows, cols = kv.valid.nonzero(as_tuple=True)
            slot, pos = kv.slots[rows], positions[rows, cols]
            # Write before reading: a token attends to itself through the pool.
            layer[0, slot, pos] = k[rows, cols]
            layer[1, slot, pos] = v[rows, cols]
            span = int(positions.max()) + 1
            keys, values = layer[0, kv.slots, :span], layer[1, kv.slots, :span]
            key_pos = torch.arange(span, device=x.device)[None, None, :]
        # Causality by position, not index: the same rule holds for full sequences and for decoding.
        mask = key_pos <= positions[:, :, None]
        out: torch.Tensor = self.o_proj(self._attend(q, keys, values, mask).reshape(b, t, -1))
        return out

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        q = q.transpose(1, 2)
        k = k.repeat_interleave(groups, dim=2).transpose(1, 2)
        v = v.repeat_interleave(groups, dim=2).transpose(1, 2)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(self.head_dim)
        scores = scores.masked_fill(~mask[:, None, :, :], float("-inf"))
        return (scores.softmax(dim=-1) @ v).transpose(1, 2)


class MLP(nn.Module):
    def __init__(self, config: QwenLikeConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    def __init__(self, config: QwenLikeConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                kv: KVCacheView | None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class QwenLikeModel(nn.Module):
    def __init__(self, config: QwenLikeConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope_theta)


class QwenLikeForCausalLM(nn.Module):
    """The causal LM. ``forward`` returns logits [B, T, vocab]; with a ``KVCacheView`` it decodes."""

    def __init__(self, config: QwenLikeConfig) -> None:
        super().__init__()
        self.config = config
        self.model = QwenLikeModel(config)
        self.lm_head = None if config.tie_word_embeddings else nn.Linear(config.hidden_size, config.vocab_size,
                                                                          bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache_view: KVCacheView | None = None) -> torch.Tensor:
        """Logits for every input position: of whole sequences (``positions`` 0..T-1 by default), or with a cache of
        the tokens not yet in the pool (right-padded, see ``KVCacheView.valid``) at their absolute ``positions``."""
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        if int(positions.max()) >= self.config.max_position:
            raise ValueError(f"position {int(positions.max())} exceeds max_position {self.config.max_position}")
        x: torch.Tensor = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions)
        for layer in self.model.layers:
            x = layer(x, cos, sin, positions, kv_cache_view)
        x = self.model.norm(x)
        if self.lm_head is None:
            return x @ self.model.embed_tokens.weight.T
        logits: torch.Tensor = self.lm_head(x)
        return logits

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy tensors into the live parameters by HF name and return the names applied, all or nothing: every name,
        shape and dtype is checked before the first copy (``ValueError`` naming the tensor). A tied ``lm_head.weight``
        is skipped, as HF loaders do."""
        params = dict(self.named_parameters())
        staged: list[tuple[nn.Parameter, torch.Tensor, str]] = []
        for name, tensor in named_tensors:
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            param = params.get(name)
            if param is None:
                raise ValueError(f"unknown parameter {name!r}")
            if tuple(tensor.shape) != tuple(param.shape):
                raise ValueError(f"parameter {name!r}: shape {list(tensor.shape)} does not match "
                                 f"the model's {list(param.shape)}")
            if tensor.dtype != param.dtype:
                raise ValueError(f"parameter {name!r}: dtype {tensor.dtype} does not match the model's {param.dtype}")
            staged.append((param, tensor, name))
        with torch.no_grad():
            for param, tensor, _ in staged:
                param.copy_(tensor)
        return [name for _, _, name in staged]


def build_model(config: QwenLikeConfig, seed: int, device: str | torch.device = "cpu") -> QwenLikeForCausalLM:
    """The model with weights drawn from ``seed`` on CPU, then moved: same seed, same bytes on any device. Linear
    weights are N(0, 1/fan_in) and embeddings N(0, 1), so greedy choices are far from ties; norm weights are
    1 + N(0, 0.1²) so that every tensor depends on the seed."""
    with torch.device("cpu"):
        model = QwenLikeForCausalLM(config)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.1 * torch.randn(param.shape, generator=gen))
            elif name == "model.embed_tokens.weight":
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(param.shape[1]))
    return model.to(device)
