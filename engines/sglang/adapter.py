"""Speaks SGLang's HTTP API (0.5.23 and the older session-less protocols), and so the reference engine's too.

Every call maps to one SGLang route; ordering, retries and deadlines belong to the daemon.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel

from ...errors import (
    AdapterUnsupported,
    EngineMismatch,
    EngineProtocolError,
    EngineRejected,
    ReplyInvalid,
    RequestInvalid,
)
from ...policies import Transport
from ..base import (
    ChunkLoad,
    ChunkPart,
    EngineDigests,
    EngineInfo,
    MemoryReport,
    MemoryTag,
    Observation,
    PauseMode,
    ReleaseReport,
)
from ..config import ReferenceEngineConfig, SGLangEngineConfig
from ..handles import PayloadRoute
from ..httpmap import check_reply, map_http_errors
from . import wire
from .protocol import V0_5_23, SGLangProtocol, negotiated, protocol_for_version, untested_warning

__all__ = ["UNSUPPORTED_DIGESTS", "SGLangAdapter"]

_log = logging.getLogger(__name__)

# Why a verified commit cannot check real SGLang, in the words the commit reply carries: /weights_checker hashes
# each parameter fused, TP-sharded and post-processed (srt/utils/weight_checker.py), which the trainer would have
# to rebuild per architecture; docs/behavior.md ("Verified commit") says more.
UNSUPPORTED_DIGESTS = (
    "SGLang reports no per-tensor digests of what it received: /weights_checker checksums its fused, TP-sharded "
    "parameters (qkv_proj, gate_up_proj) with its own hash, which colocd does not rebuild; this engine's weights "
    "are not verified")

_GB = 1 << 30  # SGLang's memory_usage unit

_R = TypeVar("_R", bound=BaseModel)


class SGLangAdapter:
    """Verbs over one SGLang (or reference) server. ``config`` is that engine's slice of the node config."""

    def __init__(self, config: SGLangEngineConfig | ReferenceEngineConfig, client: httpx.AsyncClient) -> None:
        self.name: str = config.name
        self._config = config
        self._client = client
        self._base = str(config.url).rstrip("/")
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        # Until attach probes the version, assume the current protocol.
        self.protocol: SGLangProtocol = V0_5_23
        self._info: EngineInfo | None = None
        self._server_info_route = "/server_info"
        self._device: str | None = None  # where the reference engine says its weights live (server_info)
        self._lora_refusal: str | None = None  # why it loads no adapters (server_info at attach); None: it does

    # -- transport ---------------------------------------------------------------------------
    async def _call(self, method: str, path: str, what: str, json_body: Any = None,
                    *, send_body: bool = True) -> httpx.Response:
        with map_http_errors(self.name, what):
            response = await self._client.request(
                method, self._base + path, headers=self._headers,
                json=json_body if send_body else None,
            )
        return check_reply(self.name, what, response)

    def _json(self, response: httpx.Response, what: str) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise EngineProtocolError(self.name, f"{what}: reply is not JSON: {response.text[:200]!r}") from exc

    async def _get(self, path: str, what: str) -> Any:
        return self._json(await self._call("GET", path, what), what)

    def _check_success(self, response: httpx.Response, what: str) -> None:
        data = self._json(response, what)
        if not isinstance(data, dict) or "success" not in data:
            raise EngineProtocolError(self.name, f"{what}: expected {{success, message}}, got {data!r:.200}")
        if not data["success"]:  # LoRA replies say why in error_message
            why = data.get("message") or data.get("error_message") or "success=false"
            raise EngineRejected(self.name, f"{what}: {why}",
                                 status=response.status_code, body=json.dumps(data)[:2000])

    @property
    def transports(self) -> frozenset[Transport]:
        """What SGLang loads: ``inline`` anywhere and, on a GPU, CUDA-IPC chunks (flattened_bucket or per tensor);
        never shm or disk (its scheduler would die unpickling their JSON). The device is server_info's; before
        attach, the reference engine's config, else a GPU."""
        device = self._device or (self._config.device if isinstance(self._config, ReferenceEngineConfig) else "cuda")
        return _GPU_TRANSPORTS if device.startswith("cuda") else _CPU_TRANSPORTS

    # -- verbs -------------------------------------------------------------------------------
    async def _server_info(self) -> wire.ServerInfo:
        try:
            server = await self._get(self._server_info_route, "server_info")
        except EngineRejected as exc:
            if exc.status != 404 or self._server_info_route != "/server_info":
                raise
            # SGLang ≤ 0.5.5 has only the get_-prefixed names.
            self._server_info_route = "/get_server_info"
            server = await self._get("/get_server_info", "get_server_info")
        return self._parse(wire.ServerInfo, server, "server_info")

    def _parse(self, model: type[_R], data: Any, what: str) -> _R:
        try:
            return wire.parse_reply(model, data)
        except ReplyInvalid as exc:
            raise EngineProtocolError(self.name, f"{what}: {exc}") from None

    async def attach(self) -> EngineInfo:
        server = await self._server_info()
        version = server.version
        try:
            self.protocol = protocol_for_version(version)
        except ValueError as exc:
            raise EngineProtocolError(self.name, f"cannot drive SGLang version {version!r}: {exc}") from exc
        self.protocol = negotiated(self.protocol, await self._published_routes())
        if (warning := untested_warning(version)) is not None:
            _log.warning("engine %r: %s", self.name, warning)
        self._check_tp_size(server)
        owned = tuple(MemoryTag(t) for t in self._config.owned_tags)
        self._device = server.device
        self._lora_refusal = None if server.enable_lora else "SGLang was started without --enable-lora"
        self._info = EngineInfo(
            name=self.name,
            engine_kind=self._config.kind,
            version=version,
            protocol=self.protocol.name,
            weight_version=await self._weight_version(),
            tp_size=self._config.tp_size,
            owned_tags=owned,
            device_ids=self._tp_device_ids(),
            max_adapters=server.max_loaded_loras,
        )
        return self._info

    async def _published_routes(self) -> frozenset[str] | None:
        """The paths of the server's ``/openapi.json``; None where it publishes none."""
        try:
            data = await self._get("/openapi.json", "openapi")
        except EngineRejected as exc:
            if exc.status == 404:
                return None
            raise
        paths = data.get("paths") if isinstance(data, dict) else None
        if not isinstance(paths, dict):
            raise EngineProtocolError(self.name, f"openapi: no 'paths' object in {str(data)[:200]!r}")
        return frozenset(paths)

    def _tp_device_ids(self) -> tuple[str, ...]:
        """Each TP rank's device identity, which SGLang does not report: the config's ``gpu_uuids`` (one per TP
        rank); for a reference engine on CPU (no GPU in its config), its ``device_ids`` (default ``cpu:<rank>``);
        else none are known, and trainer rank t feeds TP rank t."""
        c = self._config
        if len(c.gpu_uuids) == c.tp_size:
            return tuple(c.gpu_uuids)
        if isinstance(c, ReferenceEngineConfig) and c.on_cpu:
            return tuple(c.device_ids or (f"cpu:{r}" for r in range(c.tp_size)))
        return ()

    def _check_tp_size(self, server: wire.ServerInfo) -> None:
        """The engine's TP size (server_info's ``tp_size``, where it says) must be the declared one: every chunk
        carries one payload per declared TP rank."""
        declared = int(self._config.tp_size)
        if server.tp_size is not None and server.tp_size != declared:
            raise EngineMismatch(
                self.name,
                f"the engine reports tp_size {server.tp_size} but the node config declares tp_size {declared}; "
                "not attached (every chunk would carry the wrong number of payloads): fix tp_size in the "
                f"config of engine {self.name!r} or restart the engine with tp_size {declared}",
            )

    async def started(self) -> bool:
        """SGLang's ``/health`` is 503 until its warm-up generation has run, 200 once it serves."""
        try:
            response = await self._client.get(self._base + "/health", headers=self._headers, timeout=30.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def observe(self) -> Observation:
        """The incarnation from server_info's ``startup_time``; the pause gate and an open weight-update session
        where ``internal_states`` reports them (the reference engine; real SGLang does not). No SGLang reports
        which tags are resident. The two questions are asked at once; the first failure is raised."""
        asked = (server_t := asyncio.ensure_future(self._server_info()),
                 version_t := asyncio.ensure_future(self._weight_version()))
        try:
            server, version = await server_t, await version_t
        finally:
            for task in asked:
                task.cancel()
            await asyncio.gather(*asked, return_exceptions=True)  # every outcome retrieved
        first = server.internal_states[0] if server.internal_states else wire.InternalState()
        paused = (first.paused is not None) if "paused" in first.model_fields_set else None
        session = None  # older SGLang has no update session at all, so none can be open or lost
        if self.protocol.weight_update_session and "weight_update_session" in first.model_fields_set:
            session = first.weight_update_session is not None
        return Observation(incarnation=server.incarnation(), weight_version=version, paused=paused,
                           update_session_open=session)

    async def _weight_version(self) -> str | None:
        route = self.protocol.weight_version_route
        what = route.lstrip("/")
        data = await self._get(route, what)
        if not isinstance(data, dict):  # the oldest servers answer the bare version
            return None if data is None else str(data)
        return self._parse(wire.ModelInfo, data, what).weight_version

    async def pause_generation(self, mode: PauseMode) -> None:
        try:
            request = wire.pause_generation_request(self.protocol, mode)
        except ValueError as exc:
            raise EngineProtocolError(self.name, str(exc)) from exc
        await self._call("POST", "/pause_generation", "pause_generation", request, send_body=request is not None)

    async def continue_generation(self) -> None:
        request = wire.continue_generation_request(self.protocol)
        await self._call("POST", "/continue_generation", "continue_generation", request, send_body=request is not None)

    async def flush_cache(self) -> bool:
        """True if flushed; False on SGLang's normal 400 "not idle yet" (the daemon retries)."""
        try:
            await self._call("POST", "/flush_cache", "flush_cache", send_body=False)
        except EngineRejected as exc:
            if exc.status == 400:
                return False
            raise
        return True

    async def release_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        request = wire.ReleaseMemoryOccupationReqInput(tags=[t.value for t in tags])
        await self._call("POST", request.ROUTE, "release_memory_occupation", wire.body(request, self.protocol))
        return ReleaseReport(tags)

    async def resume_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        request = wire.ResumeMemoryOccupationReqInput(tags=[t.value for t in tags])
        await self._call("POST", request.ROUTE, "resume_memory_occupation", wire.body(request, self.protocol))
        return ReleaseReport(tags)

    async def begin_weight_update(self) -> None:
        if not self.protocol.weight_update_session:
            return
        await self._control(wire.BeginWeightUpdateReqInput(selector="all"), "begin_weight_update")

    async def load_weights(self, load: ChunkLoad) -> None:
        request = wire.UpdateWeightsFromTensorReqInput(
            serialized_named_tensors=[_entry(p) for p in load.payloads],
            load_format=_load_format(load),
            flush_cache=load.flush_cache,
            abort_all_requests=False,
            weight_version=load.weight_version,
        )
        await self._control(request, f"update_weights_from_tensor#{load.seq}")

    async def end_weight_update(self, version: str | None = None) -> None:
        """SGLang's end takes no version: ``update_weight_version`` follows it."""
        if self.protocol.weight_update_session:
            await self._control(wire.EndWeightUpdateReqInput(), "end_weight_update")
        if version is not None:  # SGLang's default would abort every running request
            await self._control(wire.UpdateWeightVersionReqInput(new_version=version, abort_all_requests=False),
                                "update_weight_version")

    # -- separated GPUs (research §1.6): each call blocks on a collective the trainer runs meanwhile --
    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:
        """Join the trainer's weight-update group; SGLang answers only once every rank joined."""
        request = wire.InitWeightsUpdateGroupReqInput(
            master_address=master_address, master_port=master_port, rank_offset=rank_offset,
            world_size=world_size, group_name=group_name, backend=backend)
        await self._control(request, "init_weights_update_group")

    async def update_weights_from_distributed(self, *, seq: int, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str, load_format: str | None,
                                              flush_cache: bool = False, weight_version: str | None = None) -> None:
        """Receive one broadcast (per tensor, or one ``flattened_bucket``) from rank 0 and load it."""
        request = wire.UpdateWeightsFromDistributedReqInput(
            names=names, dtypes=dtypes, shapes=shapes, group_name=group_name, flush_cache=flush_cache,
            abort_all_requests=False, weight_version=weight_version, load_format=load_format)
        await self._control(request, f"update_weights_from_distributed#{seq}")

    async def destroy_weights_update_group(self, group_name: str) -> None:
        await self._control(wire.DestroyWeightsUpdateGroupReqInput(group_name=group_name),
                            "destroy_weights_update_group")

    async def _control(self, request: wire.SGLangRequest, what: str) -> None:
        """POST ``request`` and check its ``{success, message}`` reply."""
        try:
            body = wire.body(request, self.protocol)
        except ValueError as exc:  # a field this SGLang lacks, e.g. load_format before 0.5.5
            raise EngineProtocolError(self.name, f"{what}: {exc}") from exc
        self._check_success(await self._call("POST", request.ROUTE, what, body), what)

    async def weight_digests(self, names: Sequence[str]) -> EngineDigests:
        """SGLang reports no digests that can be compared with the trainer's: ``UNSUPPORTED_DIGESTS`` says why."""
        return EngineDigests(None, UNSUPPORTED_DIGESTS)

    async def memory_report(self) -> MemoryReport | None:
        """What each tag took when allocated (server_info's ``memory_usage`` of rank 0, times the TP size); None
        where the server reports none."""
        states = (await self._server_info()).internal_states
        usage = states[0].memory_usage if states else None
        if usage is None:
            return None
        tp = int(self._config.tp_size)
        gb = {MemoryTag.WEIGHTS: usage.weight, MemoryTag.KV_CACHE: usage.kvcache,
              MemoryTag.CUDA_GRAPH: sum(usage.graph.values())}
        # Measured as free memory before minus after allocating: on CPU other processes can make it negative.
        return MemoryReport({t: round(v * _GB) * tp for t, v in gb.items() if v > 0})

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """From a folder. Once unloaded, a request naming the adapter re-loads it from that path
        (tokenizer_manager.py:3759-3788), so the daemon deletes the folder at unload."""
        if self._lora_refusal is not None:
            raise AdapterUnsupported(self.name, self._lora_refusal)
        response = await self._call("POST", "/load_lora_adapter", "load_lora_adapter",
                                    {"lora_name": name, "lora_path": path})
        self._check_success(response, "load_lora_adapter")

    async def unload_lora_adapter(self, name: str) -> None:
        """Waits for the adapter's requests in flight, then frees it on the workers (tokenizer_control_mixin.py:634)."""
        try:
            response = await self._call("POST", "/unload_lora_adapter", "unload_lora_adapter", {"lora_name": name})
        except EngineRejected as exc:
            if "does not exist" in exc.body:  # "LoRA with name X does not exist": already unloaded
                return
            raise
        self._check_success(response, "unload_lora_adapter")

    async def aclose(self) -> None:
        return None


_CPU_TRANSPORTS = frozenset({Transport.INLINE})
_GPU_TRANSPORTS = frozenset({Transport.INLINE, Transport.CUDA_IPC, Transport.PER_TENSOR})


def _load_format(load: ChunkLoad) -> str | None:
    """The form of the trainers' payloads: what their handles say, else SGLang's flattened_bucket."""
    formats = {(p.route.load_format if isinstance(p.route, PayloadRoute) else None) or "flattened_bucket"
               for p in load.payloads}
    if len(formats) != 1:
        raise RequestInvalid(f"chunk {load.seq}: ranks used different load formats {sorted(formats)}; one chunk "
                             "travels in one format", field="handle.load_format")
    load_format = formats.pop()
    return None if load_format == "direct" else load_format  # SGLang's default: a list of (name, tensor)


def _entry(part: ChunkPart) -> str:
    """One ``serialized_named_tensors`` entry: the trainer's own base64 pickle (CUDA-IPC and inline chunks)."""
    payload = part.route.payload_b64 if isinstance(part.route, PayloadRoute) else None
    if payload is None:
        raise RequestInvalid(f"{part.transport} chunk handle carries no 'payload_b64' string",
                             field="handle.payload_b64")
    return payload
