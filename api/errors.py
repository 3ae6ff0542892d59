"""Map the daemon's error tree onto HTTP statuses in one table; clients never see a traceback."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from ..daemon.config import ConfigError
from ..daemon.errors import (
    ChunkTimeout,
    ColocdError,
    EngineError,
    EngineRejected,
    EngineTimeout,
    EngineUnreachable,
    MemoryNotConfirmed,
    NotFound,
    PayloadRejected,
    RequestInvalid,
    SessionGone,
    StepTimeout,
    TransitionFailed,
    TransitionRejected,
    WeightSyncError,
)

__all__ = ["install_error_handlers", "status_for"]

log = logging.getLogger("colocd.api")

# Most specific first.
_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (RequestInvalid, 422),
    (TransitionRejected, 409),
    (SessionGone, 410),
    (NotFound, 404),
    (ConfigError, 400),
    (ChunkTimeout, 504),
    (StepTimeout, 504),
    (MemoryNotConfirmed, 504),
    (EngineTimeout, 504),
    (EngineUnreachable, 503),
    (EngineRejected, 502),
    (TransitionFailed, 502),
    (WeightSyncError, 502),
    (EngineError, 502),
    (ColocdError, 500),
)


def status_for(exc: Exception) -> int:
    for cls, status in _STATUS:
        if isinstance(exc, cls):
            return status
    return 500


def _body(exc: Exception, status: int) -> dict[str, object]:
    body: dict[str, object] = {"error": type(exc).__name__, "message": str(exc)}
    if isinstance(exc, TransitionRejected) and exc.state:
        body["state"] = exc.state
    if isinstance(exc, RequestInvalid) and exc.field:
        body["field"] = exc.field
    if isinstance(exc, PayloadRejected | EngineError):
        body["engine"] = exc.engine
    if isinstance(exc, SessionGone):
        body.update(session_id=exc.session_id, session_state=exc.state)
    if isinstance(exc, ChunkTimeout):
        body.update(engine=exc.engine, step=exc.step, budget_s=exc.budget_s, rank=exc.rank)
    if isinstance(exc, TransitionFailed):
        body.update(engine=exc.engine, step=exc.step)
        if isinstance(exc, StepTimeout):
            body["budget_s"] = exc.budget_s
    return body


def install_error_handlers(app: FastAPI) -> None:
    async def colocd_error(request: Request, exc: Exception) -> JSONResponse:
        status = status_for(exc)
        return JSONResponse(_body(exc, status), status_code=status)

    async def validation_error(request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        problems = []
        for err in exc.errors():
            loc = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
            problems.append(f"{loc or 'body'}: {err.get('msg')}")
        return JSONResponse({"error": "ValidationError", "message": "; ".join(problems),
                             "fields": [{"field": ".".join(str(p) for p in e.get("loc", ()) if p != "body"),
                                         "message": e.get("msg")} for e in exc.errors()]},
                            status_code=422)

    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error on %s %s", request.method, request.url.path)
        return JSONResponse({"error": "InternalError", "message": f"{type(exc).__name__}: {exc}"}, status_code=500)

    app.add_exception_handler(ColocdError, colocd_error)
    app.add_exception_handler(EngineError, colocd_error)
    app.add_exception_handler(ConfigError, colocd_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, unexpected)
