"""Trainer-side ``update_weights_from_tensor`` payloads in SGLang's pickle format; no HTTP, no sglang import.

Runs in the trainer. A payload is one base64 ``ForkingPickler`` serialisation per engine TP rank (SGLang
``utils/common.py:3060-3082``), so every rank's CUDA-IPC refcount slot is opened once (sgl-project/sglang#4446).
CUDA tensors carry the GPU UUID instead of the device index (``utils/patch_torch.py:64-99``), and everything a
payload pickles is on SGLang's ``SafeUnpickler`` allow-list (metadata as ``types.SimpleNamespace``).
vLLM's worker extension reads the same payload (``engines/vllm/extension.py``).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing
from torch.multiprocessing import reductions

from ..chunks import ChunkLayout, dtype_from_name, flatten_into
from ..cuda_handles import device_uuid

__all__ = ["FLATTENED_BUCKET", "BufferLease", "FlattenedBucket", "export_flattened_bucket", "flatten_bucket",
           "metadata_for_layout", "named_tensors_payload", "serialize", "with_device_uuid"]

# The load_format SGLang dispatches on (model_runner_components/weight_updater.py:354).
FLATTENED_BUCKET = "flattened_bucket"

# reduce_tensor's CUDA tuple: index 6 is storage_device (torch/multiprocessing/reductions.py;
# SGLang's _REDUCE_TENSOR_ARG_DEVICE_INDEX, patch_torch.py:66). 15 positional arguments in all.
_DEVICE_ARG = 6
_CUDA_ARGS = 15
_REF_HANDLE, _REF_OFFSET = 11, 12  # the consumer's reference count: torch's ref-counter file and slot


def with_device_uuid(args: tuple[Any, ...], uuid_of: Callable[[int], str]) -> tuple[Any, ...]:
    """``rebuild_cuda_tensor`` arguments with the device index replaced by that GPU's UUID, which the consumer maps
    back to its own index (patch_torch.py:89-99): the two processes may see different ``CUDA_VISIBLE_DEVICES``."""
    if len(args) != _CUDA_ARGS or not isinstance(args[_DEVICE_ARG], int):
        raise ValueError(
            f"unexpected rebuild_cuda_tensor arguments ({len(args)} items, "
            f"device {args[_DEVICE_ARG : _DEVICE_ARG + 1]!r}); "
            "torch's CUDA IPC reduction changed shape"
        )
    return (*args[:_DEVICE_ARG], uuid_of(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])


def _reduce_tensor(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
    rebuild, args = reductions.reduce_tensor(tensor)  # type: ignore[no-untyped-call]
    if rebuild is reductions.rebuild_cuda_tensor:
        args = with_device_uuid(args, device_uuid)
    return rebuild, args


def serialize(obj: Any, shares: list[tuple[bytes, int]] | None = None) -> str:
    """One SGLang ``serialized_named_tensors`` entry: ``obj`` of CUDA tensors pickled by ForkingPickler, base64.
    ``shares`` collects each CUDA share's ``(ref_counter_handle, ref_counter_offset)`` (``colocd.trainer.leases``).
    The UUID reducer is this pickler's own (``dispatch_table``): nothing process-wide is patched. The pickle names
    ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which SGLang resolves to its UUID-aware rebuild."""
    buf = io.BytesIO()
    pickler = ForkingPickler(buf)
    reduce = _reduce_tensor
    if shares is not None:
        def reduce(tensor: torch.Tensor) -> tuple[Any, tuple[Any, ...]]:
            rebuild, args = _reduce_tensor(tensor)
            if rebuild is reductions.rebuild_cuda_tensor and args[_REF_HANDLE] is not None:
                shares.append((args[_REF_HANDLE], int(args[_REF_OFFSET])))
            return rebuild, args
    pickler.dispatch_table[torch.Tensor] = reduce
    pickler.dispatch_table[torch.nn.Parameter] = reduce
    pickler.dump(obj)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def named_tensors_payload(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The plain format (``load_format=None``): a list of ``(name, tensor)`` for ``model.load_weights``."""
    return [(name, tensor.detach()) for name, tensor in named]


def metadata_for_layout(layout: ChunkLayout) -> tuple[SimpleNamespace, ...]:
    """SGLang's per-tensor metadata (FlattenedTensorMetadata, tensor_bucket.py:8-16) for a colocd chunk layout:
    byte offsets ``start_idx``/``end_idx`` and the byte count ``numel``, aligned as ``.view(dtype)`` needs."""
    out = []
    for spec in layout.tensors:
        start = spec.offset
        out.append(
            SimpleNamespace(
                name=spec.name,
                shape=torch.Size(spec.shape),
                dtype=dtype_from_name(spec.dtype),
                start_idx=start,
                end_idx=start + spec.nbytes,
                numel=spec.nbytes,
            )
        )
    return tuple(out)


@dataclass(frozen=True, slots=True)
class FlattenedBucket:
    """One uint8 buffer holding a bucket's tensors back to back, and SGLang's metadata for it."""

    flattened_tensor: torch.Tensor
    metadata: tuple[SimpleNamespace, ...]

    def payload(self) -> dict[str, Any]:
        """What one rank's entry deserialises to under ``load_format="flattened_bucket"``
        (model_runner_components/weight_updater.py:383-411 reads exactly these two keys)."""
        return {"flattened_tensor": self.flattened_tensor, "metadata": list(self.metadata)}


def flatten_bucket(named: Sequence[tuple[str, torch.Tensor]]) -> FlattenedBucket:
    """Copy tensors into a freshly allocated uint8 buffer on their device (one bucket, never reused)."""
    if not named:
        raise ValueError("cannot build an empty bucket")
    devices = {t.device for _, t in named}
    if len(devices) != 1:
        raise ValueError(f"a bucket's tensors must share one device; got {sorted(map(str, devices))}")
    layout = ChunkLayout.for_tensors(named)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=devices.pop())
    # Copies are enqueued on the current stream; torch's CUDA IPC export records an event on it
    # that the consumer waits for, so the engine never reads a half-written buffer.
    flatten_into(buffer, layout, named)
    return FlattenedBucket(buffer, metadata_for_layout(layout))


def export_flattened_bucket(named: Sequence[tuple[str, torch.Tensor]],
                            shares: list[tuple[bytes, int]] | None = None) -> tuple[str, BufferLease]:
    """This rank's ``serialized_named_tensors`` entry for one bucket, and the lease on its buffer (released once
    the daemon acked the chunk)."""
    bucket = flatten_bucket(named)
    return serialize(bucket.payload(), shares), BufferLease(bucket.flattened_tensor)


class BufferLease:
    """Keeps one exported bucket alive until the engine has confirmed it, then lets it go for good. SGLang answers once
    the copy is *enqueued* (THUDM/slime#929), so a buffer is never refilled after a reply: ``release()`` drops the only
    reference and PyTorch frees the memory once the engine has dropped its IPC mapping, which
    ``torch.cuda.ipc_collect()`` notices (THUDM/slime#1731)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor: torch.Tensor | None = tensor
        self._cuda = tensor.is_cuda

    @property
    def tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise RuntimeError("bucket lease already released; its buffer must not be reused")
        return self._tensor

    def release(self) -> None:
        """Call after the engine confirmed this bucket; repeated calls do nothing."""
        if self._tensor is None:
            return
        self._tensor = None
        if self._cuda and torch.cuda.is_available():
            torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]
