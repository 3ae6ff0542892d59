"""Code colocd ships into vLLM's worker processes: it receives our weight chunks and loads them.

Two entry points share one receiver. ``ColocdWorkerExtension`` is mixed into every worker with
``--worker-extension-cls colocd.engines.vllm.extension.ColocdWorkerExtension`` and is called through
``POST /collective_rpc``. Importing this module inside the server also registers the ``colocd``
weight-transfer backend (transfer.py), so ``--weight-transfer-config '{"backend":"colocd"}'`` drives
the same receiver through vLLM's native /start_weight_update → /update_weights → /finish_weight_update.

Loading goes through vLLM's layer-wise reload: ``initialize_layerwise_reload`` → ``model.load_weights``
(per chunk) → ``finalize_layerwise_reload``. A bare ``model.load_weights`` on a served model fails on
CPU, because the CPU linear kernels prepack weights and leave ``layer.weight`` empty
(model_executor/layers/utils.py:470-600), and on GPU it skips the post-load processing of quantised
weights; the layer-wise reload restores checkpoint shapes first and re-runs that processing
(model_loader/reload/inplace.py:32-96, layerwise.py). Because it buffers a layer's tensors until the
layer is complete, every received tensor is cloned out of the trainer's buffer before loading: the
trainer reuses that buffer once we reply.

Imports at module level: stdlib, torch and colocd.engines.chunks only (no fastapi, httpx, pydantic),
so it is cheap inside a vLLM worker. vLLM and safetensors are imported lazily where needed.
"""

from __future__ import annotations

import base64
import hashlib
import os
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..chunks import ChunkLayout, SharedSegment, dtype_from_name, unflatten
from ..digest import DigestCache, tensor_digests
from . import BACKEND_NAME

__all__ = [
    "BACKEND_NAME",
    "ChunkReceiver",
    "ColocdWorkerExtension",
    "register_backend",
]

EXTENSION_VERSION = 1
# Set once per worker process: a restarted vLLM server has new workers, so a new boot id. The daemon
# compares it across observations to prove (or rule out) a restart; vLLM's own API has no such marker.
_BOOT_ID = f"{os.getpid()}-{int.from_bytes(os.urandom(8), 'big'):016x}"
_INSECURE_ENV = "VLLM_ALLOW_INSECURE_SERIALIZATION"


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tp_group

        return int(get_tp_group().rank_in_group)
    except Exception:  # outside a vLLM worker, or TP not initialised: a single rank
        return 0


def _local_gpu_uuid(device: torch.device) -> str:
    index = device.index if device.index is not None else torch.cuda.current_device()
    return str(torch.cuda.get_device_properties(index).uuid)


