"""The daemon's HTTP client: one call per route, async (``AsyncColocdClient``) and sync (``ColocdClient``); no torch.
Streaming weights is the trainer library's job (``colocd.trainer.WeightPusher``, ``colocd.trainer.TrainerClient``)."""

from __future__ import annotations

import asyncio
import json as jsonlib
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Coroutine
from typing import Any, Concatenate, ParamSpec, Protocol, Self, TypeVar

import aiohttp

from ..errors import ColocdHTTPError, DaemonUnreachable
from ..policies import Transport
from ..recent import remember

__all__ = ["AsyncColocdClient", "ColocdClient", "ColocdHTTPError", "DaemonUnreachable", "SendablePart"]

log = logging.getLogger("colocd.client")

_T = TypeVar("_T")
_P = ParamSpec("_P")

# A manifest's content as the client compares it: (name, dtype, shape) per tensor, in order.
_ManifestKey = tuple[tuple[str, str, tuple[int, ...]], ...]
_SESSIONS = "/v1/weights/sessions"
_MANIFEST_REFS_KEPT = 8  # as many as the daemon keeps (daemon/manifests.py)


class SendablePart(Protocol):
    """One rank's part of a chunk as the daemon reads it (``api.schemas.ChunkDescriptor``)."""

    @property
    def transport(self) -> Transport: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def handle(self) -> dict[str, Any]: ...
    @property
    def digests(self) -> dict[str, str] | None: ...


CONNECT_S = 5.0


