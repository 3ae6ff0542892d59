"""Translation of httpx failures and vLLM error replies into colocd's engine errors, in one place.

vLLM's error bodies come in three shapes (0.32.0): the app-wide handlers' OpenAI ``ErrorResponse``
``{"error": {"message", "type", "code"}}`` (serve/exception_handling/register.py:26-42, used for
HTTPException, validation errors and anything a worker raised through collective_rpc), /pause's own
``{"error": "<text>"}`` (rl/online/api_router.py:62-66), and FastAPI's ``{"detail": ...}`` should a
handler be missing. The engine's message is kept verbatim in the error we raise.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from ...errors import EngineRejected
from ..httpmap import map_http_errors

__all__ = ["engine_message", "map_transport_errors", "raise_for_status"]

_MAX_BODY = 2000


def engine_message(response: httpx.Response) -> str:
    """The human message inside a vLLM error reply, or the raw body when it has none."""
    text = response.text
    try:
        data = json.loads(text)
    except ValueError:
        return text[:_MAX_BODY] or response.reason_phrase
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and isinstance(message := err.get("message"), str):
            return message
        if isinstance(err, str):
            return err
        detail = data.get("detail")
        if isinstance(detail, str):
            return detail
        if detail is not None:
            return json.dumps(detail)[:_MAX_BODY]
        if isinstance(message := data.get("message"), str):
            return message
    return text[:_MAX_BODY]


def raise_for_status(engine: str, method: str, path: str, response: httpx.Response) -> None:
    """Raise EngineRejected naming the route, the status and vLLM's own message on any non-2xx."""
    if response.is_success:
        return
    message = engine_message(response)
    raise EngineRejected(
        engine,
        f"vLLM rejected {method} {path} with {response.status_code}: {message}",
        status=response.status_code,
        body=response.text[:_MAX_BODY],
    )


@contextmanager
def map_transport_errors(engine: str, method: str, path: str) -> Iterator[None]:
    """Turn httpx exceptions raised inside the block into EngineError subclasses (``from exc``)."""
    with map_http_errors(engine, f"{method} {path}"):
        yield
