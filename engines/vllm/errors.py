"""Translation of httpx failures and vLLM error replies into colocd's engine errors, in one place.

vLLM's error bodies come in three shapes (0.32.0): the app-wide handlers' OpenAI ``ErrorResponse``
``{"error": {"message", "type", "code"}}`` (serve/exception_handling/register.py:26-42, used for
HTTPException, validation errors and anything a worker raised through collective_rpc), /pause's own
``{"error": "<text>"}`` (rl/online/api_router.py:62-66), and FastAPI's ``{"detail": ...}`` should a
handler be missing (``httpmap.reply_message`` reads each). The engine's message is kept verbatim in the error we
raise.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from ...errors import EngineRejected
from ..httpmap import map_http_errors, reply_message

__all__ = ["map_transport_errors", "raise_for_status"]

_MAX_BODY = 2000


def raise_for_status(engine: str, method: str, path: str, response: httpx.Response) -> None:
    """Raise EngineRejected naming the route, the status and vLLM's own message on any non-2xx."""
    if response.is_success:
        return
    message = reply_message(response) or response.text[:_MAX_BODY] or response.reason_phrase
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