class AsyncColocdClient:
    """One method per route; ``url``: ``http://host:port`` or ``unix:/path/to.sock``. A refusal raises
    ``ColocdHTTPError``, no answer ``DaemonUnreachable``. aiohttp: the cluster fan-out costs its one event loop a
    fraction of httpx's CPU per request (docs/deploy.md)."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self._unix = url.removeprefix("unix:") if url.startswith("unix:") else None
        self._base = "http://colocd" if self._unix is not None else url.rstrip("/")
        self.token = token
        self._headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=CONNECT_S)
        # Made on the first call: an aiohttp session belongs to the event loop it is made on.
        self._http: aiohttp.ClientSession | None = None
        # The daemon's manifest_ref for each manifest this client sent in full lately, so the next open of the same
        # manifest sends the reference instead (the daemon forgets them on restart: then the manifest again).
        self._manifest_refs: OrderedDict[_ManifestKey, str] = OrderedDict()
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task[None]] = set()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            # limit=0: as many connections as calls in flight (a rank keeps ``depth`` chunks in flight). Idle ones
            # are kept aiohttp's 15 s, well under the daemon's 75 s (api/server.py KEEP_ALIVE_S).
            connector = (aiohttp.UnixConnector(path=self._unix, limit=0) if self._unix is not None
                         else aiohttp.TCPConnector(limit=0))
            self._http = aiohttp.ClientSession(self._base, connector=connector, headers=self._headers,
                                               timeout=self._timeout)
        return self._http

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connections, once every call started ``in_background`` has ended (its request needs them)."""
        while self._background:
            for result in await asyncio.gather(*self._background, return_exceptions=True):
                if isinstance(result, Exception):
                    log.warning("a background call of this client failed: %r", result)
        if self._http is not None:
            await self._http.close()

    def in_background(self, call: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        """Run ``call`` (a report nobody waits on) as a task ``aclose`` waits for; ``call`` handles its own errors."""
        task = asyncio.create_task(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def idle(self) -> None:
        """Return once none of this client's calls is under way, so a report nobody waits on (lease bytes) never
        shares the daemon's time with a call on the trainer's path."""
        while self._in_flight:
            await self._idle.wait()

    async def _send(self, method: str, path: str, **request: Any) -> tuple[int, bytes]:
        """One call (``request``: aiohttp's arguments): the status and the whole body."""
        self._in_flight += 1
        self._idle.clear()
        try:
            async with self._session().request(method, path, **request) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DaemonUnreachable(f"{method} {self._base}{path}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _body(self, method: str, path: str, **request: Any) -> bytes:
        status, content = await self._send(method, path, **request)
        if status >= 400:
            try:
                error = jsonlib.loads(content)
            except ValueError:
                error = {"message": content.decode(errors="replace")}
            raise ColocdHTTPError(status, error if isinstance(error, dict) else {"message": error})
        return content

    async def _call(self, method: str, path: str, json: Any = None, **request: Any) -> dict[str, Any]:
        """A route whose success body is a JSON object (one that is not JSON raises ``ValueError``)."""
        if not isinstance(body := jsonlib.loads(await self._body(method, path, json=json, **request)), dict):
            raise ColocdHTTPError(502, {"message": f"{method} {path} answered {type(body).__name__}, not an object"})
        return body

    async def phase(self, phase: str, step: int, *, trainer: dict[str, Any] | None = None,
                    adapter: str | None = None) -> dict[str, Any]:
        """``trainer``: what the trainer agent knows or did (see ``colocd.trainer.agent.TrainerAgent``); ``adapter``:
        the LoRA adapter name this phase's requests will use (a retired one is a 410)."""
        body: dict[str, Any] = {"phase": phase, "step": step}
        if trainer is not None:
            body["trainer"] = trainer
        if adapter is not None:
            body["adapter"] = adapter
        return await self._call("POST", "/v1/phase", body)

    async def sleep(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return await self._call("POST", "/v1/sleep", {"tags": tags, "engines": engines})

    async def resume(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return await self._call("POST", "/v1/resume", {"tags": tags, "engines": engines})

    async def status(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/status")

    async def ready(self) -> bool:
        status, _ = await self._send("GET", "/readyz")
        return status == 200

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll /readyz until it answers 200, within a deadline."""
        async with asyncio.timeout(timeout_s):
            delay = 0.02
            while True:
                try:
                    if await self.ready():
                        return
                except DaemonUnreachable:
                    pass
                await asyncio.sleep(delay)  # polling cadence while the daemon starts
                delay = min(delay * 2, 0.5)

    async def metrics(self) -> str:
        return (await self._body("GET", "/metrics")).decode()

    async def open_session(self, version: str, *, step: int | None = None, ranks: int | None = None,
                           depth: int | None = None, manifest: list[dict[str, Any]] | None = None,
                           partial: bool = False) -> dict[str, Any]:
        """``manifest``: every tensor the session will send, ``[{name, dtype, shape}]``; ``partial``: update only
        some tensors. A manifest the daemon gave a ``manifest_ref`` for is sent as that reference next time (in full
        again if the daemon no longer holds it)."""
        body: dict[str, Any] = {"version": version, "step": step, "ranks": ranks, "depth": depth}
        if partial:
            body["partial"] = True
        if manifest is None:
            return await self._call("POST", _SESSIONS, body)
        key: _ManifestKey = tuple((str(e["name"]), str(e["dtype"]), tuple(e["shape"])) for e in manifest)
        if (ref := self._manifest_refs.get(key)) is not None:
            try:
                return self._noted(key, await self._call("POST", _SESSIONS, {**body, "manifest_ref": ref}))
            except ColocdHTTPError as exc:
                # Refused naming the field: no manifest by it (409, the daemon restarted) or an older daemon (422).
                if exc.status not in (409, 422) or exc.body.get("field") != "manifest_ref":
                    raise
                del self._manifest_refs[key]
        return self._noted(key, await self._call("POST", _SESSIONS, {**body, "manifest": manifest}))

    def _noted(self, key: _ManifestKey, reply: dict[str, Any]) -> dict[str, Any]:
        ref = reply.get("manifest_ref")
        if isinstance(ref, str):
            remember(self._manifest_refs, key, ref, _MANIFEST_REFS_KEPT)
        return reply

    async def join_session(self, session_id: str, *, rank: int, device_id: str) -> dict[str, Any]:
        """Declare this rank's device (and process: the daemon unlinks its shm segments if the session ends
        uncommitted); the reply's ``feeds`` are the engine TP ranks it feeds (``streams`` false: send no chunks)."""
        body = {"rank": rank, "device_id": device_id, "pid": os.getpid()}
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/join", body)

    async def send_chunk(self, session_id: str, *, seq: int, rank: int, chunk: SendablePart) -> dict[str, Any]:
        body = {"seq": seq, "rank": rank, "transport": chunk.transport, "nbytes": chunk.nbytes,
                "handle": chunk.handle}
        if chunk.digests is not None:
            body["digests"] = chunk.digests
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/chunks", body)

    async def session(self, session_id: str) -> dict[str, Any]:
        return await self._call("GET", f"/v1/weights/sessions/{session_id}")

    async def commit(self, session_id: str, num_chunks: int | None = None) -> dict[str, Any]:
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/commit", {"num_chunks": num_chunks})

    async def abort(self, session_id: str, reason: str | None = None) -> dict[str, Any]:
        """Abandon the session; ``reason`` becomes its error, which every rank still streaming is told."""
        body = {"reason": reason[:1024]} if reason else None
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/abort", body)

    async def push_adapter(self, base: str, version: str, body: bytes) -> dict[str, Any]:
        """A LoRA adapter version as one safetensors file (``colocd.trainer.push_adapter`` builds it)."""
        return await self._call("PUT", f"/v1/adapters/{base}/{version}", data=body,
                                headers={"Content-Type": "application/octet-stream"})

    async def report_leases(self, report: dict[str, int]) -> dict[str, Any]:
        """A trainer rank's IPC lease bytes (``colocd.trainer.leases.LeaseBook.report()``)."""
        return await self._call("POST", "/v1/trainer/leases", report)

    async def weight_groups(self) -> dict[str, Any]:
        """The rank layout (world size, each engine's rank_offset) and the open weight-update groups."""
        return await self._call("GET", "/v1/weights/groups")

    async def open_weight_group(self, /, **spec: Any) -> dict[str, Any]:
        """Returns once every engine joined: join your side concurrently (see ``colocd.trainer.broadcast``)."""
        return await self._call("POST", "/v1/weights/groups", spec)

    async def close_weight_group(self, group_name: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/weights/groups/{group_name}")

    async def send_broadcast(self, session_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """Returns once every engine received and loaded it: broadcast while it is in flight."""
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/broadcasts", descriptor)

    async def apply_policy(self, document: bytes) -> dict[str, Any]:
        """Stage a policy YAML document; it applies at the next transition."""
        return await self._call("PUT", "/v1/policies", data=document, headers={"Content-Type": "application/yaml"})

    async def trace(self, step: int, fmt: str = "json") -> dict[str, Any]:
        return await self._call("GET", f"/v1/traces/{step}", params={"format": fmt})

    async def steps(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` steps summarised, newest first (``GET /v1/steps``)."""
        steps: list[dict[str, Any]] = (await self._call("GET", "/v1/steps", params={"limit": limit}))["steps"]
        return steps


def _blocking(method: Callable[Concatenate[AsyncColocdClient, _P], Coroutine[Any, Any, _T]],
              ) -> Callable[Concatenate[ColocdClient, _P], _T]:
    def call(self: ColocdClient, /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
        return self.run(method(self.async_client, *args, **kwargs))

    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class ColocdClient:
    """The synchronous face of ``AsyncColocdClient``: every method, run on a private event loop."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.new_event_loop()
        self.async_client = AsyncColocdClient(url, token=token, timeout_s=timeout_s)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self.async_client.aclose())
            self._loop.close()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run one coroutine of this client's (or built on it) to completion on the private loop."""
        return self._loop.run_until_complete(coro)

    phase = _blocking(AsyncColocdClient.phase)
    sleep = _blocking(AsyncColocdClient.sleep)
    resume = _blocking(AsyncColocdClient.resume)
    status = _blocking(AsyncColocdClient.status)
    ready = _blocking(AsyncColocdClient.ready)
    wait_ready = _blocking(AsyncColocdClient.wait_ready)
    metrics = _blocking(AsyncColocdClient.metrics)
    open_session = _blocking(AsyncColocdClient.open_session)
    join_session = _blocking(AsyncColocdClient.join_session)
    send_chunk = _blocking(AsyncColocdClient.send_chunk)
    session = _blocking(AsyncColocdClient.session)
    commit = _blocking(AsyncColocdClient.commit)
    abort = _blocking(AsyncColocdClient.abort)
    report_leases = _blocking(AsyncColocdClient.report_leases)
    weight_groups = _blocking(AsyncColocdClient.weight_groups)
    open_weight_group = _blocking(AsyncColocdClient.open_weight_group)
    close_weight_group = _blocking(AsyncColocdClient.close_weight_group)
    send_broadcast = _blocking(AsyncColocdClient.send_broadcast)
    apply_policy = _blocking(AsyncColocdClient.apply_policy)
    trace = _blocking(AsyncColocdClient.trace)
    steps = _blocking(AsyncColocdClient.steps)
