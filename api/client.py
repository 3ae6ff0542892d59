"""The daemon's HTTP client: one typed call per route, async and sync. No torch: the CLI and cluster tools use it.

    async with AsyncColocdClient("http://127.0.0.1:7000") as c:
        await c.phase("train", step=1)
        ...

``ColocdClient`` offers the same calls synchronously. Streaming weights (bucketing, IPC export) is the
trainer library's job: ``colocd.trainer.WeightPusher`` and ``colocd.trainer.TrainerClient``.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import logging
import os
from collections import OrderedDict
from collections.abc import Coroutine, Sequence
from typing import Any, Protocol, Self, TypeVar

import aiohttp

from ..errors import ColocdHTTPError, DaemonUnreachable
from ..policies import Transport
from ..recent import remember

# ColocdHTTPError and DaemonUnreachable live in colocd.errors; re-exported where client users import them.
__all__ = ["AsyncColocdClient", "ColocdClient", "ColocdHTTPError", "DaemonUnreachable", "SendablePart"]

log = logging.getLogger("colocd.client")

_T = TypeVar("_T")

# A manifest's content as the client compares it: (name, dtype, shape) per tensor, in order.
_ManifestKey = tuple[tuple[str, str, tuple[int, ...]], ...]
_SESSIONS = "/v1/weights/sessions"
_MANIFEST_REFS_KEPT = 8  # as many as the daemon keeps (daemon/manifests.py)


def _manifest_key(manifest: Sequence[dict[str, Any]]) -> _ManifestKey:
    """What a manifest's reference stands for, cheap to build and compare (the daemon's digest is its own)."""
    return tuple((str(e["name"]), str(e["dtype"]), tuple(e["shape"])) for e in manifest)


class SendablePart(Protocol):
    """What one rank's part of a chunk tells the daemon (``trainer.exported.ExportedPart`` is one): its transport,
    size, the handle engines open and its digests; the daemon parses it as ``api.schemas.ChunkDescriptor``."""

    @property
    def transport(self) -> Transport: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def handle(self) -> dict[str, Any]: ...
    @property
    def digests(self) -> dict[str, str] | None: ...


def _refuses_manifest_ref(exc: ColocdHTTPError) -> bool:
    """The daemon will not take the reference: it holds no manifest by it (409, a restarted daemon), or it
    predates the field (422 naming it). Either way the manifest itself is what it needs."""
    if exc.status == 409:
        return exc.error == "ManifestRefUnknown"
    return exc.status == 422 and exc.body.get("field") == "manifest_ref"


CONNECT_S = 5.0


class AsyncColocdClient:
    """One method per route. ``url`` is ``http://host:port`` or ``unix:/path/to.sock``.

    Calls go through aiohttp's client: the cluster client fans every phase out to all daemons from one event loop,
    and aiohttp's costs that loop a fraction of httpx's CPU per request (docs/deploy.md, the fan-out study). A
    call the daemon answers with an error raises ``ColocdHTTPError``; one it does not answer, ``DaemonUnreachable``.
    """

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
        self._in_flight = 0  # this client's calls under way (``idle``)
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task[None]] = set()  # ``in_background``: ended before ``aclose`` closes

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
        """Run ``call`` (a report nobody waits on) as a task this client owns: ``aclose`` waits for it, so it never
        runs against a closed client. ``call`` handles its own errors; one it lets through is raised by the task."""
        task = asyncio.create_task(call)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    async def idle(self) -> None:
        """Return once none of this client's calls is under way: what a report nobody waits on (the trainer's
        lease bytes) waits for, so it never shares the daemon's and this process's time with a call that is on
        the trainer's path (a commit right after the stream, the rollout transition right after the commit)."""
        while self._in_flight:
            await self._idle.wait()

    async def _send(self, method: str, path: str, json: Any = None,
                    params: dict[str, Any] | None = None, data: bytes | None = None) -> tuple[int, bytes]:
        """One call: the status and the whole body; ``DaemonUnreachable`` when no answer came back."""
        self._in_flight += 1
        self._idle.clear()
        try:
            async with self._session().request(method, path, json=json, params=params, data=data) as response:
                return response.status, await response.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise DaemonUnreachable(f"{method} {self._base}{path}: {type(exc).__name__}: {exc}".rstrip(": ")) from exc
        finally:
            self._in_flight -= 1
            if not self._in_flight:
                self._idle.set()

    async def _request(self, method: str, path: str, json: Any = None, params: dict[str, Any] | None = None,
                       data: bytes | None = None) -> Any:
        status, content = await self._send(method, path, json, params, data)
        if status >= 400:
            try:
                body = jsonlib.loads(content)
            except ValueError:
                body = {"message": content.decode(errors="replace")}
            raise ColocdHTTPError(status, body if isinstance(body, dict) else {"message": body})
        return jsonlib.loads(content)

    async def _call(self, method: str, path: str, json: Any = None,
                    params: dict[str, Any] | None = None, data: bytes | None = None) -> dict[str, Any]:
        """A route whose success body is a JSON object."""
        body = await self._request(method, path, json, params, data)
        if not isinstance(body, dict):
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
        status, content = await self._send("GET", "/metrics")
        if status >= 400:
            raise ColocdHTTPError(status, {"message": content.decode(errors="replace")})
        return content.decode()

    async def open_session(self, version: str, *, step: int | None = None, ranks: int | None = None,
                           depth: int | None = None, manifest: list[dict[str, Any]] | None = None,
                           partial: bool = False) -> dict[str, Any]:
        """``manifest``: every tensor the session will send, ``[{name, dtype, shape}]`` (see ``manifest_of``);
        ``partial``: update only some tensors (allowed on intact weights only).

        A manifest the daemon gave a ``manifest_ref`` for is sent as that reference next time; if the daemon no
        longer holds it (a restart), the manifest is sent in full once more, and the refusal is not raised."""
        body: dict[str, Any] = {"version": version, "step": step, "ranks": ranks, "depth": depth}
        if partial:
            body["partial"] = True
        if manifest is None:
            return await self._call("POST", _SESSIONS, body)
        key = _manifest_key(manifest)
        if (ref := self._manifest_refs.get(key)) is not None:
            try:
                return self._noted(key, await self._call("POST", _SESSIONS, {**body, "manifest_ref": ref}))
            except ColocdHTTPError as exc:
                if not _refuses_manifest_ref(exc):
                    raise
                del self._manifest_refs[key]
        return self._noted(key, await self._call("POST", _SESSIONS, {**body, "manifest": manifest}))

    def _noted(self, key: _ManifestKey, reply: dict[str, Any]) -> dict[str, Any]:
        """Keep the manifest_ref an open reply gives for ``key`` (a daemon without the field gives none: nothing
        kept), so later opens of the same manifest send the reference."""
        ref = reply.get("manifest_ref")
        if isinstance(ref, str):
            remember(self._manifest_refs, key, ref, _MANIFEST_REFS_KEPT)
        return reply

    async def join_session(self, session_id: str, *, rank: int, device_id: str) -> dict[str, Any]:
        """Declare this rank's device; the reply's ``feeds`` are the engine TP ranks it feeds (``streams``
        false: none, send no chunks). The join also declares this process (``pid``), so the daemon may unlink
        its shm segments if the session ends uncommitted."""
        path = f"/v1/weights/sessions/{session_id}/join"
        try:
            return await self._call("POST", path, {"rank": rank, "device_id": device_id, "pid": os.getpid()})
        except ColocdHTTPError as exc:
            if exc.status != 422 or exc.body.get("field") != "pid":
                raise
        # A daemon from before joins declared a pid refuses the field: join without it.
        return await self._call("POST", path, {"rank": rank, "device_id": device_id})

    async def send_chunk(self, session_id: str, *, seq: int, rank: int, chunk: SendablePart) -> dict[str, Any]:
        body = {"seq": seq, "rank": rank, "transport": chunk.transport, "nbytes": chunk.nbytes,
                "handle": chunk.handle}
        if chunk.digests is not None:
            body["digests"] = chunk.digests
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/chunks", body)

    async def session(self, session_id: str) -> dict[str, Any]:
        """A session's progress and state."""
        return await self._call("GET", f"/v1/weights/sessions/{session_id}")

    async def commit(self, session_id: str, num_chunks: int | None = None) -> dict[str, Any]:
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/commit", {"num_chunks": num_chunks})

    async def abort(self, session_id: str, reason: str | None = None) -> dict[str, Any]:
        """Abandon the session; ``reason`` becomes its error, which every rank still streaming is told."""
        body = {"reason": reason[:1024]} if reason else None
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/abort", body)

    async def push_adapter(self, base: str, version: str, body: bytes) -> dict[str, Any]:
        """A LoRA adapter version as one safetensors file (``colocd.trainer.push_adapter`` builds it)."""
        return await self._call("PUT", f"/v1/adapters/{base}/{version}", data=body)

    async def report_leases(self, report: dict[str, int]) -> dict[str, Any]:
        """A trainer rank's IPC lease bytes (``colocd.trainer.leases.LeaseBook.report()``)."""
        return await self._call("POST", "/v1/trainer/leases", report)

    async def weight_groups(self) -> dict[str, Any]:
        """The rank layout (world size, each engine's rank_offset) and the open weight-update groups."""
        return await self._call("GET", "/v1/weights/groups")

    async def open_weight_group(self, **spec: Any) -> dict[str, Any]:
        """Returns once every engine joined: join your side concurrently (see ``colocd.trainer.broadcast``)."""
        return await self._call("POST", "/v1/weights/groups", spec)

    async def close_weight_group(self, group_name: str) -> dict[str, Any]:
        return await self._call("DELETE", f"/v1/weights/groups/{group_name}")

    async def send_broadcast(self, session_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """Returns once every engine received and loaded it: broadcast while it is in flight."""
        return await self._call("POST", f"/v1/weights/sessions/{session_id}/broadcasts", descriptor)

    async def trace(self, step: int, fmt: str = "json") -> dict[str, Any]:
        return await self._call("GET", f"/v1/traces/{step}", params={"format": fmt})

    async def steps(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` steps summarised, newest first (``GET /v1/steps``)."""
        steps: list[dict[str, Any]] = (await self._call("GET", "/v1/steps", params={"limit": limit}))["steps"]
        return steps


class ColocdClient:
    """The synchronous face of ``AsyncColocdClient``: every method, run on a private event loop."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._async = AsyncColocdClient(url, token=token, timeout_s=timeout_s)

    @property
    def async_client(self) -> AsyncColocdClient:
        """The client this one drives (for code that needs the async calls on the same connection pool)."""
        return self._async

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._async.aclose())
            self._loop.close()

    def run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Run one coroutine of this client's (or built on it) to completion on the private loop."""
        return self._loop.run_until_complete(coro)

    def phase(self, phase: str, step: int, *, trainer: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.run(self._async.phase(phase, step, trainer=trainer))

    def sleep(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return self.run(self._async.sleep(tags, engines))

    def resume(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return self.run(self._async.resume(tags, engines))

    def status(self) -> dict[str, Any]:
        return self.run(self._async.status())

    def ready(self) -> bool:
        return self.run(self._async.ready())

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self.run(self._async.wait_ready(timeout_s))

    def metrics(self) -> str:
        return self.run(self._async.metrics())

    def open_session(self, version: str, *, step: int | None = None, ranks: int | None = None,
                     depth: int | None = None, manifest: list[dict[str, Any]] | None = None,
                     partial: bool = False) -> dict[str, Any]:
        return self.run(self._async.open_session(version, step=step, ranks=ranks, depth=depth,
                                                 manifest=manifest, partial=partial))

    def join_session(self, session_id: str, *, rank: int, device_id: str) -> dict[str, Any]:
        return self.run(self._async.join_session(session_id, rank=rank, device_id=device_id))

    def send_chunk(self, session_id: str, *, seq: int, rank: int, chunk: SendablePart) -> dict[str, Any]:
        return self.run(self._async.send_chunk(session_id, seq=seq, rank=rank, chunk=chunk))

    def session(self, session_id: str) -> dict[str, Any]:
        return self.run(self._async.session(session_id))

    def commit(self, session_id: str, num_chunks: int | None = None) -> dict[str, Any]:
        return self.run(self._async.commit(session_id, num_chunks))

    def abort(self, session_id: str, reason: str | None = None) -> dict[str, Any]:
        return self.run(self._async.abort(session_id, reason))

    def weight_groups(self) -> dict[str, Any]:
        return self.run(self._async.weight_groups())

    def open_weight_group(self, **spec: Any) -> dict[str, Any]:
        return self.run(self._async.open_weight_group(**spec))

    def close_weight_group(self, group_name: str) -> dict[str, Any]:
        return self.run(self._async.close_weight_group(group_name))

    def send_broadcast(self, session_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        return self.run(self._async.send_broadcast(session_id, descriptor))

    def trace(self, step: int, fmt: str = "json") -> dict[str, Any]:
        return self.run(self._async.trace(step, fmt))

    def steps(self, limit: int = 20) -> list[dict[str, Any]]:
        return self.run(self._async.steps(limit))
