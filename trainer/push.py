"""Streaming weights from the trainer through the daemon: bucket, export, send within a window, commit (the loop
around it: docs/client.md). ``TrainerClient`` is the sync client with ``push_weights``; ``push_adapter`` pushes a
LoRA adapter version as PEFT saves it, in one request (docs/client.md, "LoRA adapters")."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save

from ..api.client import AsyncColocdClient, ColocdClient, ColocdHTTPError, DaemonUnreachable
from ..engines.chunks import dtype_name, plan_chunks
from ..engines.cuda_handles import device_uuid
from ..engines.digest import DigestCache, tensor_digests
from ..policies import AUTO_ORDER, Transport
from .leases import LEASE_GRACE_S, LeaseBook
from .producer import ExportedPart, Producer, transport_named

__all__ = [
    "DEFAULT_BUCKET_MB", "DEFAULT_DEPTH", "INLINE_BUCKET_MB", "ChunkRecord", "PushReport", "TrainerClient",
    "WeightPusher", "adapter_body", "auto_bucket_bytes", "auto_transport", "free_bytes", "manifest_of", "push_adapter",
    "push_session",
]

# The `tuned` preset (docs/benchmarks.md), as the daemon's default policy has it: 2 chunks of up to 4 GiB in
# flight, fresh CUDA-IPC buckets on GPU (nothing stays exported through the rollout), shared memory on CPU. Not
# three of 2 GiB: each bucket costs the engine an IPC handle opened and closed (~1 ms on an H200), and the engine
# loads one chunk at a time, so a third in flight only queues there.
DEFAULT_DEPTH = 2
DEFAULT_BUCKET_MB = 4096
INLINE_BUCKET_MB = 32  # one request body (limits.max_body_bytes, 64 MiB); base64 and the pickle add a third
_MIB = 1 << 20

log = logging.getLogger("colocd.trainer")
ADAPTER_CONFIG_KEY = "adapter_config"  # what daemon/adapters.py reads from the file's __metadata__


def auto_transport(device: torch.device, accepted: Iterable[str] | None = None) -> str:
    """CUDA-IPC buckets for CUDA tensors, shared memory for CPU ones, unless the engines do not load that: then
    the first of the device's order they do (``accepted``: the join reply's ``transports``; empty: no word).
    Against a real SGLang on CPU that is ``inline``."""
    order = [t.value for t in AUTO_ORDER if device.type == "cuda" or t is not Transport.CUDA_IPC]
    allowed = set(accepted or ())
    return next((t for t in order if t in allowed), order[0])


def auto_bucket_bytes(transport: str, device: torch.device, depth: int) -> int:
    """``bucket_mb=None``: DEFAULT_BUCKET_MB (INLINE_BUCKET_MB for inline), shrunk (>= 1 MiB) to what ``depth``
    buckets fit where they are staged (GPU memory for CUDA transports, /dev/shm for shm; disk is not checked)."""
    bucket = (INLINE_BUCKET_MB if transport == "inline" else DEFAULT_BUCKET_MB) * _MIB
    cuda = device.type == "cuda" and transport in ("cuda_ipc", "per_tensor")
    staged = device if cuda else "/dev/shm" if transport == "shm" else None
    free = None if staged is None else free_bytes(staged)
    if free is not None and depth * bucket > free:
        bucket = max(_MIB, free // depth)
    return bucket


def free_bytes(where: torch.device | str) -> int | None:
    """Free bytes on a CUDA device, in a filesystem (a path) or in host memory (``MemAvailable``); None: unknown."""
    try:
        if isinstance(where, str):
            st = os.statvfs(where)
            return int(st.f_bavail * st.f_frsize)
        if where.type == "cuda":
            return int(torch.cuda.mem_get_info(where)[0])
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, RuntimeError, AssertionError, StopIteration):
        return None


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
    """One chunk of a stream: bytes, export time, round trip to its ack, the engines' load, the buffer's release."""

    seq: int
    nbytes: int
    export_s: float
    round_trip_s: float  # descriptor handed to the sender -> ack back
    load_s: float
    release_s: float = 0.0  # ack back -> buffer released
    digest_s: float = 0.0  # of export_s: the tensors' digests (verified commits only; engines/digest.py)


async def push_session(client: AsyncColocdClient, named: Iterable[tuple[str, torch.Tensor]],
                       stream: Callable[[str, list[tuple[str, torch.Tensor]]], Awaitable[tuple[int, int]]], *,
                       version: str, step: int | None = None, depth: int | None = None, partial: bool = False,
                       chunks_counted: bool = True) -> PushReport:
    """One whole session with this process as its only rank: open declaring ``named``'s manifest, ``stream(sid,
    named) -> (chunks, bytes)``, commit; on any failure abort and raise. ``chunks_counted=False`` (broadcasts):
    the commit names no chunk count."""
    t0 = time.perf_counter()
    named = list(named)  # references only: the manifest is declared before the first chunk
    reply = await client.open_session(version, step=step, ranks=1, depth=depth, manifest=manifest_of(named),
                                      partial=partial)
    sid = str(reply["session_id"])
    try:
        chunks, nbytes = await stream(sid, named)
        commit = await client.commit(sid, chunks if chunks_counted else None)
    except BaseException:
        with contextlib.suppress(ColocdHTTPError, DaemonUnreachable):
            await client.abort(sid)  # the session may already be failed; the original error matters
        raise
    return PushReport(sid, version, chunks, nbytes, time.perf_counter() - t0, commit)


# What one export gives: the chunk, the export's seconds and the digests' share of them; the export's error (the
# tensors can still be walked); None: the plan is done.
_Made = tuple[ExportedPart, float, float] | Exception | None


class WeightPusher:
    """Buckets ``(name, tensor)`` pairs into chunks and streams them through the daemon, at most ``depth`` exported
    and in flight, each buffer released after the daemon's ack (the ``tuned`` preset by default; ``from_plan``: the
    daemon's pipeline plan). Several ranks: each ``stream``s with its own ``rank``, joining on its device
    (``device_id``; default: the tensors' GPU UUID, or ``cpu:<rank>``); ``last_join`` is the last join's reply.
    Every exported buffer is a lease in ``leases``, reclaimed ``lease_grace_s`` after a failed stream, before the
    error reaches the caller. docs/client.md, in full."""

    def __init__(self, client: AsyncColocdClient, *, transport: Transport | str = "auto",
                 bucket_mb: float | None = None, depth: int = DEFAULT_DEPTH, rank: int = 0,
                 device_id: str | None = None, lease_grace_s: float = LEASE_GRACE_S) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if transport != "auto":
            transport = transport_named(transport)
        self._client = client
        self._transport = transport
        self._bucket_bytes: int | None = None if bucket_mb is None else max(int(bucket_mb * _MIB), 1)
        self._depth = depth
        self._rank = rank
        self._device_id = device_id
        self.last_join: dict[str, Any] | None = None
        self.last_join_s = 0.0  # the last join's round trip, seconds
        # The producer and its bucket bytes, chosen at the first stream and kept with it.
        self._producer: Producer | None = None
        self._chunk_bytes = 0
        self.chunk_log: list[ChunkRecord] = []  # the last stream's chunks, in sequence order
        self.leases = LeaseBook(rank)
        self._lease_grace_s = lease_grace_s
        self._lease_reporter: asyncio.Task[None] | None = None
        self._lease_report_due = False
        self._digest_cache: DigestCache = {}  # engines/digest.py weight vectors, per device

    @classmethod
    def from_plan(cls, client: AsyncColocdClient, plan: dict[str, Any], *, rank: int = 0,
                  device_id: str | None = None) -> WeightPusher:
        """A pusher shaped by the pipeline policy: the ``directives["pipeline"]`` of a ``sync`` reply."""
        return cls(client, transport=Transport(plan["transport"]), bucket_mb=int(plan["bucket_bytes"]) / _MIB,
                   depth=int(plan["depth"]), rank=rank, device_id=device_id)

    def transport_for(self, device: torch.device) -> str:
        """The one given, else ``auto_transport`` over what the last join said the engines accept."""
        if self._transport != "auto":
            return str(self._transport)
        return auto_transport(device, None if self.last_join is None else self.last_join.get("transports"))

    async def __aenter__(self) -> WeightPusher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drop the producer and whatever buffers it keeps exported."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None
            # Buffers a live engine still maps stay counted (torch keeps them until it lets go): counts are
            # zeroed only after a failed stream's grace.
            self.leases.release_all()
            self.leases.collect()
            self._report_leases()
        if self._lease_reporter is not None:
            await self._lease_reporter

    def _report_leases(self) -> None:
        """Tell the daemon this rank's lease bytes once no call is under way: one in flight, the latest wins."""
        self._lease_report_due = True
        if self._lease_reporter is None or self._lease_reporter.done():
            self._lease_reporter = self._client.in_background(self._send_lease_reports())

    async def _send_lease_reports(self) -> None:
        await self._client.idle()
        while self._lease_report_due:
            self._lease_report_due = False
            try:
                await self._client.report_leases(self.leases.report())
            except (ColocdHTTPError, DaemonUnreachable) as exc:  # a daemon without the route, or gone
                log.debug("lease report not delivered: %s", exc)
                return

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str,
                   step: int | None = None, partial: bool = False) -> PushReport:
        """``push_session`` with this pusher's stream. ``partial``: only some of the model's tensors (the engines'
        weights must be intact); otherwise the daemon refuses a push that does not cover every parameter."""
        try:
            return await push_session(self._client, named, self.stream, version=version, step=step,
                                      depth=self._depth, partial=partial)
        except BaseException as exc:
            if self.leases.retained_bytes:  # e.g. an engine that died after its acks, before letting go
                await self.leases.settle(f"push of {version} failed: {exc!r}", self._lease_grace_s)
                self._report_leases()
            raise

    async def stream(self, session_id: str, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Join the session, then send this rank's part of every chunk; returns (chunks, bytes). A rank that feeds
        no engine rank (``streams: false``) sends nothing: (the plan's chunk count, 0). A chunk (or the join) that
        fails aborts the session at once, naming this rank's error (the other ranks' streams then fail with it);
        the stream still pulls every tensor left, so the ranks' collectives stay matched, then raises the error."""
        # Pulled off the event loop, one item at a time: producing a tensor may be a collective (FSDP's
        # full_tensor, a TP all-gather) waiting for a slower rank, while this rank's acks must keep flowing.
        # A declared device_id joins before producing anything; else the first tensor says where it is.
        items = iter(named)
        if self._device_id is not None:
            await self._join(session_id, self._device_id, items)
        # A list or tuple is already produced: no thread hop (~0.2-0.5 ms on a VM host) for its first item.
        first = next(items, None) if isinstance(named, list | tuple) else await asyncio.to_thread(next, items, None)
        device = torch.device("cpu") if first is None else first[1].device
        named = itertools.chain([first] if first is not None else [], items)
        if self._device_id is None:
            await self._join(session_id, self._device_named(device), items)
        assert self.last_join is not None
        producer = self._producer_for(device)
        if not self.last_join["streams"]:
            # No engine rank on this rank's device: walk the tensors (collectives the other ranks wait for).
            self.chunk_log = []
            buckets = plan_chunks(named, self._chunk_bytes)
            count = 0
            while await asyncio.to_thread(next, buckets, None) is not None:
                count += 1
            await self._check_still_open(session_id)
            return count, 0
        # The daemon refuses a chunk past the session's window, so keep within it when it is narrower than ours.
        depth = min(self._depth, int(self.last_join.get("depth") or self._depth))
        return await self._send_all(session_id, producer, plan_chunks(named, self._chunk_bytes), depth)

    def _device_named(self, device: torch.device) -> str:
        if device.type != "cuda":
            return f"cpu:{self._rank}"
        return device_uuid(device.index if device.index is not None else torch.cuda.current_device())

    def _producer_for(self, device: torch.device) -> Producer:
        """The producer kept from the last stream, unless ``auto`` chose a transport the engines no longer load
        (another kind attached): then this stream's transport and bucket size are chosen again."""
        accepted = (self.last_join or {}).get("transports") or ()
        if ((producer := self._producer) is not None and self._transport == "auto" and accepted
                and producer.transport not in accepted):
            producer.close()
            self._producer = None
        if self._producer is None:
            transport = self.transport_for(device)
            self._chunk_bytes = self._bucket_bytes or auto_bucket_bytes(transport, device, self._depth)
            self._producer = Producer(transport, leases=self.leases)
        return self._producer

    async def _join(self, session_id: str, device_id: str, remaining: Iterator[tuple[str, torch.Tensor]]) -> None:
        """Join on ``device_id``; if that fails, abort the session, walk the tensors, then raise."""
        t0 = time.perf_counter()
        try:
            self.last_join = await self._client.join_session(session_id, rank=self._rank, device_id=device_id)
        except Exception as exc:
            await self._abort(session_id, exc)
            await self._walk(remaining)
            raise
        self.last_join_s = time.perf_counter() - t0

    async def _send_all(self, session_id: str, producer: Producer,
                        buckets: Iterator[list[tuple[str, torch.Tensor]]], depth: int) -> tuple[int, int]:
        self.leases.owner = f"session {session_id}"
        tasks: list[asyncio.Task[None]] = []
        records: dict[int, ChunkRecord] = {}
        nbytes = 0
        failure: list[Exception] = []  # the first failure of this stream: what it raises, after walking the rest
        aborting: list[asyncio.Future[None]] = []

        def failed(exc: Exception) -> None:
            if not failure:
                failure.append(exc)
                # At once, not after the next bucket's gather: the other ranks' waits end with this error now.
                aborting.append(asyncio.ensure_future(self._abort(session_id, exc)))
            elif _session_gone(failure[0]) and not _session_gone(exc):
                # A later chunk's 410 can arrive before the failing chunk's own reply: raise the cause, not its echo.
                failure[0] = exc

        async def send(seq: int, chunk: ExportedPart, export_s: float, digest_s: float) -> None:
            t0 = acked_at = time.perf_counter()
            try:
                ack = await self._client.send_chunk(session_id, seq=seq, rank=self._rank, chunk=chunk)
                acked_at = time.perf_counter()
            except Exception as exc:
                failed(exc)
                raise
            finally:
                chunk.release()  # after the ack (or the failure): the engines are done with it
            records[seq] = ChunkRecord(seq, chunk.nbytes, export_s, acked_at - t0, float(ack["load_s"]),
                                       time.perf_counter() - acked_at, digest_s)

        results: list[BaseException | None] = []
        raised: BaseException | None = None
        # The daemon's commit compares these with the engines' (policy sync.verify; daemon/verify.py).
        digests = self._digest_cache if (self.last_join or {}).get("verify", "off") != "off" else None
        try:
            while not failure:
                if len(tasks) >= depth:
                    # Acks may come back out of order, and the daemon counts the window from the first chunk it
                    # has not received: chunk n goes only once chunk n - depth has ended.
                    await asyncio.wait({tasks[-depth]})
                    if failure:  # a chunk failed meanwhile: pull nothing more here
                        break
                made = await self._next_export(producer, buckets, digests)
                if isinstance(made, Exception):
                    failed(made)
                    break
                if made is None:
                    break
                chunk, export_s, digest_s = made
                if failure:
                    chunk.release()
                    break  # a chunk failed: the session is over, send nothing more
                nbytes += chunk.nbytes
                tasks.append(asyncio.create_task(send(len(tasks), chunk, export_s, digest_s)))
            # Chunks still in flight end with their acks, or once the abort lands (410): buffers go after that.
            results = await asyncio.gather(*tasks, return_exceptions=True)
        except BaseException as exc:
            raised = exc
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if isinstance(exc, Exception) and not failure:
                failed(exc)  # the iterator itself failed: nothing left to walk, but the other ranks learn it now
            await asyncio.gather(*aborting, return_exceptions=True)
            raise
        finally:
            producer.close()
            self.chunk_log = [records[k] for k in sorted(records)]
            error = raised or (failure[0] if failure else None) or next(
                (r for r in results if isinstance(r, BaseException)), None)
            if error is not None:  # what a consumer still counts is reclaimed after the grace, before the error goes on
                await self.leases.settle(f"session {session_id} failed: {error!r}", self._lease_grace_s)
            else:
                self.leases.collect()
            self._report_leases()
        if failure:
            await asyncio.gather(*aborting, return_exceptions=True)
            await self._walk(buckets)
            raise failure[0]
        if (error := next((r for r in results if isinstance(r, BaseException)), None)) is not None:
            raise error
        return len(tasks), nbytes

    @staticmethod
    def _pull_and_export(producer: Producer, buckets: Iterator[list[tuple[str, torch.Tensor]]],
                         digests: DigestCache | None) -> _Made:
        """On a thread: the next bucket exported (with its tensors' digests where ``digests`` is a cache), the
        export's seconds and the digests' share; None when the plan is done. A failed export is returned; the
        iterator's own error is raised as it is."""
        bucket = next(buckets, None)
        if bucket is None:
            return None
        t0 = time.perf_counter()
        try:
            chunk = producer.export(bucket)
        except Exception as exc:
            return exc
        t1 = time.perf_counter()
        if digests is not None:
            try:
                chunk.digests = tensor_digests(bucket, digests)
            except Exception as exc:
                chunk.release()
                return exc
        t2 = time.perf_counter()
        return chunk, t2 - t0, t2 - t1

    @classmethod
    async def _next_export(cls, producer: Producer, buckets: Iterator[list[tuple[str, torch.Tensor]]],
                           digests: DigestCache | None) -> _Made:
        # One hop off the event loop per chunk for both (~0.2-0.3 ms each on a busy host): pulling may be a
        # collective and an export may wait on the GPU, while earlier chunks' acks must keep flowing.
        work = asyncio.ensure_future(asyncio.to_thread(cls._pull_and_export, producer, buckets, digests))
        try:
            return await asyncio.shield(work)
        except asyncio.CancelledError:
            # The thread runs on: release what it made, and close nothing while it writes.
            with contextlib.suppress(Exception):
                if isinstance(made := await work, tuple):
                    made[0].release()
            raise

    async def _check_still_open(self, session_id: str) -> None:
        """A rank that sent nothing raises the session's error if another rank failed it meanwhile."""
        session = await self._client.session(session_id)
        if session.get("state") != "open":
            raise ColocdHTTPError(410, {"error": "SessionGone", "session_id": session_id,
                                        "session_state": session.get("state"),
                                        "message": f"session {session_id} {session.get('state')}: "
                                                   f"{session.get('error')}"})

    async def _abort(self, session_id: str, error: BaseException) -> None:
        """Abort the session naming this rank's error, so every other rank's wait ends now with it (best effort)."""
        detail = error.body.get("message", str(error)) if isinstance(error, ColocdHTTPError) else str(error)
        try:
            await self._client.abort(session_id, f"rank {self._rank} stopped: {type(error).__name__}: {detail}")
        except (ColocdHTTPError, DaemonUnreachable) as exc:
            log.debug("abort of session %s after rank %d's failure: %s", session_id, self._rank, exc)

    @staticmethod
    async def _walk(remaining: Iterable[object]) -> None:
        """Pull every item left, sending nothing: producing one may be a collective the other ranks run too."""
        def walk() -> None:
            for _ in remaining:
                pass

        try:
            await asyncio.to_thread(walk)
        except Exception as exc:  # the stream's first error is what the caller needs
            log.warning("walking the tensors left after a failed stream raised: %s", exc)


class TrainerClient(ColocdClient):
    """``ColocdClient`` with the weight push; each push opens, streams and commits one session."""

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str, step: int | None = None,
                     transport: Transport | str = "auto", bucket_mb: float | None = None, depth: int = DEFAULT_DEPTH,
                     partial: bool = False) -> PushReport:
        """Open, stream and commit one session, with ``WeightPusher``'s defaults (the ``tuned`` preset)."""
        async def push() -> PushReport:
            async with WeightPusher(self.async_client, transport=transport, bucket_mb=bucket_mb,
                                    depth=depth) as pusher:
                return await pusher.push(named, version=version, step=step, partial=partial)

        return self.run(push())


