"""The HTTP shell: ``create_app(config, daemon=...)`` builds a FastAPI app whose lifespan owns the Daemon."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any, Literal

import pydantic_core
from fastapi import APIRouter, Body, Depends, FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..daemon.config import NodeConfig
from ..daemon.metrics import LeaseReport
from ..daemon.node import Daemon, TransitionResult
from ..daemon.states import NodePhase
from ..engines.base import ChunkPart
from .errors import ERROR_RESPONSES, install_error_handlers
from .guard import READ_METHODS, RequestGuard
from .schemas import (
    MAX_STEP,
    AbortRequest,
    BroadcastRequest,
    ChunkAckReply,
    ChunkDescriptor,
    CommitRequest,
    JoinReply,
    JoinRequest,
    LeaseReportRequest,
    OpenSessionReply,
    OpenSessionRequest,
    OpenWeightGroupRequest,
    PhaseRequest,
    SleepRequest,
    TransitionReply,
    UpdateWeightsRequest,
)

__all__ = ["create_app"]


def _reply(result: TransitionResult, d: Daemon) -> TransitionReply:
    return TransitionReply(step=result.step, phase=result.phase, replayed=result.replayed,
                           duration_s=result.duration_s, engines=result.engines, freed_bytes=result.freed_bytes,
                           directives=result.directives, trace=result.trace.to_json() if result.trace else None,
                           adapter=d.adapters.current)


def _json_reply(content: dict[str, Any]) -> Response | dict[str, Any]:
    """A reply the daemon built itself, encoded in one pass by pydantic-core (NaN as null) without FastAPI's
    validation of every nested value (measurable on a session's open and commit); ``response_model`` documents it."""
    try:
        return Response(pydantic_core.to_json(content, inf_nan_mode="null"), media_type="application/json")
    except pydantic_core.PydanticSerializationError:
        return content


def _part(chunk: ChunkDescriptor) -> ChunkPart:
    return ChunkPart(rank=chunk.rank, transport=chunk.transport, nbytes=chunk.nbytes, handle=chunk.handle,
                     digests=chunk.digests)


def _get_daemon(request: Request) -> Daemon:
    return request.state.daemon  # type: ignore[no-any-return]


async def _daemon_dependency(request: Request) -> Daemon:
    # async on purpose: FastAPI runs a plain-def dependency in its thread pool, a thread hop per request.
    return _get_daemon(request)


# Module level: with postponed annotations FastAPI resolves these names in the module's globals.
D = Annotated[Daemon, Depends(_daemon_dependency)]
StepPath = Annotated[int, PathParam(ge=0, le=MAX_STEP)]


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The error statuses a route can answer, each with the ErrorBody model, for OpenAPI."""
    return {s: ERROR_RESPONSES[s] for s in statuses}


# What every mutating route can answer before it runs (guard, body, validation), and what a failing engine gives.
_MUTATING = (400, 401, 413, 422)
_ENGINES = (502, 503, 504)
_SESSION = (404, 409, 410)


def create_app(config: NodeConfig, *, daemon: Daemon) -> FastAPI:
    """An app for one node serving ``daemon`` (built, not yet entered: the app's lifespan enters it)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with daemon as d:
            yield {"daemon": d}

    app = FastAPI(title="colocd", version=__version__, lifespan=lifespan,
                  description="Per-node daemon for colocated RL: phase transitions, memory handoff, weight sync. "
                              "Every error has one body shape (ErrorBody); mutating routes need the bearer "
                              "token when the node config sets one.")
    install_error_handlers(app)
    # The token and the body size are checked before any body byte is read; reads stay open.
    app.add_middleware(RequestGuard, token=config.token, max_body_bytes=config.limits.max_body_bytes)
    app.router.routes.extend(_router.routes)  # listed by the app's own router: the Allow header reads them there
    _complete_openapi(app, token=config.token is not None)
    return app


def _complete_openapi(app: FastAPI, *, token: bool) -> None:
    """What FastAPI cannot infer for OpenAPI: the bearer scheme where a token is set, and the session-id links."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        _link_session_routes(schema)
        if not token:
            return schema
        schema.setdefault("components", {})["securitySchemes"] = {"bearerAuth": {
            "type": "http", "scheme": "bearer",
            "description": "the node config's token; mutating routes answer 401 without it, reads need none"}}
        for item in schema.get("paths", {}).values():
            for method, operation in item.items():
                if method.upper() not in READ_METHODS and isinstance(operation, dict):
                    operation["security"] = [{"bearerAuth": []}]
        return schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to customise the document


def _link_session_routes(schema: dict[str, Any]) -> None:
    """``POST /v1/weights/sessions`` answers ``session_id``: link it to every operation with that path parameter."""
    paths = schema.get("paths", {})
    opened = paths.get("/v1/weights/sessions", {}).get("post", {}).get("responses", {}).get("200")
    if opened is None:
        return
    links = opened.setdefault("links", {})
    for path, item in paths.items():
        if "{session_id}" not in path:
            continue
        for operation in item.values():
            if isinstance(operation, dict) and "operationId" in operation:
                links[operation["operationId"]] = {"operationId": operation["operationId"],
                                                   "parameters": {"path.session_id": "$response.body#/session_id"}}


# Every route only translates: it parses the request, calls one Daemon method, and maps the answer.
_router = APIRouter()


@_router.get("/healthz", tags=["probes"])
async def healthz() -> dict[str, str]:
    """Liveness: the daemon's event loop answers."""
    return {"status": "ok"}


@_router.get("/readyz", tags=["probes"],
             responses={503: {"description": "not ready: an engine is detached or unhealthy (problems says which)"}})
async def readyz(d: D) -> JSONResponse:
    """Readiness: every engine attached and healthy."""
    ok, problems = d.ready()
    return JSONResponse({"ready": ok, "problems": problems}, status_code=200 if ok else 503)


# The two read routes take the daemon from the request rather than through the D dependency:
# FastAPI's dependency resolution costs more than the rest of such a read (benchmarks.control).
class _PrometheusText(Response):
    """Prometheus's text exposition format, as OpenAPI declares it (Starlette adds the charset when it serves)."""

    media_type = "text/plain; version=0.0.4"


@_router.get("/metrics", tags=["probes"], response_class=_PrometheusText)
async def metrics(request: Request) -> _PrometheusText:
    """Prometheus text; rendered once per change and shared by concurrent scrapes, off the event loop."""
    return _PrometheusText(await _get_daemon(request).metrics.current())


@_router.get("/v1/status", response_model=dict[str, Any])
async def status(request: Request) -> Response | dict[str, Any]:
    return _json_reply(_get_daemon(request).status())


@_router.post("/v1/phase", responses=_errors(*_MUTATING, 404, 409, 410, *_ENGINES))
async def phase(body: PhaseRequest, d: D) -> TransitionReply:
    """Move the node to a phase at a step; a repeat of a finished (step, phase) is a no-op replay."""
    trainer = body.trainer.model_dump(mode="json", exclude_unset=True) if body.trainer else None
    if body.adapter is not None:
        d.adapters.check(body.adapter)  # the daemon's guard: a retired adapter name is a 410, nothing moves
    return _reply(await d.transitions.transition(NodePhase(body.phase), body.step, trainer), d)


@_router.post("/v1/trainer/leases", responses=_errors(*_MUTATING))
async def report_leases(body: LeaseReportRequest, d: D) -> dict[str, Any]:
    """A trainer rank's IPC lease bytes (``colocd.trainer.leases``), for the ``colocd_ipc_*`` metrics."""
    return d.report_leases(LeaseReport(**body.model_dump()))


@_router.post("/v1/sleep", responses=_errors(*_MUTATING, 404, 409, *_ENGINES))
async def sleep(d: D, body: Annotated[SleepRequest | None, Body()] = None) -> TransitionReply:
    body = body or SleepRequest()
    return _reply(await d.transitions.sleep(tuple(body.tags) if body.tags else None, body.engines), d)


@_router.post("/v1/resume", responses=_errors(*_MUTATING, 404, 409, *_ENGINES))
async def resume(d: D, body: Annotated[SleepRequest | None, Body()] = None) -> TransitionReply:
    body = body or SleepRequest()
    return _reply(await d.transitions.resume(tuple(body.tags) if body.tags else None, body.engines), d)


# The hot routes of a weight session (open, commit) answer pre-encoded JSON (_json_reply); response_model keeps
# each reply's schema in OpenAPI.
@_router.post("/v1/weights/sessions", responses=_errors(*_MUTATING, 409, *_ENGINES),
              response_model=OpenSessionReply)
async def open_session(body: OpenSessionRequest, d: D) -> Response | dict[str, Any]:
    manifest = None if body.manifest is None else [m.model_dump() for m in body.manifest]
    s = await d.sessions.open(step=body.step, version=body.version, ranks=body.ranks, depth=body.depth,
                              manifest=manifest, manifest_ref=body.manifest_ref, partial=body.partial)
    # OpenSessionReply's fields, in its order (tests/integration/test_session_replies.py holds the two to one set).
    return _json_reply({"session_id": s.id, "ranks": s.ranks, "depth": s.depth, "step": s.step, "version": s.version,
                        "partial": s.partial, "idle_s": s.idle_s,
                        "manifest_tensors": None if s.manifest is None else len(s.manifest),
                        "manifest_ref": s.manifest_ref, "transports": [t.value for t in s.transports()]})


@_router.post("/v1/weights/sessions/{session_id}/join", responses=_errors(*_MUTATING, *_SESSION, *_ENGINES))
async def join_session(session_id: str, body: JoinRequest, d: D) -> JoinReply:
    """A rank declares its device and learns which engine TP ranks it feeds (``streams: false``: none)."""
    return JoinReply.model_validate(await d.sessions.join(session_id, body.rank, body.device_id, body.pid))


@_router.post("/v1/weights/sessions/{session_id}/chunks", responses=_errors(*_MUTATING, *_SESSION, *_ENGINES))
async def post_chunk(session_id: str, body: ChunkDescriptor, d: D) -> ChunkAckReply:
    """Returns once every engine consumed the chunk: the rank may then free or refill its buffer."""
    ack = await d.sessions.submit_chunk(session_id, body.seq, _part(body))
    return ChunkAckReply(seq=ack.seq, rank=ack.rank, engines=list(ack.engines), load_s=ack.load_s)


@_router.post("/v1/weights/sessions/{session_id}/commit", responses=_errors(*_MUTATING, *_SESSION, *_ENGINES),
              response_model=dict[str, Any])
async def commit(session_id: str, d: D,
                 body: Annotated[CommitRequest | None, Body()] = None) -> Response | dict[str, Any]:
    return _json_reply(await d.sessions.commit(session_id, (body or CommitRequest()).num_chunks))


@_router.post("/v1/weights/sessions/{session_id}/abort", responses=_errors(*_MUTATING, *_SESSION, *_ENGINES))
async def abort(session_id: str, d: D, body: Annotated[AbortRequest | None, Body()] = None) -> dict[str, Any]:
    reason = body.reason if body is not None else None
    return await d.sessions.abort(session_id, f"aborted by trainer: {reason}" if reason else "aborted by trainer")


@_router.get("/v1/weights/sessions/{session_id}", responses=_errors(404))
async def session_status(session_id: str, d: D) -> dict[str, Any]:
    """The session's progress and state."""
    return d.sessions.get(session_id).stats()


@_router.get("/v1/weights/groups")
async def weight_groups(d: D) -> dict[str, Any]:
    """The rank layout a trainer needs before building its side (world size, rank offsets); open groups."""
    return d.sessions.groups.snapshot()


@_router.post("/v1/weights/groups", responses=_errors(*_MUTATING, 409, *_ENGINES))
async def open_weight_group(body: OpenWeightGroupRequest, d: D) -> dict[str, Any]:
    """Every engine joins; returns once all joined, so the trainer must join concurrently (never after)."""
    return await d.sessions.groups.open(**body.model_dump())


@_router.delete("/v1/weights/groups/{group_name}", responses=_errors(*_MUTATING, 404, 409, *_ENGINES))
async def close_weight_group(group_name: str, d: D) -> dict[str, Any]:
    return await d.sessions.groups.close(group_name)


@_router.post("/v1/weights/sessions/{session_id}/broadcasts", responses=_errors(*_MUTATING, *_SESSION, *_ENGINES))
async def post_broadcast(session_id: str, body: BroadcastRequest, d: D) -> dict[str, Any]:
    """Forwarded to every engine at once; returns when all loaded it. Broadcast while it is in flight."""
    return await d.sessions.broadcast(session_id, body.descriptor())


@_router.post("/v1/update_weights", responses=_errors(*_MUTATING, *_SESSION, *_ENGINES))
async def update_weights(body: UpdateWeightsRequest, d: D) -> dict[str, Any]:
    """One-shot form: open a session, send every chunk, commit (abort on any failure)."""
    return await d.sessions.update(step=body.step, version=body.version,
                                   chunks=[(c.seq, _part(c)) for c in body.chunks])


_AdapterPart = Annotated[str, PathParam(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]


@_router.put("/v1/adapters/{base}/{version}", responses=_errors(*_MUTATING, 409, *_ENGINES),
             openapi_extra={"requestBody": {"required": True, "content": {"application/octet-stream": {
                 "schema": {"type": "string", "format": "binary"}}}}})
async def push_adapter(base: _AdapterPart, version: _AdapterPart, request: Request, d: D) -> dict[str, Any]:
    """A LoRA adapter version (adapter_model.safetensors, the PEFT config in its ``adapter_config`` metadata) under
    the immutable name ``<base>@<version>``: every engine loads it."""
    return await d.adapters.push(base, version, request.stream())


@_router.get("/v1/adapters/{name}", responses=_errors(404, 410))
async def adapter(name: str, d: D) -> dict[str, Any]:
    """Whether the engines serve ``name``: 410 once the daemon retired it (the reply names the current one)."""
    return d.adapters.check(name)


@_router.get("/v1/policies")
async def get_policies(d: D) -> dict[str, Any]:
    """The active policy document (defaults filled in), its version and any staged swap."""
    return d.policy_view()


@_router.put("/v1/policies", responses=_errors(*_MUTATING),
             openapi_extra={"requestBody": {"content": {"application/yaml": {"schema": {"type": "string"}}},
                                            "required": True}})
async def put_policies(request: Request, d: D) -> JSONResponse:
    """Stage a policy YAML for the next transition boundary; an invalid one is a 400 naming field, line, column."""
    text = await request.body()  # bounded by limits.max_body_bytes, then by limits.max_policy_bytes
    return JSONResponse(await d.stage_policies(text, "PUT /v1/policies"))  # a PolicyError: api/errors.py's 400


@_router.get("/v1/steps", responses=_errors(422))
async def steps(d: D, limit: Annotated[int, Query(ge=1, le=64)] = 20) -> dict[str, Any]:
    """The last ``limit`` steps, newest first: phases with durations, the switch breakdown, bytes, result."""
    return {"steps": d.traces.summaries(limit)}


@_router.get("/v1/traces/{step}", responses=_errors(404, 422))
async def trace(step: StepPath, d: D, format: Literal["json", "chrome"] = "json") -> Any:
    """The step's traces; ``format=chrome`` gives trace events for Perfetto / chrome://tracing."""
    traces = d.step_traces(step)
    if format == "chrome":
        return {"traceEvents": [ev for t in traces.values() for ev in t.to_chrome()]}
    return {phase: t.to_json() for phase, t in traces.items()}
