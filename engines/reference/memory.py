"""The reference engine's memory, split into SGLang's three tags, each really freed and reallocated.

- ``weights``: the model's parameters (its buffers, the rotary table derived from the config, stay).
- ``kv_cache``: the KV pool, ``max_batch`` slots of ``max_seq`` positions.
- ``cuda_graph``: the reference engine captures no CUDA graphs; this tag owns the decode
  workspace (the per-step logits buffer sampling reads from), so releasing it is still real.

Release drops the storage (parameters keep their identity, shape and dtype); resume allocates with ``torch.empty``,
so weights hold garbage until the next push, as in SGLang without ``--enable-weights-cpu-backup``. Unlike SGLang, a
release of a released tag or a resume of a resident one is refused (``MemoryTagError``) instead of killing the process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ..base import ALL_TAGS, MemoryTag, TagState
from .model import QwenLikeForCausalLM, kv_pool_shape

__all__ = ["MemoryRegions", "MemoryTagError", "TagState", "normalize_tags"]


class MemoryTagError(ValueError):
    """A release or resume that does not fit a tag's current state; names the tag and the state."""


def normalize_tags(tags: Iterable[str] | None) -> tuple[MemoryTag, ...]:
    """SGLang's rule: None or [] means every tag; an unknown name is an error naming it."""
    known = {t.value: t for t in ALL_TAGS}
    if unknown := [t for t in tags or () if t not in known]:
        raise ValueError(f"unknown memory tag {unknown[0]!r}; known: {list(known)}")
    return tuple(dict.fromkeys(known[t] for t in tags)) if tags else ALL_TAGS


class MemoryRegions:
    """Owns the three tagged regions of one engine and moves them between resident and released."""

    def __init__(self, model: QwenLikeForCausalLM, *, max_batch: int, max_seq: int, device: torch.device) -> None:
        self._model, self._device = model, device
        self._params = {name: (tuple(p.shape), p.dtype) for name, p in model.named_parameters()}
        # The two buffers the runner reads: the KV pool (kv_cache) and the decode workspace (cuda_graph).
        dtype = next(model.parameters()).dtype
        self._shapes = {MemoryTag.KV_CACHE: (kv_pool_shape(model.config, max_batch, max_seq), dtype),
                        MemoryTag.CUDA_GRAPH: ((max_batch, model.config.vocab_size), torch.float32)}
        self._buffers: dict[MemoryTag, torch.Tensor | None] = {t: self._allocate(t) for t in self._shapes}
        self._states = dict.fromkeys(ALL_TAGS, TagState.RESIDENT)

    def _allocate(self, tag: MemoryTag) -> torch.Tensor:
        shape, dtype = self._shapes[tag]
        return torch.zeros(shape, dtype=dtype, device=self._device)

    def _buffer(self, tag: MemoryTag) -> torch.Tensor:
        if (buffer := self._buffers[tag]) is None:
            raise RuntimeError(f"memory tag {tag.value!r} is released")
        return buffer

    @property
    def kv_pool(self) -> torch.Tensor:
        return self._buffer(MemoryTag.KV_CACHE)

    @property
    def workspace(self) -> torch.Tensor:
        return self._buffer(MemoryTag.CUDA_GRAPH)

    def state(self, tag: MemoryTag) -> TagState:
        return self._states[tag]

    @property
    def all_resident(self) -> bool:
        return all(s is TagState.RESIDENT for s in self._states.values())

    def resident_nbytes(self, tag: MemoryTag) -> int:
        """Bytes the tag holds when resident (its size, whatever its state now)."""
        sizes = self._params.values() if tag is MemoryTag.WEIGHTS else [self._shapes[tag]]
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in sizes)

    def check(self, tags: Iterable[MemoryTag], *, resume: bool) -> None:
        """Raise ``MemoryTagError`` for the first tag not in the state the action needs."""
        needed = TagState.RELEASED if resume else TagState.RESIDENT
        for tag in tags:
            if self._states[tag] is not needed:
                raise MemoryTagError(f"cannot {'resume' if resume else 'release'} memory tag {tag.value!r}: it is "
                                     f"already {self._states[tag].value}")

    def release(self, tags: Iterable[MemoryTag]) -> None:
        """Free the tags' storage and give it back to the device (on the model thread); checks every tag first,
        so a refused call changes nothing."""
        tags = tuple(tags)
        self.check(tags, resume=False)
        if self._device.type == "cuda":
            # No kernel may still read memory we are about to drop (sgl-project/sglang#31073).
            torch.cuda.synchronize(self._device)
        for tag in tags:
            if tag is MemoryTag.WEIGHTS:
                for p in self._model.parameters():
                    # Replacing .data keeps the Parameter objects (and the model's structure) alive while
                    # dropping the last reference to the storage.
                    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
            else:
                self._buffers[tag] = None
            self._states[tag] = TagState.RELEASED
        self.empty_cache()

    def resume(self, tags: Iterable[MemoryTag]) -> None:
        """Reallocate the tags (weights as ``torch.empty``: garbage until weights are pushed again)."""
        tags = tuple(tags)
        self.check(tags, resume=True)
        for tag in tags:
            if tag is MemoryTag.WEIGHTS:
                params = dict(self._model.named_parameters())
                for name, (shape, dtype) in self._params.items():
                    params[name].data = torch.empty(shape, dtype=dtype, device=self._device)
            else:
                self._buffers[tag] = self._allocate(tag)
            self._states[tag] = TagState.RESIDENT
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    def empty_cache(self) -> None:
        if self._device.type == "cuda":
            with torch.cuda.device(self._device):  # the cache of this region's GPU, not the current one
                torch.cuda.empty_cache()
