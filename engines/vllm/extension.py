"""Code colocd ships into vLLM's worker processes: it receives our weight chunks and loads them.

``ColocdWorkerExtension`` is mixed into every worker with
``--worker-extension-cls colocd.engines.vllm.extension.ColocdWorkerExtension`` and is called through
``POST /collective_rpc``, which every vLLM colocd drives has (0.29 and 0.32 alike).

Loading goes through vLLM's layer-wise reload (``initialize_layerwise_reload`` → ``model.load_weights`` per chunk
→ ``finalize_layerwise_reload``): a bare ``load_weights`` on a served model fails on CPU (prepacked linear weights,
model_executor/layers/utils.py:470-600) and skips quantised weights' post-processing on GPU. The reload buffers a
layer's tensors until the layer is complete, so every received tensor is cloned out of the trainer's buffer first.

Imports at module level: stdlib, torch and colocd's torch-level modules only; vLLM and safetensors lazily.
"""

from __future__ import annotations

import base64
import io
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..chunks import ChunkLayout, SharedSegment, unflatten
from ..cuda_handles import device_uuid
from ..digest import DigestCache, tensor_digests

__all__ = ["ChunkReceiver", "ColocdWorkerExtension"]

EXTENSION_VERSION = 1
# Set once per worker process: the engine's incarnation (vLLM's own API has no such marker).
_BOOT_ID = f"{os.getpid()}-{int.from_bytes(os.urandom(8), 'big'):016x}"
_INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # outside a vLLM worker, or TP not initialised: a single rank
        return 0


def _local_gpu_uuid(device: torch.device) -> str:
    return device_uuid(device.index if device.index is not None else torch.cuda.current_device())


