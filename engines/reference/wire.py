"""``/generate``'s body (the one SGLang route colocd never sends), and how every route parses its body.

Fields follow SGLang 0.5.23's ``io_struct.py`` and ``sampling_params.py``; every other route takes the model the
SGLang adapter builds its request with (``engines/sglang/wire.py``), parsed leniently by ``sglang_body``.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated, Any, TypeVar

from fastapi import Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

__all__ = ["GenerateBody", "SGLangBody", "SamplingParamsBody", "sglang_body", "success"]

_M = TypeVar("_M", bound=BaseModel)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class SamplingParamsBody(_Body):
    """sampling_params.py:140 SamplingParams, the knobs the reference engine honours."""

    max_new_tokens: int = 128
    stop: str | list[str] = []
    stop_token_ids: list[int] = []
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None
    n: int = 1

    @model_validator(mode="before")
    @classmethod
    def _defaults(cls, data: Any) -> Any:
        # None means "the default" for every field, as SGLang's __post_init__ has it.
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    def verify(self) -> None:
        """SGLang's ``SamplingParams.verify`` checks, with its messages; raises ``ValueError``."""
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if self.top_k < 1 and self.top_k != -1:
            raise ValueError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}.")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if self.n != 1:
            raise ValueError("the colocd reference engine supports n=1 only; send a batch instead")


class GenerateBody(_Body):
    """io_struct.py:177 GenerateReqInput, the fields the reference engine honours."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    stream: bool = False


def sglang_body(model: type[_M], *, optional: bool = False) -> Any:
    """A ``Depends`` that parses a route's JSON body as ``model`` the way SGLang parses its structs: unknown keys
    ignored (``msgspec_utils.py``: ``extra_behavior="ignore"``), where the adapter refuses them when it builds a
    body. A body that does not fit is FastAPI's validation error (a 400 in SGLang's shape, ``server.py``);
    ``optional``: no body at all means the model's defaults."""

    async def parse(request: Request) -> _M:
        raw = await request.body()
        if optional and not raw:
            return model()
        try:
            data = json.loads(raw)
            if isinstance(data, dict):
                data = {k: v for k, v in data.items() if k in model.model_fields}
            return model.model_validate(data)
        except ValidationError as exc:
            raise RequestValidationError(exc.errors()) from None
        except ValueError as exc:  # not JSON (an empty body included)
            raise RequestValidationError([{"loc": ("body",), "msg": f"not a JSON body: {exc}"}]) from None

    return Depends(parse)


def success(ok: bool, message: str, **extra: Any) -> JSONResponse:
    """SGLang's ``{success, message}``: 200 on success, 400 otherwise (e.g. http_server.py:1452-1455)."""
    return JSONResponse({"success": ok, "message": message, **extra}, status_code=200 if ok else 400)


if TYPE_CHECKING:
    SGLangBody = Annotated[_M, "parsed by sglang_body"]  # to a type checker, SGLangBody[X] is X
else:

    class SGLangBody:
        """``body: SGLangBody[X]`` on a route: its body parsed as ``X`` by ``sglang_body``."""

        def __class_getitem__(cls, model: type[BaseModel]) -> object:
            return Annotated[model, sglang_body(model)]
