"""An allow-list unpickler for SGLang's pickled weight payloads, in the manner of SGLang's SafeUnpickler.

A payload may name only data containers, torch dtypes/sizes/devices and torch's own tensor/storage rebuild functions;
any other global is refused with ``UnsafePickleError`` naming it, before it is imported. (torch's ``weights_only``
unpickler refuses the CUDA IPC rebuild SGLang's payloads name.) SGLang's own classes map to local stand-ins, so its
producers' payloads load without SGLang installed.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

__all__ = ["FlattenedTensorBucketData", "FlattenedTensorMetadata", "LocalSerializedTensor", "UnsafePickleError",
           "safe_loads"]


class UnsafePickleError(ValueError):
    """The payload names a global outside the allow-list (or uses a feature we refuse)."""


# Stand-ins for SGLang's classes (attributes only): ``sglang.srt.weight_sync.tensor_bucket``'s
# ``FlattenedTensorMetadata`` (name, shape, dtype, start_idx, end_idx, numel) and ``FlattenedTensorBucket``
# (flattened_tensor, metadata), and ``LocalSerializedTensor`` (``values[r]``: rank r's own serialized tensor).
class FlattenedTensorMetadata:
    pass


class FlattenedTensorBucketData:
    pass


class LocalSerializedTensor:
    pass


def _load_storage_from_bytes(data: bytes) -> Any:
    # torch.storage._load_from_bytes runs an unrestricted torch.load; ours is weights_only.
    storage = torch.load(io.BytesIO(data), weights_only=True)
    if not isinstance(storage, torch.storage.TypedStorage | torch.UntypedStorage):
        raise UnsafePickleError(f"expected a torch storage, got {type(storage).__name__}")
    return storage


def _device_index_from_uuid(device: int | str) -> int:
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device:
            return index
    raise ValueError(f"CUDA IPC payload names GPU {device!r}, which this process cannot see")


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """SGLang's patched rebuild: argument 6 may be a GPU UUID string (utils/patch_torch.py)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    fixed = (*args[:6], _device_index_from_uuid(args[6]), *args[7:])
    tensor: torch.Tensor = rebuild_cuda_tensor(*fixed)  # type: ignore[no-untyped-call]
    return tensor


_TORCH_DTYPES = frozenset(name for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype))

_ALLOWED: frozenset[tuple[str, str]] = frozenset({
    *(("builtins", n) for n in ("bool", "bytearray", "bytes", "complex", "dict", "float", "frozenset", "int", "list",
                                "range", "set", "slice", "str", "tuple")),
    ("collections", "OrderedDict"), ("collections", "defaultdict"), ("collections", "deque"),
    ("copyreg", "__newobj__"), ("copyreg", "__newobj_ex__"),
    ("_codecs", "encode"),  # protocol-2 pickles spell bytes as _codecs.encode(str, "latin1")
    ("types", "SimpleNamespace"),
    *(("torch", n) for n in ("Size", "device", "dtype", "Tensor", "UntypedStorage", *_TORCH_DTYPES)),
    ("torch.nn.parameter", "Parameter"),
    *(("torch._utils", n) for n in ("_rebuild_tensor", "_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_parameter",
                                    "_rebuild_parameter_with_state", "_rebuild_device_tensor_from_cpu_tensor")),
    ("torch._tensor", "_rebuild_from_type_v2"),
    ("torch.storage", "UntypedStorage"), ("torch.storage", "TypedStorage"),
    *(("torch.multiprocessing.reductions", n) for n in ("rebuild_tensor", "rebuild_typed_storage",
                                                        "rebuild_storage_empty")),
})

# Names SGLang producers put in payloads, resolved to local code without importing SGLang.
_REDIRECTS: dict[tuple[str, str], Any] = {
    ("torch.storage", "_load_from_bytes"): _load_storage_from_bytes,
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_modified"): _rebuild_cuda_tensor_by_uuid,
    # SGLang's consumer has patched torch's own name to its UUID-aware rebuild (patch_torch.py:41),
    # and producers that rewrite the device to a UUID (ours, SGLang's) name torch's function.
    ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"): _rebuild_cuda_tensor_by_uuid,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"): FlattenedTensorMetadata,
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorBucket"): FlattenedTensorBucketData,
    ("sglang.srt.model_executor.model_runner", "LocalSerializedTensor"): LocalSerializedTensor,
    ("sglang.srt.model_executor.model_runner_components.weight_updater", "LocalSerializedTensor"):
        LocalSerializedTensor,
}

# ForkingPickler's CPU storage is shared through the producer's authkey-protected resource sharer, which always
# refuses an unrelated process (this server): explain instead of attempting the connection.
_FD_SHARING = frozenset({
    *(("torch.multiprocessing.reductions", n) for n in ("rebuild_storage_fd", "rebuild_storage_filename")),
    ("multiprocessing.resource_sharer", "DupFd"), ("multiprocessing.reduction", "_rebuild_socket"),
})


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in _REDIRECTS:
            return _REDIRECTS[key]
        if key in _ALLOWED:
            return super().find_class(module, name)
        if key in _FD_SHARING:
            raise UnsafePickleError(f"refused global {module}.{name}: CPU tensors pickled with ForkingPickler share "
                                    "memory with the producer only; pickle them with pickle.dumps (data inline)")
        raise UnsafePickleError(f"Blocked unsafe global ({module}.{name}) during pickle deserialization")

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError("pickle persistent ids are not accepted in weight payloads")


def safe_loads(data: bytes) -> Any:
    """Unpickle ``data`` through the allow-list; raises ``UnsafePickleError`` or ``ValueError``."""
    try:
        return _RestrictedUnpickler(io.BytesIO(data)).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, IndexError, TypeError) as exc:
        raise ValueError(f"payload is not a valid pickle: {type(exc).__name__}: {exc}") from exc
