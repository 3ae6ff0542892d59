"""The ASGI gate in front of every route: the bearer token checked, then the body size bounded, before any body
byte is read; an unexpected exception answered in the usual error shape, keeping the connection. Reads are open."""

from __future__ import annotations

import hmac
import json
import logging
from typing import Any

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = ["READ_METHODS", "RequestGuard"]

log = logging.getLogger("colocd.api")

READ_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


class RequestGuard:
    """``RequestGuard(app, token=..., max_body_bytes=...)``: 401 and 413 answered before the body is read."""

    def __init__(self, app: ASGIApp, *, token: str | None, max_body_bytes: int) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["method"] not in READ_METHODS:
            if self._expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""),
                                                                      self._expected):
                await _answer(send, 401, "Unauthorized",
                              "missing or wrong bearer token (Authorization: Bearer <token>)",
                              {"www-authenticate": "Bearer"})
                return
            declared = headers.get(b"content-length")
            if declared is not None:
                try:
                    length = int(declared)
                except ValueError:
                    await _answer(send, 400, "BadRequest", f"Content-Length {declared[:40]!r} is not a number")
                    return
                if length > self.max_body_bytes:
                    await _answer(send, 413, "PayloadTooLarge", self._too_large(length))
                    return
        receive = self._counting(receive)
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as exc:
            # A bug, not a caller's mistake. Answer it like every other error, and do not re-raise: that
            # would make the server drop the keep-alive connection, failing the caller's next request too.
            log.exception("unexpected error on %s %s", scope["method"], scope["path"])
            if not started:
                await _answer(send, 500, "InternalError", f"{type(exc).__name__}: {exc}".rstrip(": "))

    def _too_large(self, length: int | None) -> str:
        size = f"{length} bytes" if length is not None else "the streamed body"
        return (f"request body of {size} is over the node's limit of {self.max_body_bytes} bytes "
                "(limits.max_body_bytes in the node config)")

    def _counting(self, receive: Receive) -> Receive:
        """Bound a body sent without Content-Length (chunked) as it streams in."""
        seen = 0
        limit = self.max_body_bytes
        too_large = self._too_large(None)

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    # An HTTPException, so FastAPI's body parsing passes it on (it turns others into 400).
                    raise HTTPException(413, too_large, headers={"connection": "close"})
            return message

        return counted


async def _answer(send: Send, status: int, error: str, message: str, headers: dict[str, str] | None = None) -> None:
    body = json.dumps({"error": error, "message": message}).encode()
    raw: list[Any] = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    if status in (401, 413, 400):
        # The body was not read: the connection cannot carry another request after it.
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
