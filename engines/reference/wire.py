"""Request bodies of the SGLang routes the reference engine serves, as pydantic models.

Field names, types and defaults follow SGLang 0.5.23's ``managers/io_struct.py`` and
``sampling/sampling_params.py`` (line numbers in the comments); unknown fields are ignored, as
SGLang's structs carry extra bookkeeping fields (``rid``, ``http_worker_ipc``) callers may send.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from ..base import PauseMode

__all__ = [
    "AbortRequestBody",
    "BeginWeightUpdateBody",
    "CheckWeightsBody",
    "ContinueGenerationBody",
    "EndWeightUpdateBody",
    "GenerateBody",
    "MemoryTagsBody",
    "PauseGenerationBody",
    "SamplingParamsBody",
    "UpdateWeightVersionBody",
    "UpdateWeightsFromTensorBody",
]

Selector = Literal["target", "draft", "all"]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class PauseGenerationBody(_Body):
    """io_struct.py:1927 PauseGenerationReqInput."""

    mode: PauseMode = PauseMode.ABORT


class ContinueGenerationBody(_Body):
    """io_struct.py:1949 ContinueGenerationReqInput."""

    torch_empty_cache: bool = True


class MemoryTagsBody(_Body):
    """io_struct.py:2177/2187 Release/ResumeMemoryOccupationReqInput: null or [] means every tag."""

    tags: list[str] | None = None


class BeginWeightUpdateBody(_Body):
    """io_struct.py:2197 BeginWeightUpdateReqInput."""

    selector: Selector = "all"


class EndWeightUpdateBody(_Body):
    """io_struct.py:2208 EndWeightUpdateReqInput (no fields)."""


class UpdateWeightsFromTensorBody(_Body):
    """io_struct.py:2027 UpdateWeightsFromTensorReqInput; entries are base64 strings over HTTP."""

    serialized_named_tensors: list[str]
    load_format: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    selector: Selector = "all"
    torch_empty_cache: bool = False


class UpdateWeightVersionBody(_Body):
    """io_struct.py:2155 UpdateWeightVersionReqInput; note the default aborts every request."""

    new_version: str
    abort_all_requests: bool = True


class AbortRequestBody(_Body):
    """io_struct.py:2285 AbortReq."""

    rid: str | None = ""
    abort_all: bool = False


class CheckWeightsBody(_Body):
    """io_struct.py:2217 CheckWeightsReqInput."""

    action: str = "checksum"
    allow_quant_error: bool = False
    skip_tensor_list: list[str] | None = None
    selector: Selector = "all"


class SamplingParamsBody(_Body):
    """sampling_params.py:140 SamplingParams, the knobs the reference engine honours.

    ``None`` means "the default" for every field, as SGLang's ``__post_init__`` does.
    """

    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = 1.0
    top_p: float | None = 1.0
    top_k: int | None = -1
    min_p: float | None = 0.0
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    sampling_seed: int | None = None
    n: int | None = 1

    def verify(self) -> None:
        """SGLang's ``SamplingParams.verify`` checks, with its messages; raises ``ValueError``."""
        if (self.temperature or 0.0) < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < (1.0 if self.top_p is None else self.top_p) <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= (self.min_p or 0.0) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        top_k = -1 if self.top_k is None else self.top_k
        if top_k < 1 and top_k != -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {top_k}.")
        if self.max_new_tokens is not None and self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if (self.n or 1) != 1:
            raise ValueError("the colocd reference engine supports n=1 only; send a batch instead")


class GenerateBody(_Body):
    """io_struct.py:177 GenerateReqInput, the fields the reference engine honours."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    stream: bool = False
