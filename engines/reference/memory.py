"""The reference engine's memory, split into SGLang's three tags, each really freed and reallocated.

- ``weights``: the model's parameters (and its small buffers, stashed and restored like SGLang's).
- ``kv_cache``: the KV pool, ``max_batch`` slots of ``max_seq`` positions.
- ``cuda_graph``: the reference engine captures no CUDA graphs; this tag owns the decode
  workspace (the per-step logits buffer sampling reads from), so releasing it is still real.

Release drops the storage (parameters keep their Python identity, shape and dtype as metadata);
resume allocates with ``torch.empty``, so weights hold garbage until the next push, as in SGLang
without ``--enable-weights-cpu-backup``. Unlike SGLang, a release of a released tag or a resume of a
resident one is refused with ``MemoryTagError`` naming the tag, instead of killing the process.
This module knows nothing of requests, HTTP or scheduling; callers keep generation off it while
anything is released.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from ..base import ALL_TAGS, MemoryTag, TagState
from .model import QwenLikeForCausalLM, kv_pool_shape

__all__ = [
    "MemoryRegions",
    "MemoryTagError",
    "TagState",
    "normalize_tags",
]

# SGLang's order (scheduler_components/weight_updater.py:337-426): release kv → weights → graph,
# resume graph → weights → kv, so the biggest allocations come back last.
_RELEASE_ORDER = (MemoryTag.KV_CACHE, MemoryTag.WEIGHTS, MemoryTag.CUDA_GRAPH)
_RESUME_ORDER = (MemoryTag.CUDA_GRAPH, MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)


class MemoryTagError(ValueError):
    """A release or resume that does not fit a tag's current state; names the tag and the state."""

    def __init__(self, tag: str, state: str, action: str) -> None:
        super().__init__(f"cannot {action} memory tag {tag!r}: it is already {state}")
        self.tag = tag
        self.state = state


def normalize_tags(tags: Iterable[str] | None) -> tuple[MemoryTag, ...]:
    """SGLang's rule: None or [] means every tag; an unknown name is an error naming it."""
    if not tags:
        return ALL_TAGS
    out: list[MemoryTag] = []
    for t in tags:
        try:
            tag = MemoryTag(t)
        except ValueError:
            raise ValueError(f"unknown memory tag {t!r}; known: {[x.value for x in ALL_TAGS]}") from None
        if tag not in out:
            out.append(tag)
    return tuple(out)


