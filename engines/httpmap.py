"""Translate httpx failures and engine error replies into the ``engines.errors`` tree, in one place."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import httpx

from .errors import EngineProtocolError, EngineRejected, EngineTimeout, EngineUnreachable

__all__ = ["check_reply", "map_http_errors"]


@contextmanager
def map_http_errors(engine: str, what: str) -> Iterator[None]:
    """Re-raise httpx exceptions as engine errors naming the engine and the call."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise EngineTimeout(engine, f"{what}: no answer ({type(exc).__name__})") from exc
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        raise EngineUnreachable(engine, f"{what}: {type(exc).__name__}: {exc or 'connection failed'}") from exc
    except httpx.HTTPError as exc:
        raise EngineProtocolError(engine, f"{what}: {type(exc).__name__}: {exc}") from exc


def check_reply(engine: str, what: str, response: httpx.Response) -> httpx.Response:
    """Raise EngineRejected for a 4xx/5xx reply, carrying the engine's own message."""
    if response.status_code >= 400:
        body = response.text[:2000]
        raise EngineRejected(
            engine, f"{what}: HTTP {response.status_code}: {_message(response) or body or 'no body'}",
            status=response.status_code, body=body,
        )
    return response


def _message(response: httpx.Response) -> str | None:
    try:
        data = response.json()
    except ValueError:
        return None
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            value = data.get(key)
            if isinstance(value, dict):
                value = value.get("message")
            if value:
                return str(value)
    return None
