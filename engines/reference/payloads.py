"""Turning one ``serialized_named_tensors`` entry into (name, tensor) pairs, per ``load_format``.

SGLang's formats (research/engine-apis.md §1.7): ``null``/``"direct"``, a pickled ``list[(name, tensor)]`` (tensors
may be ``LocalSerializedTensor`` wrappers); ``"flattened_bucket"``, a pickled ``{"flattened_tensor", "metadata"}``.
Pickles go through the allow-list unpickler only; every problem raises ``PayloadError`` naming what is at fault.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from .safe_unpickle import FlattenedTensorBucketData, LocalSerializedTensor, safe_loads

__all__ = ["LOAD_FORMATS", "PayloadError", "bucket_entry", "disagreement", "open_payload"]

LOAD_FORMATS = ("flattened_bucket", "direct", None)

NamedTensors = list[tuple[str, torch.Tensor]]


class PayloadError(ValueError):
    """An entry that cannot be turned into tensors; the message says which part is wrong."""


@contextlib.contextmanager
def open_payload(entry: str, load_format: str | None, *, tp_rank: int = 0,
                 device: torch.device | None = None) -> Iterator[NamedTensors]:
    """Yield the entry's tensors (CUDA-IPC mappings close when the ``with`` ends); with ``device`` given, CUDA
    tensors must already be on it (a handle from another GPU is an error, not a silent P2P copy)."""
    raw = _b64decode(entry)
    if device is not None and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # so that tensors' devices compare equal to it
    if load_format in (None, "direct"):
        yield _on_device(_named_list(safe_loads(raw), tp_rank), device)
    elif load_format == "flattened_bucket":
        yield _on_device(_flattened_bucket(safe_loads(raw)), device)
    else:
        raise PayloadError(f"unknown load_format {load_format!r}; supported: {list(LOAD_FORMATS)}")


def _on_device(named: NamedTensors, device: torch.device | None) -> NamedTensors:
    for name, tensor in named if device is not None and device.type == "cuda" else ():
        if tensor.is_cuda and tensor.device != device:
            raise PayloadError(f"tensor {name!r} arrived on {tensor.device} but this engine runs on {device}: "
                               "trainer rank and engine TP rank must share a GPU")
    return named


def _b64decode(entry: str) -> bytes:
    try:
        return base64.b64decode(entry, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise PayloadError(f"serialized_named_tensors entry is not valid base64: {exc}") from None


def _named_list(obj: Any, tp_rank: int) -> NamedTensors:
    if not isinstance(obj, list | tuple):
        raise PayloadError(f"load_format null expects a list of (name, tensor), got {type(obj).__name__}")
    out: NamedTensors = []
    for i, item in enumerate(obj):
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise PayloadError(f"item {i} is not a (name, tensor) pair")
        name, value = item
        if isinstance(value, LocalSerializedTensor):
            values = getattr(value, "values", None)
            if not isinstance(values, list) or not 0 <= tp_rank < len(values):
                raise PayloadError(f"tensor {name!r}: LocalSerializedTensor has no entry for TP rank {tp_rank}")
            value = safe_loads(values[tp_rank])
        if not isinstance(value, torch.Tensor):
            raise PayloadError(f"tensor {name!r}: expected a tensor, got {type(value).__name__}")
        out.append((name, value))
    return out


def _bucket_parts(obj: Any) -> tuple[torch.Tensor, list[Any]]:
    if isinstance(obj, FlattenedTensorBucketData):
        flat, metadata = getattr(obj, "flattened_tensor", None), getattr(obj, "metadata", None)
    elif isinstance(obj, dict):
        flat, metadata = obj.get("flattened_tensor"), obj.get("metadata")
    else:
        raise PayloadError(f"flattened_bucket wants a dict of flattened_tensor and metadata, not {type(obj).__name__}")
    if not isinstance(flat, torch.Tensor) or flat.dtype != torch.uint8 or flat.dim() != 1 or not flat.is_contiguous():
        raise PayloadError("flattened_bucket: flattened_tensor must be a contiguous 1-D uint8 tensor")
    if not isinstance(metadata, list | tuple):
        raise PayloadError("flattened_bucket: metadata must be a list")
    return flat, list(metadata)


def bucket_entry(i: int, meta: Any, nbytes: int) -> tuple[str, torch.Size, torch.dtype, int]:
    """Metadata item ``i`` of a bucket of ``nbytes``: (name, shape, dtype, start byte), checked to fit."""
    try:
        name, shape, dtype = str(meta.name), torch.Size(meta.shape), meta.dtype
        start, end = int(meta.start_idx), int(meta.end_idx)
    except (AttributeError, TypeError, ValueError):
        raise PayloadError(f"flattened_bucket: metadata item {i} lacks name/shape/dtype/start_idx/end_idx") from None
    if not isinstance(dtype, torch.dtype):
        raise PayloadError(f"flattened_bucket: tensor {name!r} has dtype {dtype!r}, not a torch.dtype")
    if start < 0 or end != start + shape.numel() * dtype.itemsize or end > nbytes:
        raise PayloadError(f"flattened_bucket: tensor {name!r} spans bytes [{start}, {end}) which does not fit its "
                           f"shape {list(shape)} x {dtype} or the bucket's {nbytes} bytes")
    if start % dtype.itemsize:
        raise PayloadError(f"flattened_bucket: tensor {name!r} starts at byte {start}, not aligned to {dtype}")
    return name, shape, dtype, start


def _flattened_bucket(obj: Any) -> NamedTensors:
    flat, metadata = _bucket_parts(obj)
    out: NamedTensors = []
    for i, meta in enumerate(metadata):
        name, shape, dtype, start = bucket_entry(i, meta, flat.numel())
        out.append((name, flat[start : start + shape.numel() * dtype.itemsize].view(dtype).reshape(shape)))
    return out


def disagreement(entries: Sequence[NamedTensors]) -> str | None:
    """Why the TP ranks' entries of one chunk do not carry the same full tensors; None when they do."""
    first, same = dict(entries[0]), "every TP rank's entry must carry the same full tensors"
    for r, named in enumerate(entries[1:], start=1):
        other = dict(named)
        if other.keys() != first.keys():
            missing, extra = sorted(first.keys() - other.keys()), sorted(other.keys() - first.keys())
            return f"TP rank {r}'s entry carries other tensors than rank 0's (missing {_some(missing)}, extra " \
                   f"{_some(extra)}); {same}"
        if differing := [n for n in sorted(first) if not _equal(first[n], other[n])]:
            return f"tensors {_some(differing)} differ between TP rank {r}'s entry and rank 0's; {same}"
    return None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b.to(a.device))


def _some(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    more = f" and {len(names) - n} more" if len(names) > n else ""
    return f"[{shown}{more}]" if names else "none"
