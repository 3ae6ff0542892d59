"""Benchmark sink: engine-owned bf16 tensors shaped like a real checkpoint, which weight loads copy into.

The reference engine's own model is tiny; run as ``benchmarks.sink_engine`` with the shapes of qwen3-8b it
also holds the 399 tensors of Qwen3-8B (HF names and shapes) and ``load_weights`` copies every received byte into
them, so a benchmark moves exactly what a real engine would. ``device_checksum`` verifies the
result on the device (two integer reductions per tensor) instead of hashing host copies.

With a KV size (``sink_launch``) the sink also holds a KV-cache block of that size. Both belong to the
engine's memory tags (``weights``, ``kv_cache``): a release frees them, a resume allocates them
again (``torch.empty``: like SGLang's memory saver, a resume maps memory without restoring it), so a
switch benchmark moves and confirms the memory a real engine of that shape would.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .load_plan import LoadPlans, copy_tensors, destination

__all__ = ["MODEL_SHAPES", "ModelShape", "WeightSink", "device_checksum", "hf_shapes"]


@dataclass(frozen=True, slots=True)
class ModelShape:
    """The sizes that fix every tensor of a Qwen3 dense checkpoint (config.json's fields)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tie_word_embeddings: bool


# Qwen/Qwen3-*/config.json. "tiny" keeps the structure at a few MB, for CPU smoke runs.
MODEL_SHAPES: dict[str, ModelShape] = {
    "tiny": ModelShape(256, 768, 4, 4, 2, 64, 8192, True),
    "qwen3-0.6b": ModelShape(1024, 3072, 28, 16, 8, 128, 151936, True),
    "qwen3-8b": ModelShape(4096, 12288, 36, 32, 8, 128, 151936, False),
    "qwen3-14b": ModelShape(5120, 17408, 40, 40, 8, 128, 151936, False),
}


def hf_shapes(model: str) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor of the checkpoint, in HF order: (name, shape)."""
    try:
        m = MODEL_SHAPES[model]
    except KeyError:
        raise ValueError(f"unknown model shape {model!r}; known: {sorted(MODEL_SHAPES)}") from None
    q, kv = m.heads * m.head_dim, m.kv_heads * m.head_dim
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (m.vocab, m.hidden))]
    for i in range(m.layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (m.hidden,)),
            (p + "self_attn.q_proj.weight", (q, m.hidden)),
            (p + "self_attn.k_proj.weight", (kv, m.hidden)),
            (p + "self_attn.v_proj.weight", (kv, m.hidden)),
            (p + "self_attn.o_proj.weight", (m.hidden, q)),
            (p + "self_attn.q_norm.weight", (m.head_dim,)),
            (p + "self_attn.k_norm.weight", (m.head_dim,)),
            (p + "post_attention_layernorm.weight", (m.hidden,)),
            (p + "mlp.gate_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.up_proj.weight", (m.intermediate, m.hidden)),
            (p + "mlp.down_proj.weight", (m.hidden, m.intermediate)),
        ]
    out.append(("model.norm.weight", (m.hidden,)))
    if not m.tie_word_embeddings:
        out.append(("lm_head.weight", (m.vocab, m.hidden)))
    return out


_PRIME = 251  # position weights repeat every 251 bytes: catches shifts and transposes a plain sum misses
# Bytes summed per reduction: a whole multiple of _PRIME, so each block's columns line up with the tensor's, and
# small enough that the int64 accumulation of one block stays a bounded temporary (not 8x the largest tensor).
_BLOCK = _PRIME * (1 << 18)


def device_checksum(tensors: Iterable[torch.Tensor]) -> list[list[int]]:
    """Per tensor ``[sum of its bytes, position-weighted sum]``, computed where the tensor lives.

    Integer sums are exact and independent of reduction order, so trainer and engine agree
    bit for bit; one host sync for the whole list. Tensors are summed in blocks of ``_BLOCK`` bytes, so a
    checksum's temporaries stay under a few hundred MiB whatever the tensor's size.
    """
    sums = []
    for t in tensors:
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)
        whole = flat.numel() // _PRIME * _PRIME
        weights = torch.arange(1, _PRIME + 1, device=flat.device, dtype=torch.int64)
        columns = torch.zeros(_PRIME, device=flat.device, dtype=torch.int64)
        for start in range(0, whole, _BLOCK):
            columns += flat[start : min(start + _BLOCK, whole)].view(-1, _PRIME).sum(0, dtype=torch.int64)
        tail = flat[whole:].to(torch.int64)
        weighted = (columns * weights).sum() + (tail * weights[: tail.numel()]).sum()
        sums.append(torch.stack([columns.sum() + tail.sum(), weighted]))
    if not sums:
        return []
    result: list[list[int]] = torch.stack(sums).tolist()
    return result


class WeightSink:
    """Destination tensors of one model shape on one device; ``load_weights`` copies into them by name."""

    def __init__(self, model: str, device: torch.device, dtype: torch.dtype = torch.bfloat16,
                 kv_bytes: int = 0) -> None:
        if kv_bytes < 0:
            raise ValueError(f"kv_bytes must be >= 0, got {kv_bytes}")
        self.model = model
        self._device = device
        self._dtype = dtype
        self._shapes = hf_shapes(model)
        # Uninitialised on purpose: every byte is overwritten by a load, and checksums prove it.
        self.tensors: dict[str, torch.Tensor] = {}
        self._where = f"sink {model}"  # names this sink in errors
        self._plans = LoadPlans(self._where)
        self.resume_weights()
        self.nbytes = sum(t.numel() * t.element_size() for t in self.tensors.values())
        self.kv_bytes = kv_bytes
        self._kv: torch.Tensor | None = None
        self.resume_kv()
        # Seconds the last load_weights spent checking names/shapes and queueing the copies (the engine's
        # per-stage breakdown of a load, shown by ``benchmarks.weights``).
        self.last_load: dict[str, float] = {}

    # Release/resume are called by the engine's MemoryRegions with its tags, on the model thread.
    def release_weights(self) -> None:
        self.tensors = {}
        self._plans.clear()

    def resume_weights(self) -> None:
        self.tensors = {
            name: torch.empty(shape, dtype=self._dtype, device=self._device) for name, shape in self._shapes
        }

    def release_kv(self) -> None:
        self._kv = None

    def resume_kv(self) -> None:
        if self.kv_bytes:
            self._kv = torch.empty(self.kv_bytes, dtype=torch.uint8, device=self._device)

    def _check_held(self) -> None:
        if not self.tensors:
            raise ValueError(f"{self._where}: its weights are released; resume them first")

    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
        """Copy each tensor into its destination; every name, shape and dtype is checked before any copy."""
        self._check_held()
        t0 = time.perf_counter()
        names, dsts, srcs = [], [], []
        for name, src in named:
            names.append(name)
            dsts.append(destination(self.tensors, self._where, name, src.shape, src.dtype))
            srcs.append(src)
        t1 = time.perf_counter()
        # Queued, not waited for: the engine synchronises once before replying.
        copy_tensors(dsts, srcs)
        self.last_load = {"checks_s": t1 - t0, "copy_launch_s": time.perf_counter() - t1}
        return names

    def load_bucket(self, flat: torch.Tensor, metadata: Sequence[Any]) -> list[str]:
        """Copy a ``flattened_bucket``'s tensors into their destinations by the plan for its shape
        (``LoadPlans``: checked in full on the first chunk of a shape, before any copy)."""
        self._check_held()
        t0 = time.perf_counter()
        plan = self._plans.plan(flat, metadata, self.tensors)
        t1 = time.perf_counter()
        names = plan.apply(flat)  # views and copy launches, interleaved
        self.last_load = {"checks_s": t1 - t0, "copy_launch_s": time.perf_counter() - t1}
        return names

    def checksums(self) -> dict[str, list[int]]:
        """``device_checksum`` of every destination tensor, by name (empty while released)."""
        return dict(zip(self.tensors, device_checksum(self.tensors.values()), strict=True))
