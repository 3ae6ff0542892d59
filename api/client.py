"""The trainer's client: typed calls for every route, and a weight pusher that streams buckets.

    async with AsyncColocdClient("http://127.0.0.1:7000") as c:
        await c.phase("train", step=1)
        ...
        await c.phase("sync", step=1)
        await WeightPusher(c).push(model.named_parameters(), version="1")
        await c.phase("rollout", step=1)

``ColocdClient`` offers the same calls synchronously.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from ..engines.chunks import dtype_name, plan_buckets
from ..engines.trainer.producer import ExportedChunk, Producer, producer_for

__all__ = [
    "AsyncColocdClient",
    "ChunkRecord",
    "ColocdClient",
    "ColocdHTTPError",
    "PushReport",
    "WeightPusher",
    "manifest_of",
]


class ColocdHTTPError(Exception):
    """The daemon answered with an error; ``status`` and the daemon's ``message`` are kept."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        self.status = status
        self.body = body
        self.error = str(body.get("error", "Error"))
        super().__init__(f"HTTP {status} {self.error}: {body.get('message', body)}")


def _transport(url: str) -> tuple[str, httpx.AsyncHTTPTransport | None]:
    if url.startswith("unix:"):
        return "http://colocd", httpx.AsyncHTTPTransport(uds=url.removeprefix("unix:"))
    return url.rstrip("/"), None


class AsyncColocdClient:
    """One method per route. ``url`` is ``http://host:port`` or ``unix:/path/to.sock``."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        base, transport = _transport(url)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.AsyncClient(base_url=base, transport=transport, headers=headers,
                                       timeout=httpx.Timeout(timeout_s, connect=5.0), trust_env=False)

    async def __aenter__(self) -> AsyncColocdClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, json: Any = None, **kw: Any) -> Any:
        response = await self._http.request(method, path, json=json, **kw)
        if response.status_code >= 400:
            try:
                body = response.json()
            except ValueError:
                body = {"message": response.text}
            raise ColocdHTTPError(response.status_code, body if isinstance(body, dict) else {"message": body})
        return response.json()

    async def phase(self, phase: str, step: int, *, trainer: dict[str, Any] | None = None) -> dict[str, Any]:
        """``trainer``: what the trainer agent knows or did (see ``api.agent.TrainerAgent``)."""
        body: dict[str, Any] = {"phase": phase, "step": step}
        if trainer is not None:
            body["trainer"] = trainer
        return await self._request("POST", "/v1/phase", body)  # type: ignore[no-any-return]

    async def sleep(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return await self._request("POST", "/v1/sleep", {"tags": tags, "engines": engines})  # type: ignore[no-any-return]

    async def resume(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return await self._request("POST", "/v1/resume", {"tags": tags, "engines": engines})  # type: ignore[no-any-return]

    async def status(self) -> dict[str, Any]:
        return await self._request("GET", "/v1/status")  # type: ignore[no-any-return]

    async def ready(self) -> bool:
        response = await self._http.get("/readyz")
        return response.status_code == 200

    async def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Poll /readyz until it answers 200, within a deadline."""
        async with asyncio.timeout(timeout_s):
            delay = 0.02
            while True:
                try:
                    if await self.ready():
                        return
                except httpx.TransportError:
                    pass
                await asyncio.sleep(delay)  # polling cadence while the daemon starts
                delay = min(delay * 2, 0.5)

    async def metrics(self) -> str:
        response = await self._http.get("/metrics")
        response.raise_for_status()
        return response.text

    async def open_session(self, version: str, *, step: int | None = None, ranks: int | None = None,
                           depth: int | None = None, manifest: list[dict[str, Any]] | None = None,
                           partial: bool = False) -> dict[str, Any]:
        """``manifest``: every tensor the session will send, ``[{name, dtype, shape}]`` (see ``manifest_of``);
        ``partial``: update only some tensors (allowed on intact weights only)."""
        body: dict[str, Any] = {"version": version, "step": step, "ranks": ranks, "depth": depth}
        if manifest is not None:
            body["manifest"] = manifest
        if partial:
            body["partial"] = True
        return await self._request("POST", "/v1/weights/sessions", body)  # type: ignore[no-any-return]

    async def send_chunk(self, session_id: str, *, seq: int, rank: int, chunk: ExportedChunk) -> dict[str, Any]:
        body = {"seq": seq, "rank": rank, "transport": chunk.transport, "nbytes": chunk.nbytes,
                "handle": chunk.handle}
        return await self._request("POST", f"/v1/weights/sessions/{session_id}/chunks", body)  # type: ignore[no-any-return]

    async def commit(self, session_id: str, num_chunks: int | None = None) -> dict[str, Any]:
        return await self._request("POST", f"/v1/weights/sessions/{session_id}/commit",  # type: ignore[no-any-return]
                                   {"num_chunks": num_chunks})

    async def abort(self, session_id: str) -> dict[str, Any]:
        return await self._request("POST", f"/v1/weights/sessions/{session_id}/abort")  # type: ignore[no-any-return]

    async def weight_groups(self) -> dict[str, Any]:
        """The rank layout (world size, each engine's rank_offset) and the open weight-update groups."""
        return await self._request("GET", "/v1/weights/groups")  # type: ignore[no-any-return]

    async def open_weight_group(self, **spec: Any) -> dict[str, Any]:
        """Returns once every engine joined: join your side concurrently (see ``api.distributed``)."""
        return await self._request("POST", "/v1/weights/groups", spec)  # type: ignore[no-any-return]

    async def close_weight_group(self, group_name: str) -> dict[str, Any]:
        return await self._request("DELETE", f"/v1/weights/groups/{group_name}")  # type: ignore[no-any-return]

    async def send_broadcast(self, session_id: str, descriptor: dict[str, Any]) -> dict[str, Any]:
        """Returns once every engine received and loaded it: broadcast while it is in flight."""
        return await self._request("POST", f"/v1/weights/sessions/{session_id}/broadcasts",  # type: ignore[no-any-return]
                                   descriptor)

    async def trace(self, step: int, fmt: str = "json") -> dict[str, Any]:
        return await self._request("GET", f"/v1/traces/{step}", params={"format": fmt})  # type: ignore[no-any-return]

    async def steps(self, limit: int = 20) -> list[dict[str, Any]]:
        """The last ``limit`` steps summarised, newest first (``GET /v1/steps``)."""
        return (await self._request("GET", "/v1/steps", params={"limit": limit}))["steps"]  # type: ignore[no-any-return]


