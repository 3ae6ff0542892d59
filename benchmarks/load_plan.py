"""Copying a ``flattened_bucket`` chunk into named destinations by a plan computed once per chunk shape.

A push sends the same chunks every step: the same names, shapes, dtypes and byte offsets in a fresh buffer.
What depends only on that metadata (every range inside the buffer, every name known, every shape and dtype
its destination's, each source view's strides) is checked and computed on the first chunk of a shape and
kept. A later chunk of that shape costs its key, one typed view of its buffer, and per tensor one
``as_strided`` made as its copy is queued. On an H200, per Qwen3-8B push of 4 chunks: 0.4 ms to find the plans
and about 1.6 ms of views among the copy launches, where slicing, viewing and reshaping every tensor took 5.6 ms
before the first copy (``python3 -m benchmarks.chunk_load``; docs/benchmarks.md).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from colocd.engines.reference.payloads import PayloadError, bucket_entry

__all__ = ["LoadPlan", "LoadPlans", "copy_tensors", "destination"]

_MAX_PLANS = 64  # one per chunk shape of a model, with room for a changed bucket size


def destination(dsts: Mapping[str, torch.Tensor], where: str, name: str, shape: Sequence[int],
                dtype: torch.dtype) -> torch.Tensor:
    """``dsts[name]``, checked to be a tensor of ``shape`` and ``dtype``; ``ValueError`` naming it otherwise."""
    dst = dsts.get(name)
    if dst is None:
        raise ValueError(f"{where}: unknown tensor {name!r}")
    if dst.shape != shape or dst.dtype != dtype:
        raise ValueError(f"{where}: tensor {name!r} is {list(shape)} {dtype}, expected {list(dst.shape)} {dst.dtype}")
    return dst


@dataclass(frozen=True, slots=True)
class _Source:
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements of dtype


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One chunk shape's destinations and source views, checked against a buffer of ``nbytes``."""

    names: list[str]
    nbytes: int
    dsts: list[torch.Tensor]
    sources: list[_Source]

    def apply(self, flat: torch.Tensor) -> list[str]:
        """Queue the copies of ``flat``'s tensors into their destinations; returns the names loaded."""
        if flat.numel() != self.nbytes:
            raise PayloadError(f"flattened_bucket: flattened_tensor has {flat.numel()} bytes, its metadata "
                               f"was checked against {self.nbytes}")
        typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
        srcs = []
        for s in self.sources:
            if s.dtype not in typed:
                try:
                    view = flat[: self.nbytes - self.nbytes % s.dtype.itemsize].view(s.dtype)
                except RuntimeError as exc:  # a buffer not aligned to the dtype
                    raise PayloadError(f"flattened_bucket: flattened_tensor cannot hold {s.dtype}: {exc}") from None
                typed[s.dtype] = (view, int(view.storage_offset()))
            base, origin = typed[s.dtype]
            srcs.append(base.as_strided(s.shape, s.stride, origin + s.offset))
        copy_tensors(self.dsts, srcs)  # after every view is made: a bad chunk copies nothing
        return self.names


class LoadPlans:
    """Plans by chunk metadata for one set of destinations; another set (a resume made new ones) starts over."""

    def __init__(self, where: str) -> None:
        self._where = where  # names the destinations in errors
        self._plans: OrderedDict[tuple[Any, ...], LoadPlan] = OrderedDict()
        self._dsts: Mapping[str, torch.Tensor] | None = None

    def clear(self) -> None:
        """Forget every plan, and with them the destinations they hold (a release must free those)."""
        self._plans.clear()
        self._dsts = None

    def plan(self, flat: torch.Tensor, metadata: Sequence[Any], dsts: Mapping[str, torch.Tensor]) -> LoadPlan:
        """The plan for this chunk; every check runs before it is first returned, so a bad chunk copies nothing."""
        if dsts is not self._dsts:
            self._plans.clear()
            self._dsts = dsts
        try:
            key = (flat.numel(), *((m.name, m.dtype, m.start_idx, m.end_idx, tuple(m.shape)) for m in metadata))
            found = self._plans.get(key)
        except (AttributeError, TypeError):  # a missing field, or an unhashable one
            found, key = None, None
        if found is None:
            found = self._build(flat.numel(), metadata, dsts)
            if key is not None:
                self._plans[key] = found
                while len(self._plans) > _MAX_PLANS:
                    self._plans.popitem(last=False)
        return found

    def _build(self, nbytes: int, metadata: Sequence[Any], dsts: Mapping[str, torch.Tensor]) -> LoadPlan:
        names, targets, sources = [], [], []
        for i, meta in enumerate(metadata):
            name, shape, dtype, start = bucket_entry(i, meta, nbytes)
            names.append(name)
            targets.append(destination(dsts, self._where, name, shape, dtype))
            strides, step = [], 1
            for size in reversed(shape):
                strides.append(step)
                step *= max(size, 1)
            sources.append(_Source(dtype, tuple(shape), tuple(reversed(strides)), start // dtype.itemsize))
        return LoadPlan(names, nbytes, targets, sources)


# At or above this size a tensor is copied by its own copy_ (cudaMemcpyAsync: copy bandwidth); the
# many small ones (norms) share one _foreach_copy_ launch, where per-call dispatch would dominate.
LARGE_COPY_BYTES = 1 << 20


def copy_tensors(dsts: Sequence[torch.Tensor], srcs: Sequence[torch.Tensor]) -> None:
    """``dst.copy_(src)`` for every pair, queued on the current stream, at memcpy bandwidth for large tensors.

    Why not one ``torch._foreach_copy_`` for everything: its multi-tensor-apply kernel moves large
    tensors well below memcpy bandwidth (``benchmarks.weights`` prints both, measured in the same
    process), and large tensors are few, so their launches cost little next to their bytes.
    """
    small_dsts, small_srcs = [], []
    for dst, src in zip(dsts, srcs, strict=True):
        if dst.numel() * dst.element_size() >= LARGE_COPY_BYTES:
            dst.copy_(src)
        else:
            small_dsts.append(dst)
            small_srcs.append(src)
    if small_dsts:
        import torch

        torch._foreach_copy_(small_dsts, small_srcs)