class MemoryRegions:
    """Owns the three tagged regions of one engine and moves them between resident and released."""

    def __init__(
        self,
        model: QwenLikeForCausalLM,
        *,
        max_batch: int,
        max_seq: int,
        device: torch.device,
    ) -> None:
        self._model = model
        self._device = device
        self._dtype = next(model.parameters()).dtype
        self._kv_shape = kv_pool_shape(model.config, max_batch, max_seq)
        self._workspace_shape = (max_batch, model.config.vocab_size)
        self._param_meta = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
        self._buffer_stash: dict[str, torch.Tensor] = {}
        self._kv_pool: torch.Tensor | None = torch.zeros(self._kv_shape, dtype=self._dtype, device=device)
        self._workspace: torch.Tensor | None = torch.zeros(
            self._workspace_shape, dtype=torch.float32, device=device
        )
        self._states = dict.fromkeys(ALL_TAGS, TagState.RESIDENT)

    # --- what the runner reads -------------------------------------------------------------------

    @property
    def kv_pool(self) -> torch.Tensor:
        if self._kv_pool is None:
            raise RuntimeError("memory tag 'kv_cache' is released")
        return self._kv_pool

    @property
    def workspace(self) -> torch.Tensor:
        if self._workspace is None:
            raise RuntimeError("memory tag 'cuda_graph' is released (it owns the decode workspace)")
        return self._workspace

    # --- state -----------------------------------------------------------------------------------

    def state(self, tag: MemoryTag) -> TagState:
        return self._states[tag]

    @property
    def all_resident(self) -> bool:
        return all(s is TagState.RESIDENT for s in self._states.values())

    def resident_nbytes(self, tag: MemoryTag) -> int:
        """Bytes the tag holds when resident (its size, whatever its state now)."""
        if tag is MemoryTag.WEIGHTS:
            params = sum(math.prod(shape) * dtype.itemsize for shape, dtype in self._param_meta.values())
            return params + sum(b.nbytes for b in self._buffers_now_or_stashed())
        if tag is MemoryTag.KV_CACHE:
            return math.prod(self._kv_shape) * self._dtype.itemsize
        return math.prod(self._workspace_shape) * torch.float32.itemsize

    def nbytes(self, tag: MemoryTag) -> int:
        """Bytes the tag holds right now (0 once released)."""
        return self.resident_nbytes(tag) if self._states[tag] is TagState.RESIDENT else 0

    def check(self, tags: Iterable[MemoryTag], *, resume: bool) -> None:
        """Raise ``MemoryTagError`` for the first tag not in the state the action needs."""
        needed = TagState.RELEASED if resume else TagState.RESIDENT
        for tag in tags:
            if self._states[tag] is not needed:
                raise MemoryTagError(tag.value, self._states[tag].value, "resume" if resume else "release")

    # --- transitions (run on the model thread) ---------------------------------------------------

    def release(self, tags: Iterable[MemoryTag]) -> None:
        """Free the tags' storage and give it back to the device; checks every tag first, so a refused call changes
        nothing."""
        tags = tuple(t for t in _RELEASE_ORDER if t in set(tags))
        self.check(tags, resume=False)
        if self._device.type == "cuda":
            # No kernel may still read memory we are about to drop (sgl-project/sglang#31073).
            torch.cuda.synchronize(self._device)
        for tag in tags:
            if tag is MemoryTag.WEIGHTS:
                self._release_weights()
            elif tag is MemoryTag.KV_CACHE:
                self._kv_pool = None
            else:
                self._workspace = None
            self._states[tag] = TagState.RELEASED
        self.empty_cache()

    def resume(self, tags: Iterable[MemoryTag]) -> None:
        """Reallocate the tags (weights as ``torch.empty``: garbage until weights are pushed again)."""
        tags = tuple(t for t in _RESUME_ORDER if t in set(tags))
        self.check(tags, resume=True)
        for tag in tags:
            if tag is MemoryTag.WEIGHTS:
                self._resume_weights()
            elif tag is MemoryTag.KV_CACHE:
                self._kv_pool = torch.zeros(self._kv_shape, dtype=self._dtype, device=self._device)
            else:
                self._workspace = torch.zeros(self._workspace_shape, dtype=torch.float32, device=self._device)
            self._states[tag] = TagState.RESIDENT
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def empty_cache(self) -> None:
        if self._device.type == "cuda":
            with torch.cuda.device(self._device):  # the cache of this region's GPU, not the current one
                torch.cuda.empty_cache()

    # --- helpers ---------------------------------------------------------------------------------

    def _release_weights(self) -> None:
        for p in self._model.parameters():
            # Replacing .data keeps the Parameter objects (and the model's structure) alive while
            # dropping the last reference to the storage.
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for name, module, attr in self._buffer_slots():
            buf = getattr(module, attr)
            self._buffer_stash[name] = buf.detach().to("cpu", copy=True)
            setattr(module, attr, torch.empty(0, dtype=buf.dtype, device=buf.device))

    def _resume_weights(self) -> None:
        params = dict(self._model.named_parameters())
        for name, (shape, dtype) in self._param_meta.items():
            params[name].data = torch.empty(shape, dtype=dtype, device=self._device)
        # Buffers come back intact (rotary tables are derived, not trained), as SGLang restores them.
        for name, module, attr in self._buffer_slots():
            setattr(module, attr, self._buffer_stash.pop(name).to(self._device))

    def _buffer_slots(self) -> list[tuple[str, nn.Module, str]]:
        out = []
        for mod_name, module in self._model.named_modules():
            for attr, _ in module.named_buffers(recurse=False):
                out.append((f"{mod_name}.{attr}" if mod_name else attr, module, attr))
        return out

    def _buffers_now_or_stashed(self) -> list[torch.Tensor]:
        if self._states[MemoryTag.WEIGHTS] is TagState.RESIDENT:
            return [b for _, b in self._model.named_buffers()]
        return list(self._buffer_stash.values())
