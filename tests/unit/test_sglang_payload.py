"""Trainer-side SGLang payloads: what an allow-list unpickler rebuilds, per-rank entries, bucket layout."""

from __future__ import annotations

import base64
import io
import pickle
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from colocd.engines.sglang import payload
from colocd.engines.sglang.payload import (
    BufferLease,
    export_flattened_bucket,
    flatten_bucket,
    named_tensors_payload,
    serialize,
    with_device_uuid,
)

# The globals a CPU payload may name: a subset of SGLang's SafeUnpickler.ALLOWED_GLOBALS
# (0.5.23 utils/common.py:3148-3359). Anything else must be refused, as SGLang refuses it.
_ALLOWED = {
    ("builtins", "list"),
    ("builtins", "dict"),
    ("builtins", "tuple"),
    ("types", "SimpleNamespace"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "UntypedStorage"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),
    ("multiprocessing.resource_sharer", "DupFd"),
    ("torch.multiprocessing.reductions", "rebuild_tensor"),
    ("torch.multiprocessing.reductions", "rebuild_storage_fd"),
    ("torch.multiprocessing.reductions", "rebuild_storage_filename"),
    ("torch.multiprocessing.reductions", "rebuild_typed_storage"),
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"),
} | {
    ("torch", name) for name in ("float32", "float16", "bfloat16", "int64", "int32", "int8", "uint8", "bool")
}


class _AllowListUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name})")


def _load(entry: str) -> Any:
    # SGLang decodes with b64decode(validate=True) (msgspec_utils.py:24, common.py:3112).
    return _AllowListUnpickler(io.BytesIO(base64.b64decode(entry, validate=True))).load()


def _named() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("model.embed.weight", torch.randn(5, 3, dtype=torch.bfloat16)),
        ("model.mask", torch.tensor([True, False, True])),  # 3 bytes: the next offset must still align
        ("model.layers.0.w", torch.randn(7, dtype=torch.float32)),
        ("model.count", torch.arange(3, dtype=torch.int64)),
    ]


def test_flattened_bucket_entry_round_trips_through_an_allow_list_unpickler() -> None:
    named = _named()
    entry, lease = export_flattened_bucket(named)
    data = _load(entry)

    assert set(data) == {"flattened_tensor", "metadata"}
    assert data["flattened_tensor"].dtype == torch.uint8
    for meta, (name, tensor) in zip(data["metadata"], named, strict=True):
        assert type(meta) is SimpleNamespace
        assert vars(meta).keys() == {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}
        assert meta.name == name and meta.shape == tensor.shape and meta.dtype == tensor.dtype
        # What SGLang's FlattenedTensorBucket.reconstruct_tensors does (tensor_bucket.py:130-140).
        rebuilt = data["flattened_tensor"][meta.start_idx : meta.end_idx].view(meta.dtype).reshape(meta.shape)
        assert torch.equal(rebuilt, tensor)
    lease.release()


def test_metadata_offsets_are_multiples_of_each_dtype_itemsize() -> None:
    bucket = flatten_bucket(_named())
    for meta in bucket.metadata:
        assert meta.start_idx % meta.dtype.itemsize == 0
        assert meta.numel == meta.end_idx - meta.start_idx == meta.shape.numel() * meta.dtype.itemsize
    ends = [m.end_idx for m in bucket.metadata]
    starts = [m.start_idx for m in bucket.metadata]
    assert all(s >= e for s, e in zip(starts[1:], ends, strict=False)), "tensors must not overlap"
    assert ends[-1] <= bucket.flattened_tensor.numel()


def test_plain_named_tensor_entry_round_trips() -> None:
    named = _named()
    entry = serialize(named_tensors_payload(named))
    loaded = _load(entry)
    assert [n for n, _ in loaded] == [n for n, _ in named]
    for (_, got), (_, want) in zip(loaded, named, strict=True):
        assert torch.equal(got, want)


def test_a_foreign_class_in_the_payload_is_refused_like_sglang_would() -> None:
    entry = serialize({"metadata": [_NotAllowListed()]})
    with pytest.raises(pickle.UnpicklingError, match="Blocked unsafe global"):
        _load(entry)


class _NotAllowListed:
    pass


def test_entries_are_standard_base64_text() -> None:
    entry = serialize([("w", torch.zeros(2))])
    assert isinstance(entry, str)
    base64.b64decode(entry, validate=True)