class ChunkReceiver:
    """Turns one chunk's payloads (our ChunkPart JSON) into cloned named tensors on ``device``.

    shm: open the POSIX segment read-only by name, unflatten by the JSON layout, clone; never unlink
    (the trainer owns the segment). cuda_ipc: vLLM's packed IPC fields, picked by this worker's GPU
    UUID. disk: a safetensors file.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def select(self, payloads: Sequence[dict[str, Any]], tp_rank: int) -> dict[str, Any]:
        """This worker's payload: by GPU UUID for cuda_ipc, else by TP rank, else the only one."""
        if not payloads:
            raise ValueError("weight chunk carries no payloads")
        if any(p.get("transport") == "cuda_ipc" for p in payloads):
            local = _local_gpu_uuid(self.device)
            for p in payloads:
                if p.get("handle", {}).get("gpu_uuid") == local:
                    return p
            seen = [p.get("handle", {}).get("gpu_uuid") for p in payloads]
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
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        if os.environ.get(_INSECURE_ENV) != "1":
            # Same gate as vLLM's own ipc backend (ipc_engine.py:84-92): the handles are a pickle
            # made by the trainer; only a server launched to trust its trainer may open them.
            raise ValueError(f"refusing to unpickle CUDA IPC handles without {_INSECURE_ENV}=1")
        local = _local_gpu_uuid(self.device)
        handles = pickle.loads(base64.b64decode(handle["ipc_handles_pickled"]))
        if local not in handles:
            raise ValueError(
                f"IPC handle not found for this worker's GPU {local}; handles cover {list(handles)}"
            )
        args = list(handles[local])
        args[6] = self.device.index if self.device.index is not None else torch.cuda.current_device()
        buffer = rebuild_cuda_tensor(*args)  # type: ignore[no-untyped-call]
        names, shapes, dtypes = handle["names"], handle["shapes"], handle["dtype_names"]
        if "layout" in handle:
            layout = ChunkLayout.from_json(handle["layout"], int(handle.get("nbytes", buffer.numel())))
            views = unflatten(buffer, layout)
        else:
            sizes = [int(s) for s in handle["tensor_sizes"]]
            parts = buffer[: sum(sizes)].split(sizes)
            views = [
                (n, part.view(dtype_from_name(d)).reshape(s))
                for n, part, d, s in zip(names, parts, dtypes, shapes, strict=True)
            ]
        out = [(n, t.clone()) for n, t in views]
        torch.cuda.current_stream().synchronize()  # copies done before the trainer may reuse the buffer
        return out


@dataclass
class _UpdateState:
    """One worker's weight-update bookkeeping, shared by the RPC extension and the backend."""

    active: bool = False
    chunks: int = 0
    # engines/digest.py digests of every tensor this update received, computed on the worker's device as it
    # loads them (cheap there, so always on): what a verified commit compares with the trainer's.
    received: dict[str, str] = field(default_factory=dict)
    digest_cache: DigestCache = field(default_factory=dict)


_STATE = _UpdateState()  # one vLLM worker per process, so one state per process


def begin(model: torch.nn.Module, *, strict: bool = True) -> None:
    """Start a layer-wise reload session on ``model``.

    ``strict=False`` is for the native backend: there vLLM's worker guards sessions itself and drops
    a session whose update failed (gpu_worker.py:1579-1585), so a new start must be allowed.
    ``initialize_layerwise_reload`` skips layers already set up (layerwise.py:105-107).
    """
    from vllm.model_executor.model_loader.reload import (
        initialize_layerwise_reload,
    )

    if _STATE.active and strict:
        raise RuntimeError("a colocd weight update is already active on this worker; finish it first")
    initialize_layerwise_reload(model)
    _STATE.active, _STATE.chunks = True, 0
    _STATE.received = {}


def load(model: Any, model_config: Any, receiver: ChunkReceiver, payloads: Sequence[dict[str, Any]]) -> int:
    """Load one chunk into ``model`` inside an active session; returns the tensors loaded.

    On failure the session is finalised and closed before the error propagates. vLLM's worker drops
    a session whose update raised (gpu_worker.py:1581-1585) but leaves the layer-wise reload open,
    with the model's layers on the meta device; finalising puts every layer that received nothing
    back to its previous weights, so a chunk that could not even be read (the usual failure: a
    missing shm segment) changes nothing. Layers that earlier chunks completed keep their new
    weights: the caller must run a whole new update before serving.
    """
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
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
    )

    if not _STATE.active:
        raise RuntimeError("no colocd weight update is active on this worker")
    try:
        finalize_layerwise_reload(model, model_config)
    finally:
        _STATE.active = False
    return {"chunks": _STATE.chunks, "n_tensors": len(_STATE.received)}


