"""Speaks vLLM's dev-mode HTTP API (0.29 .. 0.32 tested) as colocd's engine verbs.

vLLM owns little state a daemon can trust (/is_sleeping is also true while merely paused, waking an awake tag is
a silent no-op, sleep pauses and the last wake resumes by itself), so this adapter reports what vLLM did and the
daemon keeps tag and pause state. Verb → route:

    attach               GET /version, /openapi.json, /weight_info, /get_world_size, RPC colocd_info
    pause_generation     POST /pause?mode=abort|wait|keep          (wire.PAUSE_MODES)
    continue_generation  POST /resume
    flush_cache          POST /reset_prefix_cache
    release_memory       POST /sleep?level=L&mode=M, or /release_kv_cache_memory for kv_cache alone
    resume_memory        POST /wake_up?tags=weights&tags=kv_cache
    begin_weight_update  /collective_rpc colocd_begin_update (the worker extension, extension.py)
    load_weights         /collective_rpc colocd_load_chunk
    end_weight_update    /collective_rpc colocd_finish_update, then POST /update_weight_version
    weight_digests       /collective_rpc colocd_received_digests (engines/digest.py, per tensor as it arrived)
    load_lora_adapter    POST /v1/load_lora_adapter {"lora_name", "lora_path"} (with VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    unload_lora_adapter  POST /v1/unload_lora_adapter {"lora_name"}
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TypeVar

import httpx
from pydantic import BaseModel, JsonValue, ValidationError

from ...errors import AdapterUnsupported, EngineProtocolError, EngineRejected, EngineUnreachable
from ...policies import Transport
from ..base import (
    ChunkLoad,
    EngineDigests,
    EngineInfo,
    MemoryReport,
    MemoryTag,
    Observation,
    PauseMode,
    ReleaseReport,
)
from ..config import VLLMEngineConfig
from ..httpmap import check_reply, map_http_errors
from ..processes import flag_values
from . import EXTENSION_CLS, wire
from .protocol import OPTIONAL_ROUTES, REQUIRED_ROUTES, VLLMRoutes, lacking, untested_warning

__all__ = ["VLLMAdapter"]

_log = logging.getLogger(__name__)
_M = TypeVar("_M", bound=BaseModel)

# vLLM publishes its adapter routes only with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (serve/lora/api_router.py:30-32).
_LORA_LOAD, _LORA_UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"
_NO_EXTENSION = f"colocd's worker extension: launch it with --worker-extension-cls {EXTENSION_CLS}"


def max_adapters(args: Sequence[str]) -> int | None:
    """What an argv lets the worker hold: --max-cpu-loras, which defaults to --max-loras, which defaults to 1
    (config/lora.py:26-44); None without --enable-lora."""
    given = flag_values("vllm", args, {})
    if "--enable-lora" not in given:
        return None
    return int(given.get("--max-cpu-loras") or given.get("--max-loras") or 1)


class VLLMAdapter:
    """One vLLM server in dev mode (``VLLM_SERVER_DEV_MODE=1``); the client (no timeouts) is the caller's."""

    def __init__(self, config: VLLMEngineConfig, client: httpx.AsyncClient) -> None:
        if config.url is None:
            raise EngineUnreachable(config.name, "VLLMAdapter needs 'url' (launch_vllm starts a server there)")
        self.name = config.name
        self._config = config
        self._client = client
        self._base = config.url.rstrip("/")
        # One connection per call: uvicorn answers a worker exception's 500 without "Connection: close" and drops
        # the socket, so the next request on that pooled connection would fail with ReadError.
        self._headers = {"Connection": "close"}
        if config.api_key:
            self._headers["Authorization"] = f"Bearer {config.api_key}"
        self._extension: wire.ExtensionInfo | None = None  # rank 0's colocd_info at attach; None: no extension
        # The mode of the pause this adapter issued last (``_sleep_mode``).
        self._pause_mode: str | None = None
        self._version = "unknown"
        self._routes = VLLMRoutes(None)
        self._pending_version: str | None = None  # the version the update's chunks carry
        self._flush_after_update = False

    # -- plumbing ---------------------------------------------------------------------------

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | tuple[tuple[str, str], ...] | None = None,  # (key, value) pairs: repeats
        json: JsonValue = None,
    ) -> httpx.Response:
        what = f"{method} {path}"
        with map_http_errors(self.name, what):
            response = await self._client.request(
                method, self._base + path, params=params, json=json, headers=self._headers
            )
        if response.status_code == 404 and (path in OPTIONAL_ROUTES or path in REQUIRED_ROUTES):
            # A route this server lacks (a release without it, or dev mode off): say which, not a bare 404.
            raise EngineProtocolError(self.name, lacking(path, self._version))
        return check_reply(self.name, what, response)

    def _parse(self, model: type[_M], response: httpx.Response, path: str) -> _M:
        try:
            return model.model_validate_json(response.content)
        except ValidationError as exc:
            raise EngineProtocolError(
                self.name,
                f"{path} answered {response.text[:300]!r}, not {model.__name__}: {exc.errors()[:2]}",
            ) from exc

    async def _rpc(self, method: str, *args: JsonValue) -> list[JsonValue]:
        """Call ``method`` on every worker (any JSON reaches it as-is, rpc/api_router.py:23); one result per worker."""
        response = await self._call("POST", "/collective_rpc", json={"method": method, "args": list(args)})
        if not response.content:
            return []  # every worker returned None (rpc/api_router.py:51-52)
        return self._parse(wire.CollectiveRpcReply, response, "/collective_rpc").results

    async def _rpc_each(self, model: type[_M], method: str, *args: JsonValue) -> list[_M]:
        """``_rpc``, each result parsed as ``model`` (a misfit is an EngineProtocolError naming worker and field)."""
        parsed: list[_M] = []
        for worker, result in enumerate(await self._rpc(method, *args)):
            try:
                parsed.append(model.model_validate(result))
            except ValidationError as exc:
                first = exc.errors()[0]
                field = ".".join(str(p) for p in first["loc"]) or "(the reply)"
                raise EngineProtocolError(
                    self.name,
                    f"/collective_rpc {method} (worker {worker}): {model.__name__}.{field}: {first['msg']} "
                    f"(got {result!r:.200})",
                ) from None
        return parsed

    async def _colocd_info(self) -> wire.ExtensionInfo:
        """The extension's ``colocd_info`` from TP rank 0, every worker's reply checked."""
        infos = await self._rpc_each(wire.ExtensionInfo, "colocd_info")
        if not infos:
            raise EngineProtocolError(self.name, "/collective_rpc colocd_info: no worker answered")
        return infos[0]

    @property
    def transports(self) -> frozenset[Transport]:
        """What the colocd worker extension reads (``extension.py``): shm and disk, and cuda_ipc on a GPU."""
        device = self._extension.device if self._extension is not None else "cuda"  # the extension says after attach
        cuda = {Transport.CUDA_IPC} if device.startswith("cuda") else set()
        return frozenset({Transport.SHM, Transport.DISK, *cuda})

    # -- attach and queries -----------------------------------------------------------------

    async def attach(self) -> EngineInfo:
        """Probe the version and the dev routes; read weight version, TP size and the extension."""
        self._pause_mode = None
        version = self._parse(wire.VersionReply, await self._call("GET", "/version"), "/version").version
        self._version = version
        if (warning := untested_warning(version)) is not None:
            _log.warning("engine %r: %s", self.name, warning)
        self._routes = await self._read_routes()
        missing = self._routes.missing_required()
        if missing:
            raise EngineProtocolError(self.name, f"{lacking(missing[0], version)} (lacking: {', '.join(missing)})")
        if self._routes.known is None:
            await self._call("GET", "/is_paused")  # no route table: probe dev mode (a 404 says what is missing)
        world = self._parse(
            wire.WorldSizeReply,
            await self._call("GET", "/get_world_size", params={"include_dp": "false"}),
            "/get_world_size",
        ).world_size
        if world != self._config.tp_size:
            raise EngineProtocolError(
                self.name,
                f"vLLM runs {world} workers (TP*PP) but the config says tp_size={self._config.tp_size}",
            )
        extension_error = None
        try:
            self._extension = await self._colocd_info()
        except EngineRejected as exc:  # 500 "'CPUWorker' object has no attribute 'colocd_info'"
            self._extension, extension_error = None, exc.detail
        owned = tuple(t for t in self._config.owned_tags if t in wire.SLEEP_TAGS)
        return EngineInfo(
            name=self.name,
            engine_kind="vllm",
            version=version,
            protocol="vllm-dev",
            weight_version=await self._weight_version(),
            tp_size=world,
            owned_tags=owned,
            max_adapters=max_adapters(self._config.launch.args) if self._config.launch else None,
            extra={
                "extension": None if self._extension is None else self._extension.model_dump(),
                "extension_error": extension_error,
                "routes_lacking": sorted(r for r in OPTIONAL_ROUTES if not self._routes.has(r)),
                "sleep_level": self._config.sleep_level,
                # What the daemon's state machine must know about vLLM (core.py:959-1018):
                "sleep_pauses_generation": True,
                "full_wake_resumes_generation": True,
            },
        )

    async def _read_routes(self) -> VLLMRoutes:
        """The routes of the server's OpenAPI document; unknown (every route assumed) when it publishes none."""
        try:
            response = await self._call("GET", "/openapi.json")
        except EngineRejected as exc:
            if exc.status == 404:
                return VLLMRoutes(None)
            raise
        return VLLMRoutes(frozenset(self._parse(wire.OpenApiReply, response, "/openapi.json").paths))

    async def started(self) -> bool:
        """vLLM answers HTTP only once its engine core is up: a server that answers has started."""
        return True

    async def observe(self) -> Observation:
        """The extension's boot id is the incarnation (vLLM's HTTP API has none). ``/is_sleeping`` false means
        every sleep tag is resident; true means paused or asleep, which HTTP cannot tell apart."""
        incarnation: str | None = None
        session: bool | None = None
        if self._extension is not None:
            info = await self._colocd_info()
            incarnation, session = info.boot_id, info.update_active
        sleeping = await self._is_sleeping()
        resident = None if sleeping else {t: True for t in self._config.owned_tags if t in wire.SLEEP_TAGS}
        return Observation(incarnation=incarnation,
                           weight_version=await self._weight_version(), resident=resident or None,
                           paused=sleeping, update_session_open=session)

    async def _weight_version(self) -> str | None:
        response = await self._call("GET", "/weight_info")
        return self._parse(wire.WeightInfoReply, response, "/weight_info").weight_version

    async def _is_sleeping(self) -> bool:
        """vLLM's own flag: true while any tag is asleep *or* the scheduler is merely paused."""
        return self._parse(
            wire.IsSleepingReply, await self._call("GET", "/is_sleeping"), "/is_sleeping"
        ).is_sleeping

    # -- generation -------------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode) -> None:
        """POST /pause?mode=…; abort→abort, retract→wait (drain), in_place→keep (see wire.PAUSE_MODES)."""
        vllm_mode = wire.PAUSE_MODES[PauseMode(mode)]
        await self._call("POST", "/pause", params={"mode": vllm_mode})
        self._pause_mode = vllm_mode

    async def continue_generation(self) -> None:
        await self._call("POST", "/resume")
        self._pause_mode = None

    async def flush_cache(self) -> bool:
        """POST /reset_prefix_cache; False while running requests hold blocks (retryable)."""
        response = await self._call("POST", "/reset_prefix_cache")
        return self._parse(wire.ResetPrefixCacheReply, response, "/reset_prefix_cache").success

    # -- memory -----------------------------------------------------------------------------

    async def release_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        """Sleep, reporting the tags vLLM released (weights and KV together; level 0 releases none). kv_cache alone
        uses /release_kv_cache_memory, which needs a completed pause (core.py:1021-1039). On CPU vLLM ignores
        sleep (cpu_worker.py:179-185): the report is what vLLM *says*; only NVML confirms memory."""
        wanted = wire.vllm_tags(tags)
        if not wanted:
            return ReleaseReport(tags=())
        if wanted == ["kv_cache"]:
            if not self._routes.has("/release_kv_cache_memory"):
                raise EngineProtocolError(self.name, f"{lacking('/release_kv_cache_memory', self._version)}; release "
                                                     "weights and kv_cache together (/sleep)")
            await self._call("POST", "/release_kv_cache_memory")
            return ReleaseReport(tags=(MemoryTag.KV_CACHE,))
        level = self._config.sleep_level
        params = {"level": str(level), "mode": self._sleep_mode()}
        response = await self._call("POST", "/sleep", params=params)
        if response.content:  # vLLM 0.29 answers an empty 200 (wire.SleepReply)
            self._parse(wire.SleepReply, response, "/sleep")
        if level == 0:
            return ReleaseReport(tags=())
        return ReleaseReport(tags=(MemoryTag.WEIGHTS, MemoryTag.KV_CACHE))

    def _sleep_mode(self) -> str:
        """The mode of a sleep's own pause (core.py:959-975): ``keep`` after a pause that froze requests in place,
        else ``wait``. A sleep never aborts: a pause that had to already did, and requests queued since wait at
        the gate until the engine serves again."""
        return "keep" if self._pause_mode == "keep" else "wait"

    async def resume_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        """POST /wake_up with exactly the tags asked for (one awake tag makes vLLM skip the whole call,
        executor/abstract.py:394-404). When the last tag wakes vLLM resumes generation itself."""
        wanted = wire.vllm_tags(tags)
        if not wanted or self._config.sleep_level == 0:
            return ReleaseReport(tags=())
        response = await self._call("POST", "/wake_up", params=wire.wake_query(wanted))
        if response.content:
            awake = self._parse(wire.WakeUpReply, response, "/wake_up").status == "awake"
        else:  # vLLM 0.29's empty 200 (wire.WakeUpReply): a full wake resumed the scheduler, so nothing sleeps
            awake = not await self._is_sleeping()
        if awake:
            self._pause_mode = None  # the full wake resumed the scheduler (core.py:1013-1018)
        return ReleaseReport(tags=tuple(t for t in wire.SLEEP_TAGS if wire.SLEEP_TAGS[t] in wanted))

    # -- weights ----------------------------------------------------------------------------

    async def begin_weight_update(self) -> None:
        """Open an update in every worker's extension."""
        if self._extension is None:
            raise EngineProtocolError(self.name, f"vLLM loads colocd's chunks only through {_NO_EXTENSION}")
        self._pending_version, self._flush_after_update = None, False
        await self._rpc("colocd_begin_update")

    async def load_weights(self, load: ChunkLoad) -> None:
        """Send one chunk; every worker replies once its copy is done."""
        await self._rpc("colocd_load_chunk", wire.update_info(load.seq, load.payloads))
        if load.weight_version is not None:
            self._pending_version = load.weight_version
        self._flush_after_update |= load.flush_cache

    async def end_weight_update(self, version: str | None = None) -> None:
        """Close the update, then set ``version`` (else the one the chunks carried) and flush if a chunk asked."""
        version, self._pending_version = version if version is not None else self._pending_version, None
        await self._rpc("colocd_finish_update")
        if version is not None:
            await self._call("POST", "/update_weight_version", json={"new_version": version})
        if self._flush_after_update:
            self._flush_after_update = False
            await self.flush_cache()

    async def weight_digests(self, names: Sequence[str]) -> EngineDigests:
        """The digests (engines/digest.py) the extension computed over each tensor as it loaded it, per TP worker."""
        if self._extension is None:
            return EngineDigests(None, f"vLLM reports weight digests only through {_NO_EXTENSION}")
        ranks = await self._rpc_each(wire.ReceivedDigests, "colocd_received_digests", list(names))
        return EngineDigests(tuple(dict(r.root) for r in ranks))

    async def memory_report(self) -> MemoryReport | None:
        """vLLM reports no per-tag accounting."""
        return None

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """From a folder (lora/worker_manager.py:106-174); a name it holds is a 400, so every version has its own."""
        if not self._routes.has(_LORA_LOAD):
            raise AdapterUnsupported(self.name, f"vLLM {self._version} publishes no {_LORA_LOAD}: start it with "
                                     "--enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1")
        await self._call("POST", _LORA_LOAD, json={"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, name: str) -> None:
        """vLLM forgets the name only (serving.py:231-245): the worker's LRU keeps its copy until evicted."""
        try:
            await self._call("POST", _LORA_UNLOAD, json={"lora_name": name})
        except EngineRejected as exc:
            if exc.status != 404:  # "The lora adapter 'X' cannot be found.": already unloaded
                raise

    async def aclose(self) -> None:
        """Nothing to release: the HTTP client belongs to the caller."""