def manifest_of(named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    """The manifest a session declares at open: each tensor's name, dtype (torch short name) and shape."""
    return [{"name": name, "dtype": dtype_name(t.dtype), "shape": list(t.shape)} for name, t in named]


@dataclass(frozen=True, slots=True)
class PushReport:
    session_id: str
    version: str
    chunks: int
    nbytes: int
    seconds: float
    commit: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk of a stream: bytes, export (flatten) time, round trip to its ack, the engines' load time."""

    seq: int
    nbytes: int
    export_s: float
    round_trip_s: float
    load_s: float


class WeightPusher:
    """Buckets ``(name, tensor)`` pairs into chunks and streams them through the daemon.

    At most ``depth`` chunks are exported and in flight at once; each buffer is released only
    after the daemon's ack. On any failure the session is aborted and every buffer released.
    ``transport`` names a producer (``engines.trainer.producer.PRODUCERS``); persistent ones
    (``ipc_ring``, ``zero_copy``) keep their exported buffers across pushes until ``aclose()``.

    Several trainer ranks: rank 0 opens the session with ``ranks=N`` and shares its id (e.g. a
    ``torch.distributed`` broadcast); every rank calls ``stream(session_id, its_tensors)`` with its own
    ``rank``; rank 0 commits once all have returned.
    """

    def __init__(self, client: AsyncColocdClient, *, transport: str = "shm", bucket_mb: float = 64,
                 depth: int = 2, rank: int = 0, slots: int | None = None) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        self._client = client
        self._transport = transport
        self._bucket_bytes = max(int(bucket_mb * 1024 * 1024), 1)
        self._depth = depth
        self._rank = rank
        # A ring needs a free slot for every chunk in flight.
        self._slots = max(slots or depth, depth)
        self._producer: Producer | None = None
        self.chunk_log: list[ChunkRecord] = []  # the last stream's chunks, in sequence order

    @classmethod
    def from_plan(cls, client: AsyncColocdClient, plan: dict[str, Any], *, rank: int = 0) -> WeightPusher:
        """A pusher shaped by the pipeline policy: the ``directives["pipeline"]`` of a ``sync`` reply."""
        return cls(client, transport=str(plan["transport"]), bucket_mb=int(plan["bucket_bytes"]) / 2**20,
                   depth=int(plan["depth"]), rank=rank)

    async def __aenter__(self) -> WeightPusher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drop the producer and whatever buffers it keeps exported."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str,
                   step: int | None = None, partial: bool = False) -> PushReport:
        """Open a session (this process is the only rank) declaring every tensor it will send, stream every
        chunk, commit. ``partial``: these tensors are only some of the model's (the engines' weights must be
        intact); otherwise the daemon refuses a push that does not cover every parameter."""
        t0 = time.perf_counter()
        named = list(named)  # references only: the manifest is declared before the first chunk
        session = await self._client.open_session(version, step=step, ranks=1, depth=self._depth,
                                                  manifest=manifest_of(named), partial=partial)
        sid = session["session_id"]
        try:
            chunks, nbytes = await self.stream(sid, named)
            commit = await self._client.commit(sid, chunks)
        except BaseException:
            try:
                await self._client.abort(sid)
            except (ColocdHTTPError, httpx.TransportError):
                pass  # the session may already be failed; the original error matters
            raise
        return PushReport(sid, version, chunks, nbytes, time.perf_counter() - t0, commit)

    @staticmethod
    async def _export(producer: Producer, bucket: list[tuple[str, torch.Tensor]]) -> ExportedChunk:
        export = asyncio.ensure_future(asyncio.to_thread(producer.export, bucket))
        try:
            return await asyncio.shield(export)
        except asyncio.CancelledError:
            # The thread runs on regardless: release what it made, or its buffer would outlive us.
            with contextlib.suppress(Exception):
                (await export).release()
            raise

    async def stream(self, session_id: str, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Send this rank's part of every chunk of an open session; returns (chunks, bytes)."""
        if self._producer is None:
            self._producer = producer_for(self._transport, bucket_bytes=self._bucket_bytes, slots=self._slots)
        producer = self._producer
        producer.begin_stream()
        window = asyncio.Semaphore(self._depth)
        tasks: list[asyncio.Task[None]] = []
        records: dict[int, ChunkRecord] = {}
        nbytes = 0
        seq = -1

        async def send(seq: int, chunk: ExportedChunk, export_s: float) -> None:
            t0 = time.perf_counter()
            try:
                ack = await self._client.send_chunk(session_id, seq=seq, rank=self._rank, chunk=chunk)
            finally:
                chunk.release()  # after the ack (or the failure): the engines are done with it
                window.release()
            round_trip_s = time.perf_counter() - t0
            records[seq] = ChunkRecord(seq, chunk.nbytes, export_s, round_trip_s, float(ack["load_s"]))

        try:
            for seq, bucket in enumerate(plan_buckets(named, self._bucket_bytes)):
                await window.acquire()
                if any(t.done() and t.exception() for t in tasks):
                    window.release()
                    break  # a chunk failed: the session is over, export nothing more
                t0 = time.perf_counter()
                # Off the event loop: an export may wait on the GPU (the ring syncs its flatten), and
                # acks of earlier chunks must keep flowing meanwhile. One export at a time.
                chunk = await self._export(producer, bucket)
                nbytes += chunk.nbytes
                tasks.append(asyncio.create_task(send(seq, chunk, time.perf_counter() - t0)))
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            producer.close()
            self.chunk_log = [records[k] for k in sorted(records)]
        return seq + 1, nbytes


class ColocdClient:
    """The synchronous face of ``AsyncColocdClient``: same methods, run on a private event loop."""

    def __init__(self, url: str, *, token: str | None = None, timeout_s: float = 600.0) -> None:
        self._loop = asyncio.new_event_loop()
        self._async = AsyncColocdClient(url, token=token, timeout_s=timeout_s)

    def __enter__(self) -> ColocdClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._loop.is_closed():
            self._loop.run_until_complete(self._async.aclose())
            self._loop.close()

    def _run(self, coro: Any) -> Any:
        return self._loop.run_until_complete(coro)

    def phase(self, phase: str, step: int) -> dict[str, Any]:
        return self._run(self._async.phase(phase, step))  # type: ignore[no-any-return]

    def sleep(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return self._run(self._async.sleep(tags, engines))  # type: ignore[no-any-return]

    def resume(self, tags: list[str] | None = None, engines: list[str] | None = None) -> dict[str, Any]:
        return self._run(self._async.resume(tags, engines))  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any]:
        return self._run(self._async.status())  # type: ignore[no-any-return]

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        self._run(self._async.wait_ready(timeout_s))

    def trace(self, step: int, fmt: str = "json") -> dict[str, Any]:
        return self._run(self._async.trace(step, fmt))  # type: ignore[no-any-return]

    def steps(self, limit: int = 20) -> list[dict[str, Any]]:
        return self._run(self._async.steps(limit))  # type: ignore[no-any-return]

    def metrics(self) -> str:
        return self._run(self._async.metrics())  # type: ignore[no-any-return]

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str, step: int | None = None,
                     transport: str = "shm", bucket_mb: float = 64, depth: int = 2,
                     partial: bool = False) -> PushReport:
        pusher = WeightPusher(self._async, transport=transport, bucket_mb=bucket_mb, depth=depth)
        return self._run(pusher.push(named, version=version, step=step, partial=partial))  # type: ignore[no-any-return]