class ColocdWorkerExtension:
    """Mixed into vLLM's worker class; every public method is a ``/collective_rpc`` target.

    Names carry a ``colocd_`` prefix: vLLM refuses extensions whose attributes clash with the
    worker's (worker_base.py:296-320). ``self`` is the vLLM worker (model_runner, vllm_config, device).
    """

    def _colocd_receiver(self) -> ChunkReceiver:
        receiver = getattr(self, "_colocd_receiver_obj", None)
        if receiver is None:
            receiver = ChunkReceiver(torch.device(getattr(self, "device", "cpu")))
            self._colocd_receiver_obj = receiver
        return receiver

    def colocd_info(self) -> dict[str, Any]:
        """What the extension can do here: version, device, backend registration, an open update."""
        device = torch.device(getattr(self, "device", "cpu"))
        return {
            "extension_version": EXTENSION_VERSION,
            "device": str(device),
            "tp_rank": _tp_rank(),
            "backend_registered": _BACKEND_REGISTERED,
            "update_active": _STATE.active,
            "boot_id": _BOOT_ID,
        }

    def colocd_begin_update(self) -> None:
        """Start a weight update without vLLM's weight-transfer engine (no --weight-transfer-config)."""
        begin(self.model_runner.get_model())  # type: ignore[attr-defined]

    def colocd_load_chunk(self, update_info: dict[str, Any]) -> dict[str, Any]:
        """Load one chunk: ``update_info`` is wire.colocd_update_info (``{"seq", "payloads"}``)."""
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
        """Finish the update started by colocd_begin_update; returns the chunks and tensors it received."""
        summary = finish(
            self.model_runner.get_model(),  # type: ignore[attr-defined]
            self.model_config,  # type: ignore[attr-defined]
        )
        reset_lora = getattr(self.model_runner, "reset_lora_state", None)  # type: ignore[attr-defined]
        if callable(reset_lora):
            reset_lora()  # vLLM's finish_weight_update does the same (gpu_worker.py:1602-1604)
        return summary

    def colocd_received_digests(self, names: list[str]) -> dict[str, str]:
        """The engines/digest.py digest of each named tensor the current (or last) update received; a name it
        did not receive is left out."""
        return {n: _STATE.received[n] for n in names if n in _STATE.received}

    def colocd_model_digest(self) -> dict[str, Any]:
        """SHA-256 over the served model's parameters as they sit in memory (vLLM names and layout).

        On CPU the prepacked linear weights are empty tensors here, so this covers the rest only. While a weight
        update is under way the layers sit on the meta device, with no bytes to hash: the reply is then a refusal
        (``refused``, in words) rather than an error, since vLLM answers any worker exception with a bare 500.
        """
        params = sorted(self.model_runner.get_model().named_parameters(), key=lambda kv: kv[0])  # type: ignore[attr-defined]
        if _STATE.active or any(p.is_meta for _, p in params):
            return {"refused": "a weight update is under way on this worker: its layers hold no weights until the "
                               "update ends (colocd_finish_update or /finish_weight_update); ask again then"}
        h = hashlib.sha256()
        n = empty = 0
        for name, p in params:
            t = p.detach()
            h.update(f"{name}:{t.dtype}:{tuple(t.shape)}\n".encode())
            if t.numel() == 0:
                empty += 1
            else:
                h.update(t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
            n += 1
        return {"digest": h.hexdigest(), "n_params": n, "n_empty": empty}


def register_backend() -> bool:
    """Register the ``colocd`` backend with vLLM's WeightTransferEngineFactory; False outside vLLM."""
    try:
        from vllm.distributed.weight_transfer.factory import (
            WeightTransferEngineFactory,
        )
    except Exception:  # not inside a vLLM install: the extension's pure parts still import
        return False
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        # Lazy registration by module path: transfer.py imports vLLM's base classes only when a
        # server configured with {"backend": "colocd"} builds its engine (gpu_worker.py:599-605).
        WeightTransferEngineFactory.register_engine(
            BACKEND_NAME, "colocd.engines.vllm.transfer", "ColocdWeightTransferEngine"
        )
    return True


# vLLM imports the worker extension class when it builds the worker, before load_model creates the
# weight-transfer engine, so registering at import makes the backend available to that same worker.
_BACKEND_REGISTERED = register_backend() if os.environ.get("COLOCD_VLLM_NO_BACKEND") != "1" else False
