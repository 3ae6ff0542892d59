"""Speaks SGLang's HTTP API (0.5.23 and the older session-less protocol); knows nothing of phases.

The embedded reference engine speaks the same protocol, so this adapter drives it too.
Every call maps to one SGLang route; ordering, retries and deadlines belong to the daemon.
"""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import httpx

from ..base import EngineInfo, MemoryTag, PauseMode, ReleaseReport, WeightsLoad
from ..errors import EngineProtocolError, EngineRejected
from ..httpmap import check_reply, map_http_errors

__all__ = ["SGLangAdapter"]

# SGLang 0.5.23 added the begin/end weight-update session (sgl-project/sglang#28001) and JSON
# bodies on pause/continue; earlier servers (what slime and verl pin) have neither.
_SESSION_MIN_VERSION = (0, 5, 13)


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    return tuple(int(g or 0) for g in match.groups()) if match else (0,)


class SGLangAdapter:
    """Verbs over one SGLang (or reference) server. ``config`` is that engine's slice of the node config."""

    def __init__(self, config: Any, client: httpx.AsyncClient) -> None:
        self.name: str = config.name
        self._config = config
        self._client = client
        self._base = str(config.url).rstrip("/")
        self._headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self._session_protocol = True
        self._info: EngineInfo | None = None

    # -- transport ---------------------------------------------------------------------------
    async def _call(self, method: str, path: str, what: str, json_body: Any = None,
                    *, send_body: bool = True, params: dict[str, Any] | None = None) -> httpx.Response:
        with map_http_errors(self.name, what):
            response = await self._client.request(
                method, self._base + path, headers=self._headers, params=params,
                json=json_body if send_body else None,
            )
        return check_reply(self.name, what, response)

    @staticmethod
    def _json(response: httpx.Response, engine: str, what: str) -> Any:
        try:
            return response.json()
        except ValueError as exc:
            raise EngineProtocolError(engine, f"{what}: reply is not JSON: {response.text[:200]!r}") from exc

    def _check_success(self, response: httpx.Response, what: str) -> dict[str, Any]:
        data = self._json(response, self.name, what)
        if not isinstance(data, dict) or "success" not in data:
            raise EngineProtocolError(self.name, f"{what}: expected {{success, message}}, got {data!r:.200}")
        if not data["success"]:
            raise EngineRejected(self.name, f"{what}: {data.get('message') or 'success=false'}",
                                 status=response.status_code, body=json.dumps(data)[:2000])
        return data

    # -- verbs -------------------------------------------------------------------------------
    async def attach(self) -> EngineInfo:
        try:
            server = self._json(await self._call("GET", "/server_info", "server_info"), self.name, "server_info")
        except EngineRejected as exc:
            if exc.status != 404:
                raise
            server = self._json(await self._call("GET", "/get_server_info", "get_server_info"),
                                self.name, "get_server_info")
        version = str(server.get("version", "0"))
        self._session_protocol = _version_tuple(version) >= _SESSION_MIN_VERSION
        owned = tuple(MemoryTag(t) for t in self._config.owned_tags)
        self._info = EngineInfo(
            name=self.name,
            engine_kind=getattr(self._config, "kind", "sglang"),
            version=version,
            protocol="0.5.23" if self._session_protocol else "legacy",
            weight_version=await self.weight_version(),
            tp_size=self._config.tp_size,
            owned_tags=owned,
            extra={"colocd_reference": bool(server.get("colocd_reference", False))},
        )
        return self._info

    async def health(self) -> bool:
        # /health runs a 1-token generation in SGLang; while paused or released that would block
        # or touch unmapped memory, so liveness uses /model_info (tokenizer-side, no forward pass).
        await self._call("GET", "/model_info" if self._session_protocol else "/get_model_info", "model_info")
        return True

    async def weight_version(self) -> str | None:
        if self._session_protocol:
            data = self._json(await self._call("GET", "/model_info", "model_info"), self.name, "model_info")
        else:
            data = self._json(await self._call("GET", "/get_weight_version", "get_weight_version"),
                              self.name, "get_weight_version")
        version = data.get("weight_version") if isinstance(data, dict) else data
        return None if version is None else str(version)

    async def pause_generation(self, mode: PauseMode) -> None:
        if self._session_protocol:
            await self._call("POST", "/pause_generation", "pause_generation", {"mode": mode.value})
        else:
            await self._call("POST", "/pause_generation", "pause_generation", send_body=False)

    async def continue_generation(self) -> None:
        if self._session_protocol:
            await self._call("POST", "/continue_generation", "continue_generation", {"torch_empty_cache": True})
        else:
            await self._call("POST", "/continue_generation", "continue_generation", send_body=False)

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
        await self._call("POST", "/release_memory_occupation", "release_memory_occupation",
                         {"tags": [t.value for t in tags]})
        return ReleaseReport(tags)

    async def resume_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport:
        await self._call("POST", "/resume_memory_occupation", "resume_memory_occupation",
                         {"tags": [t.value for t in tags]})
        return ReleaseReport(tags)

    async def begin_weight_update(self) -> None:
        if self._session_protocol:
            self._check_success(
                await self._call("POST", "/begin_weight_update", "begin_weight_update", {"selector": "all"}),
                "begin_weight_update")

    async def load_weights(self, load: WeightsLoad) -> None:
        body = {
            "serialized_named_tensors": [_entry(p.transport, p.handle) for p in load.payloads],
            "load_format": _load_format(load),
            "flush_cache": load.flush_cache,
            "abort_all_requests": False,
            "weight_version": load.weight_version,
        }
        response = await self._call("POST", "/update_weights_from_tensor", f"update_weights_from_tensor#{load.seq}",
                                    body)
        self._check_success(response, f"update_weights_from_tensor#{load.seq}")

    async def end_weight_update(self) -> None:
        if self._session_protocol:
            self._check_success(await self._call("POST", "/end_weight_update", "end_weight_update", {}),
                                "end_weight_update")

    async def set_weight_version(self, version: str) -> None:
        # abort_all_requests defaults to true in SGLang; the engine is paused here anyway and we
        # never want a version bump to kill requests on its own.
        self._check_success(
            await self._call("POST", "/update_weight_version", "update_weight_version",
                             {"new_version": version, "abort_all_requests": False}),
            "update_weight_version")

    async def weights_checksum(self) -> str | None:
        data = self._json(await self._call("POST", "/weights_checker", "weights_checker", {"action": "checksum"}),
                          self.name, "weights_checker")
        if not isinstance(data, dict):
            return None
        checksum = data.get("colocd_checksum") or data.get("per_engine_checksum")
        if isinstance(checksum, list):
            checksum = checksum[0] if checksum else None
        return None if checksum is None else str(checksum)

    async def memory_report(self) -> dict[str, Any] | None:
        """The reference engine's own per-tag byte counts (colocd extension); None elsewhere."""
        if self._info is None or not self._info.extra.get("colocd_reference"):
            return None
        data = self._json(await self._call("GET", "/colocd/memory", "colocd/memory"), self.name, "colocd/memory")
        return data if isinstance(data, dict) else None

    async def aclose(self) -> None:
        return None


def _load_format(load: WeightsLoad) -> str | None:
    transports = {p.transport for p in load.payloads}
    if len(transports) != 1:
        raise ValueError(f"chunk {load.seq}: ranks used different transports {sorted(transports)}")
    transport = transports.pop()
    return {"shm": "colocd_shm", "disk": "colocd_disk"}.get(transport, "flattened_bucket")


def _entry(transport: str, handle: dict[str, Any]) -> str:
    """One ``serialized_named_tensors`` entry: the trainer's own base64 pickle for CUDA paths,
    or base64 JSON for colocd's shm/disk paths (which SGLang would reach through a custom loader)."""
    if transport in ("shm", "disk"):
        return base64.b64encode(json.dumps({"transport": transport, **handle}).encode()).decode()
    payload = handle.get("payload_b64")
    if not isinstance(payload, str):
        raise ValueError(f"{transport} chunk handle carries no 'payload_b64' string")
    return payload
