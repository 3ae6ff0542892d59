"""Flattened weight chunks: the byte layout shared by trainer, daemon and engines.

A chunk is one contiguous byte buffer holding several tensors back to back, plus a layout
saying where each tensor lives. The layout is plain JSON (never a pickle), so any process can
describe a chunk to any other without trusting it with code.
"""

from __future__ import annotations

import fcntl
import math
import mmap
import os
import re
import secrets
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from typing_extensions import TypedDict  # pydantic takes typing's TypedDict only from Python 3.12

if TYPE_CHECKING:  # torch is imported where tensors are touched: a layout is checked without it (the daemon)
    import torch

from ..errors import RequestInvalid

__all__ = ["DTYPES", "MAX_LAYOUT_ENTRIES", "SEGMENT_PREFIX", "SHM_DIR", "SHM_NAME_PATTERN", "ChunkLayout",
           "LayoutEntry", "SharedSegment", "TensorSpec", "dtype_from_name", "dtype_itemsize", "dtype_name",
           "flatten_into", "layout_of", "plan_chunks", "unflatten"]

# The dtypes a chunk may carry and their itemsizes, by torch's short names (``getattr(torch, name)``); sizes, not
# torch dtypes, so that validating a layout (all the daemon does with one) never imports torch.
DTYPES: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}

_ALIGN = 256  # byte alignment of each tensor: keeps every offset a multiple of any itemsize


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the dtype called ``name``; ``ValueError`` names an unknown one."""
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(DTYPES)}") from None


def dtype_from_name(name: str) -> torch.dtype:
    dtype_itemsize(name)  # unknown names fail with the same message as a layout's check
    import torch

    dtype: torch.dtype = getattr(torch, name)
    return dtype


class LayoutEntry(TypedDict):
    """One tensor of a chunk's layout on the wire (``ChunkLayout.to_json``; ``TensorSpec.from_json`` checks one)."""

    name: str
    dtype: str  # torch's name without the prefix: float32, bfloat16, ...
    shape: list[int]
    offset: int  # bytes from the start of the chunk


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """Where one tensor lives inside a chunk: name, dtype, shape and byte offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_itemsize(self.dtype)

    def to_json(self) -> LayoutEntry:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "offset": self.offset}

    @classmethod
    def from_json(cls, data: LayoutEntry) -> TensorSpec:
        spec = cls(
            name=str(data["name"]),
            dtype=str(data["dtype"]),
            shape=tuple(int(d) for d in data["shape"]),
            offset=int(data["offset"]),
        )
        itemsize = dtype_itemsize(spec.dtype)  # validate early, with a message naming the dtype
        if spec.offset < 0 or any(d < 0 for d in spec.shape):
            raise ValueError(f"tensor {spec.name!r}: negative offset or dimension")
        if spec.offset % itemsize:
            raise ValueError(f"tensor {spec.name!r}: offset {spec.offset} not aligned to its dtype")
        return spec


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """The tensors of one chunk and the chunk's total size in bytes."""

    tensors: tuple[TensorSpec, ...]
    nbytes: int

    @classmethod
    def for_tensors(cls, named: Sequence[tuple[str, torch.Tensor]]) -> ChunkLayout:
        specs: list[TensorSpec] = []
        offset = 0
        for name, t in named:
            specs.append(TensorSpec(name, dtype_name(t.dtype), tuple(t.shape), offset))
            offset += _aligned(t.numel() * t.element_size())
        return cls(tuple(specs), offset)

    def to_json(self) -> list[LayoutEntry]:
        return [s.to_json() for s in self.tensors]

    @classmethod
    def from_json(cls, items: Iterable[LayoutEntry], nbytes: int) -> ChunkLayout:
        specs = tuple(TensorSpec.from_json(i) for i in items)
        for s in specs:
            if s.offset + s.nbytes > nbytes:
                raise ValueError(f"tensor {s.name!r} ends at {s.offset + s.nbytes}, past the chunk's {nbytes} bytes")
        return cls(specs, nbytes)


def _aligned(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


def plan_chunks(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors in order into buckets of at most ``bucket_bytes``; a larger tensor travels alone."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in named:
        n = _aligned(t.numel() * t.element_size())
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, t))
        size += n
    if bucket:
        yield bucket


def flatten_into(buffer: torch.Tensor, layout: ChunkLayout, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    """Copy tensors into a uint8 buffer at the layout's offsets (one copy per tensor)."""
    import torch

    for spec, (_, t) in zip(layout.tensors, named, strict=True):
        dst = buffer[spec.offset : spec.offset + spec.nbytes]
        dst.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8), non_blocking=True)


