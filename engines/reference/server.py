"""The reference engine's HTTP surface: SGLang 0.5.23's routes (or ≈0.5.4's, ``protocol="legacy"``).

Paths, bodies, status codes and response shapes follow SGLang's ``entrypoints/http_server.py`` (line numbers below
are 0.5.23's). Handlers are thin: parse, call one engine method, shape JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from ..base import PauseMode
from ..sglang.wire import (
    BeginWeightUpdateReqInput,
    CheckWeightsReqInput,
    ContinueGenerationReqInput,
    EndWeightUpdateReqInput,
    PauseGenerationReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from .distributed import DistributedUpdates, distributed_routes
from .engine import EngineRefusal, ReferenceEngine, RunState
from .settings import MODEL_PATH, ReferenceServerSettings
from .wire import GenerateBody, SGLangBody, sglang_body, success

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

_FLUSHED = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


class _Unauthorized(Exception):
    """Missing or wrong bearer token on a protected route."""


def create_app(settings: ReferenceServerSettings, engine: ReferenceEngine | None = None) -> FastAPI:
    """The app for one engine (by default a ``ReferenceEngine`` of ``settings``); the engine starts building its
    model when the app's lifespan starts."""
    engine = engine or ReferenceEngine(settings)
    distributed = DistributedUpdates(engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Built in the background so the socket answers at once: /health says 503 until then, as SGLang's does.
        start = asyncio.create_task(engine.start(), name="colocd-ref-start")
        try:
            yield
        finally:
            start.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await start
            distributed.close()
            await engine.aclose()

    app = FastAPI(lifespan=lifespan, title="colocd reference engine", docs_url=None, redoc_url=None)
    app.state.engine = engine
    _install_error_handlers(app)
    app.include_router(_health_routes(engine, settings))
    auth = [Depends(_auth(settings.api_key))]
    app.include_router(_info_routes(engine, settings), dependencies=auth)
    app.include_router(_control_routes(engine, settings), dependencies=auth)
    app.include_router(distributed_routes(distributed), dependencies=auth)
    return app


def _auth(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    """SGLang's rule (utils/auth.py): with a key set, every route but health/ready needs the bearer."""

    async def check(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = (request.headers.get("authorization") or "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.encode(), api_key.encode()):
            raise _Unauthorized()

    return check


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        # SGLang turns FastAPI's 422 into a 400 ErrorResponse (http_server.py:635).
        message = "; ".join(f"{'.'.join(str(p) for p in e.get('loc', ()))}: {e.get('msg')}" for e in exc.errors())
        return JSONResponse({"object": "error", "message": message, "type": "Bad Request", "param": None,
                             "code": 400}, status_code=400)

    @app.exception_handler(EngineRefusal)
    async def refused(request: Request, exc: EngineRefusal) -> JSONResponse:  # _create_error_response's shape
        return JSONResponse({"error": {"message": exc.message}}, status_code=exc.status)  # http_server.py:2246

    @app.exception_handler(_Unauthorized)
    async def unauthorized(request: Request, exc: _Unauthorized) -> JSONResponse:
        return JSONResponse({"error": "Unauthorized"}, status_code=401)

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return await refused(request, EngineRefusal(500, f"internal server error ({type(exc).__name__})"))


def _health_routes(engine: ReferenceEngine, settings: ReferenceServerSettings) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    @router.get("/health_generate")
    async def health() -> Response:
        """200 once a 1-token generation succeeds; 503 while starting, paused or released (no forward)."""
        return Response(status_code=200 if await engine.health_generate() else 503)

    if settings.protocol != "legacy":

        @router.get("/ready")
        async def ready() -> Response:
            """tokenizer_manager.py:732: ready = not paused and healthy."""
            return Response(status_code=200 if engine.state is RunState.RUNNING and not engine.paused else 503)

    return router


def _info_routes(engine: ReferenceEngine, settings: ReferenceServerSettings) -> APIRouter:
    router = APIRouter()
    legacy = settings.protocol == "legacy"
    path = MODEL_PATH

    async def model_info() -> dict[str, Any]:  # async: answered on the loop, no thread hop
        info = {"model_path": path, "tokenizer_path": path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": engine.weight_version}  # ≈0.5.4 get_model_info
        if legacy:
            return info
        # http_server.py:812; load_format "dummy" is SGLang's name for randomly initialised weights.
        return {**info, "served_model_name": path, "load_format": "dummy", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "qwen_like", "architectures": ["QwenLikeForCausalLM"]}

    async def server_info() -> dict[str, Any]:
        # The SGLang server args colocd reads (wire.ServerInfo) and one internal state per DP rank.
        info: dict[str, Any] = {
            "model_path": path, "device": settings.device, "tp_size": settings.tp_size, "dp_size": 1,
            "enable_memory_saver": True, "enable_weights_cpu_backup": False, "weight_version": "default",
            "internal_states": [engine.internal_state()], "version": settings.version,
            "enable_lora": False, "max_loaded_loras": None,  # SGLang started without --enable-lora
        }
        if not legacy:
            # 0.5.23's startup-phase durations (tokenizer_manager.py:535,862): one measured, other for every process.
            info["startup_time"] = {"load_weight": 0.0, "kv_cache_allocation": 0.0, "scheduler_e2e": 0.0,
                                    "cuda_graph": {}, "tokenizer_e2e": engine.startup_cpu_s}
        return info

    for name, route in (("model_info", model_info), ("server_info", server_info)):
        router.add_api_route(f"/get_{name}", route, methods=["GET"])  # 0.5.23 answers the get_ names too
        if not legacy:
            router.add_api_route(f"/{name}", route, methods=["GET"])
    if legacy:

        @router.get("/get_weight_version")
        async def get_weight_version() -> dict[str, Any]:
            return {"weight_version": engine.weight_version}

    return router


async def _unless_disconnected(request: Request, work: Awaitable[_T]) -> _T | None:
    """Await ``work``; if the client disconnects first, cancel it (aborting its requests) and return None."""

    async def disconnected() -> None:
        # The body is already read, so the next ASGI message is the client going away.
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()
        raise
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _control_routes(engine: ReferenceEngine, settings: ReferenceServerSettings) -> APIRouter:
    router = APIRouter()
    paused = {"message": "Generation paused successfully.", "status": "ok"}
    continued = {"message": "Generation continued successfully.", "status": "ok"}

    @router.api_route("/generate", methods=["POST", "PUT"])
    async def generate(body: GenerateBody, request: Request) -> Response:
        result = await _unless_disconnected(request, engine.generate(body))
        return Response(status_code=499) if result is None else JSONResponse(result)  # 499: nobody listens now

    if settings.protocol == "legacy":

        @router.post("/pause_generation")
        async def pause_legacy() -> JSONResponse:
            await engine.pause_generation(PauseMode.ABORT)  # ≈0.5.4: no body, abort-like
            return JSONResponse(paused)

        @router.post("/continue_generation")
        async def continue_legacy() -> JSONResponse:
            await engine.continue_generation(torch_empty_cache=False)
            return JSONResponse(continued)

    else:

        @router.post("/pause_generation")
        async def pause(body: SGLangBody[PauseGenerationReqInput]) -> JSONResponse:
            await engine.pause_generation(PauseMode(body.mode))  # http_server.py:1831
            return JSONResponse(paused)

        @router.post("/continue_generation")
        async def continue_(body: SGLangBody[ContinueGenerationReqInput]) -> JSONResponse:
            await engine.continue_generation(torch_empty_cache=body.torch_empty_cache)
            return JSONResponse(continued)

        @router.post("/begin_weight_update")
        async def begin(body: SGLangBody[BeginWeightUpdateReqInput]) -> JSONResponse:  # http_server.py:1458
            return success(*await engine.weight_session(body.selector))

        @router.post("/end_weight_update")
        async def end(_: SGLangBody[EndWeightUpdateReqInput]) -> JSONResponse:
            return success(*await engine.weight_session(None))

        @router.api_route("/weights_checker", methods=["GET", "POST"])
        async def weights_checker(
                body: Annotated[CheckWeightsReqInput, sglang_body(CheckWeightsReqInput, optional=True)],
        ) -> JSONResponse:  # http_server.py:1599
            ok, message, extra = await engine.check_weights(body.action, body.skip_tensor_list)
            return success(ok, message, **extra)

    @router.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        ok = await engine.flush_cache()  # http_server.py:1025
        return Response(content=_FLUSHED if ok else "Flush cache failed.\n", status_code=200 if ok else 400,
                        media_type="text/plain")

    @router.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release(body: SGLangBody[ReleaseMemoryOccupationReqInput]) -> JSONResponse:
        await engine.move_memory(body.tags, resume=False)  # http_server.py:1575: JSON null on success
        return JSONResponse(None)

    @router.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume(body: SGLangBody[ResumeMemoryOccupationReqInput]) -> JSONResponse:
        await engine.move_memory(body.tags, resume=True)
        return JSONResponse(None)

    @router.post("/update_weights_from_tensor")
    async def update_weights_from_tensor(body: SGLangBody[UpdateWeightsFromTensorReqInput]) -> JSONResponse:
        return success(*await engine.update_weights_from_tensor(body))  # http_server.py:1436

    @router.post("/update_weight_version")
    async def update_weight_version(body: SGLangBody[UpdateWeightVersionReqInput]) -> JSONResponse:
        await engine.update_weight_version(body.new_version, abort_all_requests=body.abort_all_requests)
        return success(True, f"Weight version updated to {body.new_version}", new_version=body.new_version)

    return router
