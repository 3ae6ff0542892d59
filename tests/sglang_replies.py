"""SGLang reply models and a request body that only the tests read (the adapter reads ``{success, message}`` and
the few fields it needs directly); each mirrors the 0.5.23 wheel as ``colocd.engines.sglang.wire`` does."""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from colocd.engines.sglang.wire import SGLangRequest

__all__ = ["CheckWeightsResult", "ControlResult", "ErrorDetail", "ErrorResponse", "GenerationControlResult",
           "RankChecksums",
           "UpdateWeightFromDiskReqInput", "UpdateWeightVersionResult", "WeightVersionInfo"]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class ErrorDetail(_Reply):
    message: str


class ErrorResponse(_Reply):
    """``{"error": {"message"}}``: release/resume and other routes that catch (http_server.py:2246-2250)."""

    error: ErrorDetail


class UpdateWeightFromDiskReqInput(SGLangRequest):
    """io_struct.py:1970; POST /update_weights_from_disk (http_server.py:1300).

    Reply ``{success, message, num_paused_requests}``. No session needed; on a failed load the
    engine reloads its original checkpoint (model_runner_components/weight_updater.py:225-238).
    """

    ROUTE: ClassVar[str] = "/update_weights_from_disk"
    model_path: str  # io_struct.py:1972
    load_format: str | None = None  # io_struct.py:1974: None means the server's own load format
    abort_all_requests: bool = False  # io_struct.py:1976
    weight_version: str | None = None  # io_struct.py:1978
    is_async: bool = False  # io_struct.py:1980
    torch_empty_cache: bool = False  # io_struct.py:1982
    keep_pause: bool = False  # io_struct.py:1984
    recapture_cuda_graph: bool = False  # io_struct.py:1986
    token_step: int = 0  # io_struct.py:1988
    flush_cache: bool = True  # io_struct.py:1990
    manifest: dict[str, Any] | None = None  # io_struct.py:1992


class ControlResult(_Reply):
    """``{success, message}``: begin/end session, tensor/distributed updates, group init/destroy.

    Sent with HTTP 200 on success and 400 on failure (e.g. http_server.py:1452-1455).
    """

    success: bool
    message: str = ""


class UpdateWeightVersionResult(ControlResult):
    """http_server.py:1540-1556; ``new_version`` only on success."""

    new_version: str | None = None


class RankChecksums(_Reply):
    """One ``ranks`` entry of a checksum reply: per fused parameter, and over the rank's weights."""

    checksums: dict[str, str] = Field(default_factory=dict)
    per_gpu_checksum: str | None = None


class CheckWeightsResult(ControlResult):
    """http_server.py:1614-1619: ``ranks`` (one entry per TP rank and role) and a combined checksum. Shapes as
    recorded live (``tests/contract/fixtures/sglang_live_0_5_23.json``, ``weights_checker``)."""

    ranks: list[RankChecksums] | None = None
    per_engine_checksum: str | list[str] | None = None

    def checksum(self) -> str | None:
        """The one string that stands for the engine's weights: SGLang's per-engine checksum (the first, where it
        is a list), else None."""
        value = self.per_engine_checksum
        if isinstance(value, list):
            value = value[0] if value else None
        return value or None


class GenerationControlResult(_Reply):
    """Pause and continue reply ``{"message": ..., "status": "ok"}`` (http_server.py:1838-1841, 1851-1854)."""

    message: str
    status: str


class WeightVersionInfo(_Reply):
    """GET /get_weight_version before 0.5.9 (0.5.4 http_server.py:488-493)."""

    weight_version: str | None = None