def test_device_uuid_replaces_argument_six_only() -> None:
    args = tuple(range(15))
    out = with_device_uuid(args, lambda index: f"GPU-uuid-{index}")
    assert out[6] == "GPU-uuid-6"
    assert out[:6] == args[:6] and out[7:] == args[7:]


def test_device_uuid_refuses_an_unexpected_reduction_shape() -> None:
    with pytest.raises(ValueError, match="changed shape"):
        with_device_uuid(tuple(range(14)), str)
    with pytest.raises(ValueError, match="changed shape"):
        with_device_uuid((*range(6), "already-a-uuid", *range(8)), str)


def test_serialize_patches_no_process_wide_reducer() -> None:
    from multiprocessing.reduction import ForkingPickler

    before = dict(ForkingPickler._extra_reducers)  # type: ignore[attr-defined]
    serialize([("w", torch.zeros(2))])
    assert ForkingPickler._extra_reducers == before  # type: ignore[attr-defined]


def test_bucket_lease_keeps_the_buffer_until_released_and_never_hands_it_out_again() -> None:
    bucket = flatten_bucket(_named())
    lease = BufferLease(bucket.flattened_tensor)
    assert lease.tensor is bucket.flattened_tensor
    lease.release()
    lease.release()  # idempotent: safe in finally blocks
    with pytest.raises(RuntimeError, match="must not be reused"):
        _ = lease.tensor


def test_empty_and_mixed_device_buckets_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        flatten_bucket([])
    with pytest.raises(ValueError, match="one device"):
        flatten_bucket([("a", torch.zeros(1)), ("b", torch.zeros(1, device="meta"))])


# SGLang's consumer side, without SGLang: its UUID-aware rebuild (patch_torch.py:76-99) installed
# under torch's name, then the allow-list load and the flattened-bucket slicing
# (tensor_bucket.py:130-140). Runs in a second process, as the scheduler does.
_CONSUMER = """
import base64, io, json, pickle, sys, torch
from torch.multiprocessing import reductions
original = reductions.rebuild_cuda_tensor
def by_uuid(*args):
    device = args[6]
    if isinstance(device, str):
        device = next(i for i in range(torch.cuda.device_count())
                      if str(torch.cuda.get_device_properties(i).uuid) == device)
    return original(*args[:6], device, *args[7:])
reductions.rebuild_cuda_tensor = by_uuid
allowed = {("builtins", "list"), ("builtins", "dict"), ("types", "SimpleNamespace"), ("torch", "Size"),
           ("torch", "Tensor"), ("torch.storage", "TypedStorage"), ("torch.storage", "UntypedStorage"),
           ("torch", "UntypedStorage"), ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")}
allowed |= {("torch", n) for n in ("bfloat16", "float32", "bool", "int64", "uint8")}
class Safe(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"Blocked unsafe global ({module}.{name})")
        return super().find_class(module, name)
data = Safe(io.BytesIO(base64.b64decode(sys.stdin.read(), validate=True))).load()
flat = data["flattened_tensor"]
out = {m.name: flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape).double().sum().item()
       for m in data["metadata"]}
torch.cuda.synchronize()
del data, flat  # the scheduler drops its view after load_weights; that releases the producer's slot
print(json.dumps(out))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_entry_names_the_gpu_by_uuid_and_rebuilds_in_another_process() -> None:
    import json
    import subprocess
    import sys

    named = [(n, t.cuda()) for n, t in _named()]
    entry, lease = export_flattened_bucket(named)
    uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    assert uuid.encode() in base64.b64decode(entry)
    done = subprocess.run(
        [sys.executable, "-c", _CONSUMER], input=entry, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    sums = json.loads(done.stdout)
    for name, tensor in named:
        assert sums[name] == pytest.approx(tensor.double().sum().item())
    lease.release()
    with pytest.raises(RuntimeError, match="must not be reused"):
        _ = lease.tensor


def test_module_exports_are_sorted_and_complete() -> None:
    # ruff RUF022 order: CONSTANTS, then Classes, then functions, each alphabetical.
    assert payload.__all__ == sorted(payload.__all__, key=lambda n: (not n.isupper(), not n[0].isupper(), n))
    assert all(hasattr(payload, name) for name in payload.__all__)
