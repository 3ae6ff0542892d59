"""Every error answered in one body shape (``ErrorBody``): colocd's carry their own (``colocd.errors``), the
framework's (routing 404/405, a body not JSON, validation) are rewritten into it. Routes raise, never build a reply."""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from ..errors import ColocdError
from .schemas import ErrorBody

__all__ = ["ERROR_RESPONSES", "install_error_handlers"]

# The framework's statuses, named the way the daemon names its own errors.
_HTTP_NAMES = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound",
               405: "MethodNotAllowed", 411: "LengthRequired", 413: "PayloadTooLarge",
               415: "UnsupportedMediaType", 422: "ValidationError"}

_DESCRIPTIONS = {
    400: "malformed request (body not UTF-8 or not JSON, policy document invalid)",
    401: "missing or wrong bearer token",
    404: "unknown route, session, engine, group or step",
    405: "method not allowed on this path (see the Allow header)",
    409: "illegal in the node's current state, or a reference (manifest_ref) this daemon does "
         "not hold; nothing changed",
    410: "the weight session expired, was aborted or committed; or the LoRA adapter named was retired",
    413: "request body larger than limits.max_body_bytes",
    422: "a field is wrong (named in 'field'/'fields'), or an engine refused the caller's payload",
    500: "a colocd bug; please report it with the daemon's log",
    502: "an engine failed or refused a call that was not the caller's mistake",
    503: "an engine is unreachable",
    504: "an engine or a trainer rank did not answer within its budget",
    507: "the state changed but the daemon could not write its journal (named in 'journal'); fix the disk",
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorBody, "description": text} for status, text in _DESCRIPTIONS.items()}


def _validation_body(errors: list[Any]) -> tuple[int, dict[str, object]]:
    """A pydantic error list as the API answers it: 400 for JSON that does not parse, else 422 naming each field."""
    for err in errors:
        if err.get("type") == "json_invalid":
            # FastAPI puts the character's position last in loc; pydantic's own JSON parsing leaves loc empty
            # and says where in ctx.error.
            loc = tuple(err.get("loc") or ())
            where = f"at character {loc[-1]}: " if len(loc) > 1 else ""
            return 400, {"error": "BadRequest", "message": f"request body is not valid JSON ({where}"
                         f"{(err.get('ctx') or {}).get('error') or err.get('msg')})"}
    fields = []
    for err in errors:
        field = ".".join(str(p) for p in err.get("loc", ()) if p != "body") or "body"
        fields.append({"field": field, "message": str(err.get("msg") or err.get("type") or "invalid")})
    message = "; ".join(f"{f['field']}: {f['message']}" for f in fields) or "ValidationError (HTTP 422)"
    body: dict[str, object] = {"error": "ValidationError", "message": message, "fields": fields}
    if fields:
        body["field"] = fields[0]["field"]
    return 422, body


def _allowed_methods(app: Any, scope: MutableMapping[str, Any]) -> list[str]:
    """Every method some route serves at this path (Starlette's 405 names only the first route's)."""
    methods: set[str] = set()
    for route in app.router.routes:
        route_methods = getattr(route, "methods", None)
        # FULL or PARTIAL (path matches, method does not): either way the path is this route's.
        if route_methods and route.matches(scope)[0] is not Match.NONE:
            methods.update(route_methods)
    return sorted(methods | {"OPTIONS"}) if methods else []


def install_error_handlers(app: FastAPI) -> None:
    async def colocd_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ColocdError)
        return JSONResponse(exc.http_body(), status_code=exc.http_status)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        status, body = _validation_body(list(exc.errors()))
        return JSONResponse(body, status_code=status)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        status = exc.status_code
        headers = dict(exc.headers or {})
        if status == 405:
            allow = _allowed_methods(request.app, request.scope)
            if request.method == "OPTIONS" and allow:
                return Response(status_code=204, headers={"Allow": ", ".join(allow)})
            headers["Allow"] = ", ".join(allow)
            message = f"{request.method} is not allowed on {request.url.path}; allowed: {', '.join(allow)}"
        elif status == 404:
            message = f"no route {request.url.path}"
        elif status == 400 and "parsing the body" in str(exc.detail):
            message = "request body could not be read as JSON (is it UTF-8?)"
        else:
            message = str(exc.detail or "")
        error = _HTTP_NAMES.get(status, f"HTTP{status}")
        return JSONResponse({"error": error, "message": message or f"{error} (HTTP {status})"}, status_code=status,
                            headers=headers or None)

    app.add_exception_handler(ColocdError, colocd_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
