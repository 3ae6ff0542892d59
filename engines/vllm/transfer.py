"""The ``colocd`` backend for vLLM's native weight transfer; runs only inside a vLLM worker.

Selected with ``--weight-transfer-config '{"backend":"colocd"}'`` and registered by extension.py
when vLLM imports the worker extension. The four native routes then map onto our receiver:
/init_weight_transfer_engine → nothing to set up; /start_weight_update → layer-wise reload begins;
/update_weights ``{"update_info": {"seq", "payloads"}}`` → one chunk (shm, cuda_ipc or disk);
/finish_weight_update → layer-wise reload finalised. Unlike vLLM's ``ipc`` and ``nccl`` backends it
also works on CPU, which is how CI exercises the native protocol end to end.

Imports vLLM at module level: never import this outside a vLLM worker.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from . import extension

__all__ = ["ColocdInitInfo", "ColocdUpdateInfo", "ColocdWeightTransferEngine"]


@dataclass
class ColocdInitInfo(WeightTransferInitInfo):
    """``init_info`` of /init_weight_transfer_engine: nothing is negotiated; unknown keys are a 500."""


@dataclass
class ColocdUpdateInfo(WeightTransferUpdateInfo):
    """``update_info`` of /update_weights: wire.colocd_update_info."""

    payloads: list[dict[str, Any]] = field(default_factory=list)
    seq: int | None = None


class ColocdWeightTransferEngine(WeightTransferEngine[ColocdInitInfo, ColocdUpdateInfo]):
    """Loads colocd chunks through vLLM's layer-wise reload (see extension.py for why)."""

    init_info_cls = ColocdInitInfo
    update_info_cls = ColocdUpdateInfo
    supports_draft_weight_update = False  # chunks name target-model parameters only

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._receiver = extension.ChunkReceiver(self.device)

    def init_transfer_engine(self, init_info: ColocdInitInfo) -> None:
        pass

    def start_weight_update(self) -> None:
        extension.begin(self.model, strict=False)

    def receive_weights(self, update_info: ColocdUpdateInfo) -> None:
        extension.load(self.model, self.model_config, self._receiver, update_info.payloads)

    def finish_weight_update(self) -> None:
        extension.finish(self.model, self.model_config)

    def shutdown(self) -> None:
        """Nothing to close: each chunk's IPC mapping is dropped with its views as the chunk is loaded."""
