"""The HTTP shell: ``create_app(config)`` builds a FastAPI app whose lifespan owns one Daemon."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import Body, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from .. import __version__
from ..daemon.config import NodeConfig
from ..daemon.errors import NotFound, WeightSyncError
from ..daemon.node import Daemon, TransitionResult
from ..daemon.policy_runtime import PolicyRuntime
from ..daemon.states import NodePhase
from ..daemon.weights import SessionState
from ..engines.base import RankPayload
from ..policies import PolicyError
from .errors import install_error_handlers
from .schemas import (
    BroadcastRequest,
    ChunkAckReply,
    ChunkDescriptor,
    CommitRequest,
    OpenSessionReply,
    OpenSessionRequest,
    OpenWeightGroupRequest,
    PhaseRequest,
    SleepRequest,
    TransitionReply,
    UpdateWeightsRequest,
)

__all__ = ["create_app"]


def _reply(result: TransitionResult) -> TransitionReply:
    return TransitionReply(step=result.step, phase=result.phase, replayed=result.replayed,
                           duration_s=result.duration_s, engines=result.engines, freed_bytes=result.freed_bytes,
                           directives=result.directives, trace=result.trace.to_json() if result.trace else None)


def _part(chunk: ChunkDescriptor) -> RankPayload:
    return RankPayload(rank=chunk.rank, transport=chunk.transport, nbytes=chunk.nbytes, handle=chunk.handle)


def _get_daemon(request: Request) -> Daemon:
    return request.state.daemon  # type: ignore[no-any-return]


# Module level: with postponed annotations FastAPI resolves these names in the module's globals.
D = Annotated[Daemon, Depends(_get_daemon)]


def create_app(config: NodeConfig, *, daemon: Daemon | None = None, policies: PolicyRuntime | None = None) -> FastAPI:
    """An app for one node. Pass ``daemon`` to serve an already-built (not yet entered) Daemon."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[dict[str, Any]]:
        async with (daemon or Daemon(config, policies=policies)) as d:
            yield {"daemon": d}

    app = FastAPI(title="colocd", version=__version__, lifespan=lifespan,
                  description="Per-node daemon for colocated RL: phase transitions, memory handoff, weight sync.")
    install_error_handlers(app)

    def authorized(request: Request) -> None:
        if config.token is None:
            return
        supplied = request.headers.get("authorization", "")
        if not hmac.compare_digest(supplied.encode(), f"Bearer {config.token}".encode()):
            from fastapi import HTTPException

            raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    mutating = [Depends(authorized)]

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, str]:
        """Liveness: the daemon's event loop answers."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz(d: D) -> JSONResponse:
        """Readiness: every engine attached and healthy."""
        ok, problems = d.ready()
        return JSONResponse({"ready": ok, "problems": problems}, status_code=200 if ok else 503)

    @app.get("/metrics", tags=["probes"])
    async def metrics(d: D) -> Response:
        return Response(d.metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/status")
    async def status(d: D) -> dict[str, Any]:
        return d.status()

    @app.post("/v1/phase", dependencies=mutating)
    async def phase(body: PhaseRequest, d: D) -> TransitionReply:
        """Move the node to a phase at a step; a repeat of a finished (step, phase) is a no-op replay."""
        return _reply(await d.transition(NodePhase(body.phase), body.step, body.trainer))

    @app.post("/v1/sleep", dependencies=mutating)
    async def sleep(d: D, body: Annotated[SleepRequest | None, Body()] = None) -> TransitionReply:
        body = body or SleepRequest()
        return _reply(await d.sleep(tuple(body.tags) if body.tags else None, body.engines))

    @app.post("/v1/resume", dependencies=mutating)
    async def resume(d: D, body: Annotated[SleepRequest | None, Body()] = None) -> TransitionReply:
        body = body or SleepRequest()
        return _reply(await d.resume(tuple(body.tags) if body.tags else None, body.engines))

    @app.post("/v1/weights/sessions", dependencies=mutating)
    async def open_session(body: OpenSessionRequest, d: D) -> OpenSessionReply:
        s = await d.open_weights(step=body.step, version=body.version, ranks=body.ranks, depth=body.depth)
        return OpenSessionReply(session_id=s.id, ranks=s.ranks, depth=s.depth, step=s.step, version=s.version)

    @app.post("/v1/weights/sessions/{session_id}/chunks", dependencies=mutating)
    async def post_chunk(session_id: str, body: ChunkDescriptor, d: D) -> ChunkAckReply:
        """Returns once every engine consumed the chunk: the rank may then free or refill its buffer."""
        ack = await d.submit_chunk(session_id, body.seq, _part(body))
        return ChunkAckReply(seq=ack.seq, rank=ack.rank, engines=list(ack.engines), load_s=ack.load_s)

    @app.post("/v1/weights/sessions/{session_id}/commit", dependencies=mutating)
    async def commit(session_id: str, d: D, body: Annotated[CommitRequest | None, Body()] = None) -> dict[str, Any]:
        return await d.commit_weights(session_id, (body or CommitRequest()).num_chunks)

    @app.post("/v1/weights/sessions/{session_id}/abort", dependencies=mutating)
    async def abort(session_id: str, d: D) -> dict[str, Any]:
        return await d.abort_weights(session_id)

    @app.get("/v1/weights/sessions/{session_id}")
    async def session_status(session_id: str, d: D) -> dict[str, Any]:
        if d.session is None or d.session.id != session_id:
            raise NotFound(f"no weight session {session_id!r}")
        return d.session.stats()

    @app.get("/v1/weights/groups")
    async def weight_groups(d: D) -> dict[str, Any]:
        """The rank layout a trainer needs before building its side (world size, rank offsets); open groups."""
        return d.weight_group_info()

    @app.post("/v1/weights/groups", dependencies=mutating)
    async def open_weight_group(body: OpenWeightGroupRequest, d: D) -> dict[str, Any]:
        """Every engine joins; returns once all joined, so the trainer must join concurrently (never after)."""
        return await d.open_weight_group(**body.model_dump())

    @app.delete("/v1/weights/groups/{group_name}", dependencies=mutating)
    async def close_weight_group(group_name: str, d: D) -> dict[str, Any]:
        return await d.close_weight_group(group_name)

    @app.post("/v1/weights/sessions/{session_id}/broadcasts", dependencies=mutating)
    async def post_broadcast(session_id: str, body: BroadcastRequest, d: D) -> dict[str, Any]:
        """Forwarded to every engine at once; returns when all loaded it. Broadcast while it is in flight."""
        return await d.broadcast_weights(session_id, body.descriptor())

    @app.post("/v1/update_weights", dependencies=mutating)
    async def update_weights(body: UpdateWeightsRequest, d: D) -> dict[str, Any]:
        """One-shot form: open a session, send every chunk, commit (abort on any failure)."""
        ranks = max(c.rank for c in body.chunks) + 1
        session = await d.open_weights(step=body.step, version=body.version, ranks=ranks)
        try:
            await asyncio.gather(*(d.submit_chunk(session.id, c.seq, _part(c)) for c in body.chunks))
            seqs = {c.seq for c in body.chunks}
            return await d.commit_weights(session.id, len(seqs))
        except BaseException as exc:
            if session.state is SessionState.OPEN:
                await d.abort_weights(session.id, f"one-shot update failed: {exc}")
            if isinstance(exc, WeightSyncError) and session.error:
                raise WeightSyncError(session.error) from exc
            raise

    @app.get("/v1/policies")
    async def get_policies(d: D) -> dict[str, Any]:
        """The active policy document (defaults filled in), its version and any staged swap."""
        active, pending = d.policies.active, d.policies.store.pending
        return {**active.info(), "source": active.source, "document": active.as_document(),
                "pending": pending.info() if pending is not None else None}

    @app.put("/v1/policies", dependencies=mutating,
             openapi_extra={"requestBody": {"content": {"application/yaml": {"schema": {"type": "string"}}},
                                            "required": True}})
    async def put_policies(request: Request, d: D) -> JSONResponse:
        """Stage a policy YAML; it takes effect at the next transition boundary, never mid-transition.
        An invalid document is a 400 naming the field with its line and column; the old policy stays."""
        text = await request.body()
        try:
            staged = d.policies.apply_yaml(text, source="PUT /v1/policies")
        except PolicyError as exc:
            return JSONResponse({"error": "PolicyError", "message": str(exc),
                                 "line": getattr(exc, "line", None), "column": getattr(exc, "column", None)},
                                status_code=400)
        active = d.policies.active
        return JSONResponse({"staged": staged.info(), "active": active.info(),
                             "applies": "now" if staged.fingerprint == active.fingerprint
                             else "at the next transition"})

    @app.get("/v1/steps")
    async def steps(d: D, limit: Annotated[int, Query(ge=1, le=64)] = 20) -> dict[str, Any]:
        """The last ``limit`` steps, newest first: phases with durations, the switch breakdown, bytes, result."""
        return {"steps": d.steps.summaries(limit)}

    @app.get("/v1/traces/{step}")
    async def trace(step: int, d: D, format: str = "json") -> Any:
        """The step's traces; ``format=chrome`` gives trace events for Perfetto / chrome://tracing."""
        traces = d.traces.get(step)
        if traces is None:
            raise NotFound(f"no trace for step {step}; known steps: {d.traces.steps()}")
        if format == "chrome":
            return {"traceEvents": [ev for t in traces.values() for ev in t.to_chrome()]}
        return {phase: t.to_json() for phase, t in traces.items()}

    return app
