"""What one reference engine server is: device, seed, emulated SGLang protocol, model shape, limits.

Built by ``__main__`` from the command line and handed to ``create_app``; nothing reads it globally.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .model import QwenLikeConfig

__all__ = ["PROTOCOL_VERSIONS", "ProtocolName", "ReferenceServerSettings"]

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
    health_timeout_s: float = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default
    model_path: str = "colocd/reference-qwen-like"
    weight_version: str = "default"  # SGLang's --weight-version default
    host: str = "127.0.0.1"  # reported in /server_info only; __main__ binds the socket
    port: int = 0
    # Tensor-parallel ranks, each with its own full copy of the weights on its own device, fed by its own
    # serialized_named_tensors entry (as SGLang's TP schedulers each read theirs).
    tp_size: int = 1

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOL_VERSIONS:
            raise ValueError(f"protocol must be one of {sorted(PROTOCOL_VERSIONS)}, got {self.protocol!r}")
        for name in ("max_batch", "tp_size", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    @property
    def version(self) -> str:
        return PROTOCOL_VERSIONS[self.protocol]

    @property
    def max_seq(self) -> int:
        return self.model.max_position
