"""The weight-update group protocol between the daemon and an engine (separated GPUs, research/engine-apis.md §1.6).

What a broadcast is (``BroadcastDescriptor``) and the adapter verbs for it (``SupportsWeightGroups``: SGLang's
routes); torch-free. The collective is ``weight_group.py``, the daemon's side ``daemon/distributed.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from .chunks import dtype_itemsize

__all__ = ["BACKEND_DEVICES", "FLATTENED", "BroadcastDescriptor", "SupportsWeightGroups", "flat_offsets", "itemsize"]

# The device key torch's helper files each backend under (BackendConfig: gloo registers "cpu"
# first, nccl "cuda"); it is part of the store prefix, so it must match the engine's.
BACKEND_DEVICES: dict[str, str] = {"gloo": "cpu", "nccl": "cuda"}

FLATTENED = "flattened_bucket"


@runtime_checkable
class SupportsWeightGroups(Protocol):
    """The adapter verbs of the distributed path (SGLang's; ``engines/sglang/adapter.py``)."""

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None: ...

    async def update_weights_from_distributed(self, *, seq: int, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str, load_format: str | None,
                                              flush_cache: bool = False, weight_version: str | None = None,
                                              ) -> None: ...

    async def destroy_weights_update_group(self, group_name: str) -> None: ...


@dataclass(frozen=True, slots=True)
class BroadcastDescriptor:
    """One broadcast as the trainer runs it: tensors in broadcast order, one broadcast each or one flattened bucket;
    validated at construction (``ValueError`` naming the field)."""

    seq: int
    group_name: str
    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    load_format: str | None = None  # None: one broadcast per tensor; "flattened_bucket": one uint8 broadcast

    def __post_init__(self) -> None:
        if not self.names:
            raise ValueError("names: a broadcast carries at least one tensor")
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes need one entry per tensor; got "
                             f"{len(self.names)}, {len(self.dtypes)}, {len(self.shapes)}")
        if self.load_format not in (None, FLATTENED):
            raise ValueError(f"load_format: {self.load_format!r} is not null or {FLATTENED!r}")
        for i, dtype in enumerate(self.dtypes):
            itemsize(dtype)  # ValueError names the dtype
            if any(d < 0 for d in self.shapes[i]):
                raise ValueError(f"shapes.{i}: negative dimension in {list(self.shapes[i])}")
        if self.load_format == FLATTENED:
            flat_offsets(self.names, self.dtypes, self.shapes)  # offsets aligned to each itemsize

    @property
    def nbytes(self) -> int:
        return sum(itemsize(d) * math.prod(s) for d, s in zip(self.dtypes, self.shapes, strict=True))


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` as SGLang spells it (``bfloat16`` or ``torch.bfloat16``); torch-free."""
    return dtype_itemsize(dtype.removeprefix("torch."))


def flat_offsets(names: Sequence[str], dtypes: Sequence[str],
                 shapes: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """Each tensor's byte range ``[start, end)`` in one flattened bucket (lists of one entry per tensor, as the
    callers check), back to back with no padding; a ``ValueError`` names a misaligned tensor (SGLang refuses it)."""
    ranges: list[tuple[int, int]] = []
    offset = 0
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        size = itemsize(dtype)
        if offset % size:
            raise ValueError(
                f"tensor {name!r} ({dtype.removeprefix('torch.')}) would start at byte {offset}, not a multiple of "
                f"its itemsize {size}; order a bucket's tensors by decreasing itemsize"
            )
        if any(d < 0 for d in shape):
            raise ValueError(f"tensor {name!r} has a negative dimension in shape {list(shape)}")
        ranges.append((offset, offset + size * math.prod(shape)))
        offset = ranges[-1][1]
    return ranges
