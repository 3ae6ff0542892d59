"""What one reference engine server is: device, seed, emulated SGLang protocol, model shape, limits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .model import QwenLikeConfig

__all__ = ["MODEL_PATH", "PROTOCOL_VERSIONS", "ProtocolName", "ReferenceServerSettings"]

MODEL_PATH = "colocd/reference-qwen-like"  # what /model_info and /server_info name as the model

ProtocolName = Literal["0.5.23", "legacy"]

# The SGLang version each protocol emulates, as reported by /server_info's "version".
# "legacy" is the surface of SGLang ≈0.5.4 (snapshot 0025436e) that slime and verl still drive.
PROTOCOL_VERSIONS: dict[str, str] = {"0.5.23": "0.5.23", "legacy": "0.5.4"}


@dataclass(frozen=True, slots=True)
class ReferenceServerSettings:
    """Settings of one reference engine server."""

    device: str = "cpu"
    seed: int = 0
    protocol: ProtocolName = "0.5.23"
    api_key: str | None = None
    model: QwenLikeConfig = field(default_factory=QwenLikeConfig)
    max_batch: int = 8  # KV pool slots = most requests decoding at once (SGLang's max_running_requests)
    # Tensor-parallel ranks, each with its own full copy of the weights on its own device, fed by its own
    # serialized_named_tensors entry (as SGLang's TP schedulers each read theirs).
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_batch", "tp_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def version(self) -> str:
        return PROTOCOL_VERSIONS[self.protocol]

    @property
    def max_seq(self) -> int:
        return self.model.max_position