class ChunkReceiver:
    """Turns one chunk's payloads (our ChunkPart JSON) into cloned named tensors on ``device``. shm: open the POSIX
    segment read-only by name, unflatten by the JSON layout, clone; never unlink (the trainer owns the segment).
    cuda_ipc: the trainer's CUDA-IPC pickle (SGLang's format, engines/sglang/payload.py), opened on this worker's GPU.
    disk: a safetensors file."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def select(self, payloads: Sequence[dict[str, Any]], tp_rank: int) -> dict[str, Any]:
        """This worker's payload: by GPU UUID for cuda_ipc, else by TP rank, else the only one."""
        if not payloads:
            raise ValueError("weight chunk carries no payloads")
        if any(p.get("transport") == "cuda_ipc" for p in payloads):
            local = _local_gpu_uuid(self.device)
            for p in payloads:
                if p.get("handle", {}).get("device_uuid") == local:
                    return p
            seen = [p.get("handle", {}).get("device_uuid") for p in payloads]
            raise ValueError(
                f"CUDA IPC chunk was exported on GPU(s) {seen}, but this vLLM worker (tp rank {tp_rank}) "
                f"runs on GPU {local}: a CUDA IPC handle only opens on the GPU that exported it, so the "
                "trainer rank feeding this engine rank must share its physical GPU"
            )
        for p in payloads:
            if p.get("rank") == tp_rank:
                return p
        if len(payloads) == 1:
            return payloads[0]
        raise ValueError(f"no payload for tp rank {tp_rank} among ranks {[p.get('rank') for p in payloads]}")

    def tensors(self, payload: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        transport = payload.get("transport")
        handle = payload.get("handle")
        if not isinstance(handle, dict):
            raise ValueError(f"payload handle must be an object, got {type(handle).__name__}")
        if transport == "shm":
            return self._from_shm(handle)
        if transport == "cuda_ipc":
            return self._from_cuda_ipc(handle)
        if transport == "disk":
            return self._from_disk(handle)
        raise ValueError(f"unknown transport {transport!r}; this extension takes shm, cuda_ipc, disk")

    def _from_shm(self, handle: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        name, nbytes = str(handle["shm_name"]), int(handle["nbytes"])
        layout = ChunkLayout.from_json(handle["layout"], nbytes)
        seg = SharedSegment.open(name, nbytes)
        views: list[tuple[str, torch.Tensor]] = []
        try:
            views = unflatten(seg.tensor(), layout)
            return [(n, t.to(self.device, copy=True)) for n, t in views]
        finally:
            del views  # drop the views before unmapping, so close() really unmaps
            seg.close()

    def _from_disk(self, handle: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        from safetensors.torch import load_file

        return list(load_file(str(handle["path"]), device=str(self.device)).items())

    def _from_cuda_ipc(self, handle: dict[str, Any]) -> list[tuple[str, torch.Tensor]]:
        """The trainer's payload: a flattened bucket (``{"flattened_tensor", "metadata"}``, read by the handle's
        layout) or, for ``direct``, a list of ``(name, tensor)``; each CUDA tensor names its GPU by UUID."""
        if os.environ.get(_INSECURE_ENV) != "1":
            # Same gate as vLLM's own ipc backend (ipc_engine.py:84-92): the handles are a pickle
            # made by the trainer; only a server launched to trust its trainer may open them.
            raise ValueError(f"refusing to unpickle CUDA IPC handles without {_INSECURE_ENV}=1")
        raw = base64.b64decode(handle["payload_b64"])
        obj = _CudaIpcUnpickler(io.BytesIO(raw), self.device).load()
        if handle.get("load_format") == "direct":
            views = [(str(n), t) for n, t in obj]
        else:
            buffer = obj["flattened_tensor"]
            views = unflatten(buffer, ChunkLayout.from_json(handle["layout"], buffer.numel()))
        out = [(n, t.clone()) for n, t in views]
        torch.cuda.current_stream().synchronize()  # copies done before the trainer may reuse the buffer
        return out


class _CudaIpcUnpickler(pickle.Unpickler):
    """Rebuilds the trainer's CUDA tensors on this worker's GPU: the pickle names the exporting GPU by UUID
    (engines/sglang/payload.py ``with_device_uuid``), which must be this worker's."""

    def __init__(self, file: io.BytesIO, device: torch.device) -> None:
        super().__init__(file)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._uuid = device_uuid(self._index)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.multiprocessing.reductions", "rebuild_cuda_tensor"):
            return self._rebuild
        return super().find_class(module, name)

    def _rebuild(self, *args: Any) -> torch.Tensor:
        from torch.multiprocessing import reductions

        if args[6] != self._uuid:
            raise ValueError(f"CUDA IPC tensor was exported on GPU {args[6]}, but this worker runs on {self._uuid}")
        rebuild: Any = reductions.rebuild_cuda_tensor
        rebuilt: torch.Tensor = rebuild(*args[:6], self._index, *args[7:])
        return rebuilt


@dataclass
class _UpdateState:
    """One worker's weight-update bookkeeping."""

    active: bool = False
    chunks: int = 0
    # engines/digest.py digests of every tensor this update received, computed as it loads them.
    received: dict[str, str] = field(default_factory=dict)
    digest_cache: DigestCache = field(default_factory=dict)


_STATE = _UpdateState()  # one vLLM worker per process, so one state per process


def begin(model: torch.nn.Module) -> None:
    """Start a layer-wise reload session on ``model``."""
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    if _STATE.active:
        raise RuntimeError("a colocd weight update is already active on this worker; finish it first")
    initialize_layerwise_reload(model)
    _STATE.active, _STATE.chunks = True, 0
    _STATE.received = {}


def load(model: Any, model_config: Any, receiver: ChunkReceiver, payloads: Sequence[dict[str, Any]]) -> int:
    """Load one chunk into ``model`` inside an active session; returns the tensors loaded. On failure the session
    is finalised first, so every layer that received nothing is back on its previous weights, not the meta device
    (layers earlier chunks completed keep theirs: a whole new update must follow)."""
    if not _STATE.active:
        raise RuntimeError("no colocd weight update is active on this worker: begin before loading chunks")
    try:
        named = receiver.tensors(receiver.select(payloads, _tp_rank()))
        _STATE.received.update(tensor_digests(named, _STATE.digest_cache))
        try:
            from vllm.model_executor.model_loader.mtp_validation import (
                disable_mtp_completeness_check,
            )
        except ImportError:  # older vLLM: no MTP completeness check to silence
            from contextlib import nullcontext as disable_mtp_completeness_check
        with disable_mtp_completeness_check():
            # A chunk holds only part of the model; the check would reject it (ipc_engine.py:240-245).
            model.load_weights(iter(named))
    except BaseException:
        try:
            finish(model, model_config)
        except Exception:  # the original error is the one worth reporting
            _STATE.active = False
        raise
    _STATE.chunks += 1
    return len(named)


def finish(model: torch.nn.Module, model_config: Any) -> dict[str, Any]:
    """Finalise the layer-wise reload (restores kernel formats, e.g. CPU prepacking)."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    if not _STATE.active:
        raise RuntimeError("no colocd weight update is active on this worker")
    try:
        finalize_layerwise_reload(model, model_config)
    finally:
        _STATE.active = False
    return {"chunks": _STATE.chunks, "n_tensors": len(_STATE.received)}


class ColocdWorkerExtension:
    """Mixed into vLLM's worker class (``self`` is the worker); every public method is a ``/collective_rpc`` target,
    prefixed ``colocd_`` since vLLM refuses attributes that clash with the worker's (worker_base.py:296-320)."""

    def _colocd_receiver(self) -> ChunkReceiver:
        receiver = getattr(self, "_colocd_receiver_obj", None)
        if receiver is None:
            receiver = ChunkReceiver(torch.device(getattr(self, "device", "cpu")))
            self._colocd_receiver_obj = receiver
        return receiver

    def colocd_info(self) -> dict[str, Any]:
        """What the extension can do here: version, device, an open update, the worker's boot id."""
        device = torch.device(getattr(self, "device", "cpu"))
        return {
            "extension_version": EXTENSION_VERSION,
            "device": str(device),
            "tp_rank": _tp_rank(),
            "update_active": _STATE.active,
            "boot_id": _BOOT_ID,
        }

    def colocd_begin_update(self) -> None:
        """Start a weight update."""
        begin(self.model_runner.get_model())  # type: ignore[attr-defined]

    def colocd_load_chunk(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Load one chunk: ``update_info`` is wire.update_info (``{"seq", "payloads"}``)."""
        n = load(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            self.model_config,  # type: ignore[attr-defined]
            self._colocd_receiver(),
            update_info["payloads"],
        )
        if torch.cuda.is_available() and self._colocd_receiver().device.type == "cuda":
            torch.cuda.synchronize()  # like vLLM's update_weights: a reply means the copy is done
        return {"seq": update_info.get("seq"), "n_tensors": n}

    def colocd_finish_update(self) -> dict[str, Any]:
        """Finish the update; returns the chunks and tensors it received."""
        summary = finish(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            self.model_config,  # type: ignore[attr-defined]
        )
        reset_lora = getattr(self.model_runner, "reset_lora_state", None)  # type: ignore[attr-defined]
        if callable(reset_lora):
            reset_lora()  # vLLM's finish_weight_update does the same (gpu_worker.py:1602-1604)
        return summary

    def colocd_received_digests(self, names: list[str]) -> dict[str, str]:
        """The digest of each named tensor the current (or last) update received; others are left out."""
        return {n: _STATE.received[n] for n in names if n in _STATE.received}