def adapter_body(named: Iterable[tuple[str, torch.Tensor]], config: Mapping[str, Any]) -> bytes:
    """adapter_model.safetensors with the config in its ``adapter_config`` metadata (host copies of the tensors:
    nothing stays exported, so there is no IPC lease)."""
    tensors = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in named}
    return save(tensors, metadata={"format": "pt", ADAPTER_CONFIG_KEY: json.dumps(dict(config), default=_jsonable)})


async def push_adapter(client: AsyncColocdClient, named: Iterable[tuple[str, torch.Tensor]], *,
                       config: Mapping[str, Any], base: str, version: str) -> dict[str, Any]:
    """Push one adapter version; returns once every engine serves ``<base>@<version>`` (the reply's ``adapter``).
    The daemon refuses a reused name or a push over an engine's adapter cap (409), and an engine that serves no
    adapters (409 naming it); a failed push leaves the previous version serving."""
    body = await asyncio.to_thread(adapter_body, list(named), config)
    return await client.push_adapter(base, version, body)


def _jsonable(value: object) -> object:
    # PEFT's configs hold sets (target_modules) and enums (task_type); save_pretrained writes them as lists/values.
    if isinstance(value, set | frozenset):
        return sorted(value)
    return getattr(value, "value", str(value))


def _session_gone(exc: Exception) -> bool:
    """The daemon's 410: the session already ended (what chunks after the failing one are answered)."""
    return isinstance(exc, ColocdHTTPError) and exc.status == 410