def unflatten(buffer: torch.Tensor, layout: ChunkLayout) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor inside a uint8 buffer; no copy."""
    out = []
    for spec in layout.tensors:
        raw = buffer[spec.offset : spec.offset + spec.nbytes]
        out.append((spec.name, raw.view(dtype_from_name(spec.dtype)).reshape(spec.shape)))
    return out


SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "colocd"  # a segment is named <prefix>-<creator pid>-<12 hex>; engines/segments.py reads it


@dataclass
class SharedSegment:
    """A POSIX shared-memory segment (a file under /dev/shm) mapped into this process; not
    ``multiprocessing.shared_memory``, whose resource tracker unlinks segments it merely opened (Python < 3.13). The
    creator's pid is in the name and it holds a shared ``flock`` for as long as its mapping lives (the kernel
    drops it when the process dies), so ``engines/segments.py`` can tell a dead creator's segment from a live one.
    """

    name: str
    nbytes: int
    owner: bool
    _mmap: mmap.mmap | None = field(default=None, repr=False)

    @classmethod
    def create(cls, nbytes: int) -> SharedSegment:
        name = f"{SEGMENT_PREFIX}-{os.getpid()}-{secrets.token_hex(6)}"
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)  # held by the mapping's duplicate descriptor until it closes
            os.ftruncate(fd, max(nbytes, 1))
            mm = mmap.mmap(fd, max(nbytes, 1))
        finally:
            os.close(fd)
        return cls(name, nbytes, True, mm)

    @classmethod
    def open(cls, name: str, nbytes: int) -> SharedSegment:
        if "/" in name or name.startswith("."):
            raise ValueError(f"shared-memory name {name!r} must be a plain name")
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise ValueError(f"shared-memory segment {name!r} holds {size} bytes, descriptor says {nbytes}")
            mm = mmap.mmap(fd, max(nbytes, 1), prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(name, nbytes, False, mm)

    def tensor(self) -> torch.Tensor:
        """A uint8 tensor over the mapping (no copy)."""
        assert self._mmap is not None, "segment closed"
        import torch

        if self.nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        import warnings

        with warnings.catch_warnings():
            # torch warns that read-only buffers give non-writable tensors; we only read them.
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(self._mmap, dtype=torch.uint8, count=self.nbytes)

    def close(self) -> None:
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                # A tensor view still exports the buffer; the mapping goes when that view dies.
                pass
            self._mmap = None

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


# What a trainer-supplied handle may name: a colocd trainer's segment (SharedSegment.create's naming; the group is
# the creator's pid), never another program's /dev/shm file (the daemon may unlink what a chunk names: segments.py).
SHM_NAME_PATTERN = re.compile(rf"^{SEGMENT_PREFIX}-([1-9][0-9]{{0,9}})-[0-9a-f]{{1,64}}$")
MAX_LAYOUT_ENTRIES = 65536  # more tensors than any model has in one chunk; bounds the daemon's parsing


def layout_of(transport: str, items: object, nbytes: int | None) -> ChunkLayout:
    """A handle's ``layout`` (``[{name, dtype, shape, offset}]``) checked and read; with ``nbytes``, the tensors must
    fit the buffer. 422 naming ``handle.layout`` otherwise."""
    if items is None:
        raise RequestInvalid(f"a {transport} chunk carries its layout (handle.layout: [{{name, dtype, shape, "
                             "offset}], as colocd's producers export it): the daemon checks every chunk's tensors "
                             "against the manifest and the other ranks' chunk, and a complete update against what "
                             "reached each engine", field="handle.layout")
    if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
        raise RequestInvalid("layout must be a list of {name, dtype, shape, offset} objects", field="handle.layout")
    if len(items) > MAX_LAYOUT_ENTRIES:
        raise RequestInvalid(f"layout has {len(items)} entries; at most {MAX_LAYOUT_ENTRIES} per chunk",
                             field="handle.layout")
    try:
        if nbytes is None:
            layout = ChunkLayout(tuple(TensorSpec.from_json(i) for i in items), 0)
        else:
            layout = ChunkLayout.from_json(items, nbytes)
    except (KeyError, TypeError, ValueError) as exc:
        raise RequestInvalid(f"layout: {type(exc).__name__}: {exc}", field="handle.layout") from None
    names = [t.name for t in layout.tensors]
    if len(set(names)) != len(names):
        dup = sorted(n for n, k in Counter(names).items() if k > 1)[:3]
        raise RequestInvalid(f"layout names tensors more than once: {dup}", field="handle.layout")
    return layout
