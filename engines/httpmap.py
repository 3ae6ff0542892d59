"""Translate httpx failures and engine error replies into colocd's error tree (``colocd.errors``), in one place;
say when an engine's refusal is the caller's mistake."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import httpx

from ..errors import EngineProtocolError, EngineRejected, EngineTimeout, EngineUnreachable, PayloadRejected

__all__ = ["caller_payload", "check_reply", "map_http_errors", "refused_payload"]

# An engine's answer that means "the data you sent me is wrong" (SGLang answers 400 with success=false;
# FastAPI-based engines 422; a body over the engine's limit 413), as opposed to "I failed" (5xx).
PAYLOAD_REFUSAL_STATUSES = frozenset({400, 413, 422})


@contextmanager
def map_http_errors(engine: str, what: str) -> Iterator[None]:
    """Re-raise httpx exceptions as engine errors naming the engine and the call."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise EngineTimeout(engine, f"{what}: no answer ({type(exc).__name__})") from exc
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
        raise EngineUnreachable(engine, f"{what}: {_describe(exc)}") from exc
    except httpx.HTTPError as exc:
        raise EngineProtocolError(engine, f"{what}: {_describe(exc)}") from exc


def refused_payload(exc: BaseException, *, field: str | None = None,
                    describe: Callable[[EngineRejected], str] | None = None) -> PayloadRejected | None:
    """The caller's 422 if ``exc`` is an engine's refusal of data the caller wrote (400/413/422; ``describe`` words
    it, by default naming ``field``), else None: an engine that fails (5xx) stays an engine error."""
    if not isinstance(exc, EngineRejected) or exc.status not in PAYLOAD_REFUSAL_STATUSES:
        return None
    message = describe(exc) if describe is not None else f"{exc} (the request's {field or 'payload'} was refused)"
    return PayloadRejected(message, engine=exc.engine, field=field)


@contextmanager
def caller_payload(field: str | None = None) -> Iterator[None]:
    """Engine calls in this block carry data the caller wrote: an engine's refusal of it is the caller's 422."""
    try:
        yield
    except EngineRejected as exc:
        if (refusal := refused_payload(exc, field=field)) is None:
            raise
        raise refusal from exc


_EMPTY_REASONS = {
    httpx.ReadError: "connection closed while reading the reply (engine crashed or restarted?)",
    httpx.WriteError: "connection closed while sending the request",
    httpx.RemoteProtocolError: "engine closed the connection without a reply",
    httpx.ConnectError: "connection refused or host unreachable",
}


def _describe(exc: httpx.HTTPError) -> str:
    """``ReadError: <text>``; httpx often has no text (a reset), so say what the class means instead."""
    text = str(exc).strip()
    if not text:
        text = next((why for cls, why in _EMPTY_REASONS.items() if isinstance(exc, cls)), "no detail from httpx")
        if exc.__cause__ is not None and str(exc.__cause__).strip():
            text = f"{text}: {exc.__cause__}"
    return f"{type(exc).__name__}: {text}"


def check_reply(engine: str, what: str, response: httpx.Response) -> httpx.Response:
    """Raise EngineRejected for a 4xx/5xx reply, carrying the engine's own message."""
    if response.status_code >= 400:
        body = response.text[:2000]
        raise EngineRejected(
            engine, f"{what}: HTTP {response.status_code}: {reply_message(response) or body or 'no body'}",
            status=response.status_code, body=body,
        )
    return response


def reply_message(response: httpx.Response) -> str | None:
    """The engine's own words in an error reply: ``message``, FastAPI's ``detail`` (text, or validation errors as
    JSON) or ``error`` (text, or OpenAI's ``{"message", ...}``: vLLM's app-wide handlers); None when it has none."""
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
                return value if isinstance(value, str) else json.dumps(value)[:2000]
    return None
