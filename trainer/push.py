"""Streaming weights from the trainer through the daemon: bucket, export, send within a window, commit.

    async with AsyncColocdClient("http://127.0.0.1:7000") as c, WeightPusher(c) as pusher:
        await c.phase("sync", step=1)
        await pusher.push(model.named_parameters(), version="1", step=1)
        await c.phase("rollout", step=1)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..api.client import AsyncColocdClient, ColocdHTTPError, DaemonUnreachable
from ..engines.chunks import dtype_name, plan_chunks
from ..engines.cuda_handles import device_uuid
from ..engines.digest import DigestCache, tensor_digests
from ..policies import AUTO_ORDER, Transport
from .exported import ExportedPart, Producer
from .leases import LEASE_GRACE_S, LeaseBook
from .producer import PRODUCERS, producer_for

__all__ = [
    "DEFAULT_BUCKET_MB",
    "DEFAULT_DEPTH",
    "INLINE_BUCKET_MB",
    "ChunkRecord",
    "PushReport",
    "WeightPusher",
    "auto_bucket_bytes",
    "auto_transport",
    "manifest_of",
]

# The `tuned` preset of `benchmarks.switch` (docs/benchmarks.md), as the daemon's default policy has it: 2 chunks
# in flight of up to 4 GiB, fresh CUDA-IPC buckets on GPU (nothing stays exported through the rollout, where the
# engine's KV cache needs the memory), shared memory on CPU. Two 4 GiB buckets rather than three of 2 GiB: each
# bucket costs the engine an IPC handle opened and closed (~1 ms on an H200), and the engine loads one chunk at a
# time, so a third in flight only queued there (8 GiB staged during the push instead of 6).
DEFAULT_DEPTH = 2
DEFAULT_BUCKET_MB = 4096
# An inline chunk travels in one request body (the daemon's limits.max_body_bytes, 64 MiB by default);
# base64 and the pickle add a third.
INLINE_BUCKET_MB = 32
_MIB = 1 << 20

# transport="auto", by the tensors' device (policies.AUTO_ORDER, less what CPU tensors cannot be exported by):
# what the engines accept decides among them.
_AUTO_ORDER = {"cuda": tuple(t.value for t in AUTO_ORDER),
               "cpu": tuple(t.value for t in AUTO_ORDER if t is not Transport.CUDA_IPC)}


def auto_transport(device: torch.device, accepted: Iterable[str] | None = None) -> str:
    """``transport="auto"``: fresh CUDA-IPC buckets for CUDA tensors, POSIX shared memory for CPU ones, unless
    the engines do not load that: then the first of the device's order they do (``accepted``: the join reply's
    ``transports``; None or empty: no word from the daemon). Against a real SGLang on CPU that is ``inline``."""
    order = _AUTO_ORDER["cuda" if device.type == "cuda" else "cpu"]
    allowed = set(accepted or ())
    return next((t for t in order if t in allowed), order[0]) if allowed else order[0]


def auto_bucket_bytes(transport: str, device: torch.device, depth: int) -> int:
    """``bucket_mb=None``: DEFAULT_BUCKET_MB (INLINE_BUCKET_MB for inline), unless ``depth`` such buckets would
    not fit in what is free where they are staged (GPU memory for CUDA transports, /dev/shm for shm): then what
    fits, >= 1 MiB."""
    bucket = (INLINE_BUCKET_MB if transport == "inline" else DEFAULT_BUCKET_MB) * _MIB
    free = _staging_free_bytes(transport, device)
    if free is not None and depth * bucket > free:
        bucket = max(_MIB, free // depth)
    return bucket


def _staging_free_bytes(transport: str, device: torch.device) -> int | None:
    try:
        if device.type == "cuda" and transport in ("cuda_ipc", "per_tensor"):
            return int(torch.cuda.mem_get_info(device)[0])
        if transport == "shm":
            st = os.statvfs("/dev/shm")
            return int(st.f_bavail * st.f_frsize)
    except (OSError, RuntimeError):  # no /dev/shm, or the CUDA query failed: nothing to bound by
        return None
    return None  # disk is bounded by the filesystem, not checked here

log = logging.getLogger("colocd.trainer")


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


# What one export gives: the chunk, the export's seconds and the digests' share of them (None: the plan is done).
_Made = tuple[ExportedPart, float, float] | None


async def _exported(work: asyncio.Future[_Made]) -> _Made:
    """What an export's thread made. Cancelled meanwhile, the thread runs on regardless: wait for it and release
    what it made, so its buffer does not outlive us and nothing closes the producer while it writes into it."""
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):
            made = await work
            if made is not None:
                made[0].release()
        raise


def _wants_digests(join: dict[str, Any]) -> bool:
    """The join reply asks for each tensor's digest beside its chunk (policy sync.verify; daemon/verify.py)."""
    return bool(join.get("verify", "off") != "off")


@dataclass(slots=True, eq=False)
class FirstExport:
    """A push's first chunk, exported while its session opens (``WeightPusher.open``), under the terms of the
    pusher's last join: its producer and whether digests go with it. The
    stream sends it only where this session's join says the same (``matches``); otherwise it is released once
    its export has ended and the stream exports it again."""

    producer: Producer
    bucket_bytes: int
    digests: bool
    buckets: Iterator[list[tuple[str, torch.Tensor]]]
    work: asyncio.Future[_Made]
    taken: bool = False

    def matches(self, producer: Producer, bucket_bytes: int, join: dict[str, Any]) -> bool:
        return (producer is self.producer and bucket_bytes == self.bucket_bytes and bool(join.get("streams"))
                and _wants_digests(join) == self.digests)

    async def take(self) -> _Made:
        self.taken = True
        return await _exported(self.work)

    async def discard(self) -> None:
        """Release the chunk once its export has ended (nothing touches the producer before that)."""
        if self.taken:
            return
        self.taken = True
        try:
            made = await _exported(self.work)
        except Exception:
            return  # the export failed: nothing was made, and the stream (if any) exports again
        if made is not None:
            made[0].release()


@dataclass(frozen=True, slots=True)
class PushSession:
    """A one-rank session ``WeightPusher.open`` opened and joined: its id, the open reply, and the first chunk
    exported meanwhile (None: none was). ``aclose`` releases that chunk if no stream sent it."""

    session_id: str
    reply: dict[str, Any]
    first: FirstExport | None = None

    async def aclose(self) -> None:
        if self.first is not None:
            await self.first.discard()


@dataclass(frozen=True, slots=True)
class ChunkRecord:
    """One chunk of a stream: bytes, export (flatten) time, round trip to its ack, the engines' load time, and
    the release of its buffer after the ack (the trainer's own work, not control)."""

    seq: int
    nbytes: int
    export_s: float
    round_trip_s: float  # descriptor handed to the sender -> ack back
    load_s: float
    release_s: float = 0.0  # ack back -> buffer released and the window slot free again
    digest_s: float = 0.0  # of export_s: the tensors' digests (verified commits only; engines/digest.py)


class WeightPusher:
    """Buckets ``(name, tensor)`` pairs into chunks and streams them through the daemon.

    At most ``depth`` chunks are exported and in flight at once; each buffer is released only
    after the daemon's ack. On any failure the session is aborted and every buffer released.
    ``transport`` names a producer (``colocd.trainer.producer.PRODUCERS``).
    The defaults are the ``tuned`` preset: ``transport="auto"`` (``auto_transport``: by the tensors'
    device), ``bucket_mb=None`` (``auto_bucket_bytes``: 4 GiB unless free memory says less), depth 2.
    ``from_plan`` follows the daemon's pipeline plan instead.

    Several trainer ranks: rank 0 opens the session with ``ranks=N`` and shares its id (e.g. a
    ``torch.distributed`` broadcast); every rank calls ``stream(session_id, full_tensors)`` with its own
    ``rank``; rank 0 commits once all have returned. ``stream`` first joins the session declaring the rank's
    device (``device_id``; default: the tensors' GPU UUID, or ``cpu:<rank>`` for CPU tensors), and the
    daemon feeds each engine TP rank from the rank on its device (docs/client.md, "layouts"). A rank whose
    device carries no engine rank sends nothing: its ``stream`` only walks the tensors (they may be
    collectives) and returns the chunk count every rank's plan has, with 0 bytes. ``last_join`` is the
    daemon's reply to the last join (``feeds``: the engine TP ranks this rank feeds).

    Every exported buffer is a lease in ``leases`` (``colocd.trainer.leases``). When a stream fails, leases a
    consumer still counts are reclaimed once ``lease_grace_s`` has passed, before the error reaches the caller,
    and the producer's persistent ones at ``aclose()``: the trainer's memory is back either way, also when the
    engine that held the buffer was killed. The rank's lease bytes are reported to the daemon after each stream
    and each reclaim (``colocd_ipc_*`` metrics).
    """

    def __init__(self, client: AsyncColocdClient, *, transport: Transport | str = "auto",
                 bucket_mb: float | None = None, depth: int = DEFAULT_DEPTH, rank: int = 0,
                 device_id: str | None = None,
                 lease_grace_s: float = LEASE_GRACE_S) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if transport != "auto" and transport not in PRODUCERS:
            raise ValueError(f"unknown transport {transport!r}; known: auto, {', '.join(PRODUCERS)}")
        self._client = client
        self._transport = transport
        # None: DEFAULT_BUCKET_MB, shrunk to what is free where the buckets are staged when the first
        # stream starts (auto_bucket_bytes).
        self._bucket_bytes: int | None = None if bucket_mb is None else max(int(bucket_mb * 1024 * 1024), 1)
        self._depth = depth
        self._rank = rank
        self._device_id = device_id
        self.last_join: dict[str, Any] | None = None
        self._producer: Producer | None = None
        self._shape: tuple[str, int] = (transport, self._bucket_bytes or 0)  # (transport, bucket) in use
        self.chunk_log: list[ChunkRecord] = []  # the last stream's chunks, in sequence order
        self.last_join_s = 0.0  # the last join's round trip, seconds
        self.early_export_s = 0.0  # the last stream's first export, where it ran beside the open (FirstExport)
        self.leases = LeaseBook(rank)
        self._lease_grace_s = lease_grace_s
        self._lease_reporter: asyncio.Task[None] | None = None
        self._lease_report_due = False
        self._committed = asyncio.Event()  # clear while ``commit`` is under way
        self._committed.set()
        self._digest_cache: DigestCache = {}  # engines/digest.py weight vectors, per device

    @classmethod
    def from_plan(cls, client: AsyncColocdClient, plan: dict[str, Any], *, rank: int = 0,
                  device_id: str | None = None) -> WeightPusher:
        """A pusher shaped by the pipeline policy: the ``directives["pipeline"]`` of a ``sync`` reply."""
        return cls(client, transport=Transport(plan["transport"]), bucket_mb=int(plan["bucket_bytes"]) / 2**20,
                   depth=int(plan["depth"]), rank=rank, device_id=device_id)

    def device_of(self, named: list[tuple[str, torch.Tensor]]) -> str:
        """The device this rank declares when it joins: ``device_id`` if given, else the first tensor's GPU
        UUID (CUDA), else ``cpu:<rank>``."""
        if self._device_id is not None:
            return self._device_id
        device = next((t.device for _, t in named), torch.device("cpu"))
        if device.type == "cuda":
            return device_uuid(device.index if device.index is not None else torch.cuda.current_device())
        return f"cpu:{self._rank}"

    async def __aenter__(self) -> WeightPusher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Drop the producer and whatever buffers it keeps exported."""
        if self._producer is not None:
            self._producer.close()
            self._producer = None  # the next stream chooses its shape again
            # Its buffers are released; those a live engine still maps stay counted, so torch keeps them until
            # the engine lets go (zeroing the counts would hand memory the engine still reads to the next buffer).
            # Counts are zeroed only on a failed stream, once the grace has passed.
            self.leases.release_all()
            self.leases.collect()
            self._report_leases()
        if self._lease_reporter is not None:
            await self._lease_reporter

    def _report_leases(self) -> None:
        """Tell the daemon this rank's lease bytes, off the stream's path: one report in flight, the latest wins."""
        self._lease_report_due = True
        if self._lease_reporter is None or self._lease_reporter.done():
            self._lease_reporter = self._client.in_background(self._send_lease_reports())

    async def _send_lease_reports(self) -> None:
        # After the call that follows the stream (its commit), not beside it.
        await self._client.idle()
        await self._committed.wait()
        while self._lease_report_due:
            self._lease_report_due = False
            try:
                await self._client.report_leases(self.leases.report())
            except (ColocdHTTPError, DaemonUnreachable) as exc:  # a daemon without the route, or gone
                log.debug("lease report not delivered: %s", exc)
                return

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str,
                   step: int | None = None, partial: bool = False) -> PushReport:
        """Open a session (this process is the only rank) declaring every tensor it will send, stream every
        chunk, commit. ``partial``: these tensors are only some of the model's (the engines' weights must be
        intact); otherwise the daemon refuses a push that does not cover every parameter."""
        t0 = time.perf_counter()
        named = list(named)  # references only: the manifest is declared before the first chunk
        session = await self.open(named, version=version, step=step, partial=partial)
        sid = session.session_id
        try:
            chunks, nbytes = await self.stream(sid, named, session=session)
            commit = await self.commit(session, chunks)
        except BaseException as exc:
            try:
                await self._client.abort(sid)
            except (ColocdHTTPError, DaemonUnreachable):
                pass  # the session may already be failed; the original error matters
            if self.leases.retained_bytes:  # e.g. an engine that died after its acks, before letting go
                await self.leases.settle(f"session {sid} failed: {exc!r}", self._lease_grace_s)
                self._report_leases()
            raise
        finally:
            await session.aclose()
        return PushReport(sid, version, chunks, nbytes, time.perf_counter() - t0, commit)

    async def open(self, named: list[tuple[str, torch.Tensor]], *, version: str, step: int | None = None,
                   partial: bool = False, declare: bool = True) -> PushSession:
        """Open a session whose only rank is this process and join it (``push``'s first part). ``declare``: the
        manifest of ``named`` is declared (``manifest_of``). The caller calls ``aclose`` on what this returns
        (``push`` does).

        From the second stream on, the first chunk is exported meanwhile (``FirstExport``): the open's round trip
        and the engines' begin then hide one export."""
        manifest = manifest_of(named) if declare else None
        device = self.device_of(named)
        first = self._export_first(named)
        try:
            reply = await self._client.open_session(version, step=step, ranks=1, depth=self._depth,
                                                    manifest=manifest, partial=partial)
            sid = str(reply["session_id"])
            t1 = time.perf_counter()
            try:
                await self._join(sid, device)
            except BaseException as exc:
                await self._abort(sid, exc)
                raise
            self.last_join_s = time.perf_counter() - t1
            return PushSession(sid, reply, first)
        except BaseException:
            if first is not None:
                await first.discard()
            raise

    def _export_first(self, named: list[tuple[str, torch.Tensor]]) -> FirstExport | None:
        """The first chunk of ``named``, its export started on a thread under the last join's terms; None before
        the first stream (the producer and its shape are chosen from that join) or where that join sent nothing
        or named no transport this producer has."""
        join, producer = self.last_join, self._producer
        if producer is None or join is None or not join.get("streams") or not named:
            return None
        if self._shape_refused(join.get("transports")):
            return None
        digests = self._digest_cache if _wants_digests(join) else None
        buckets = plan_chunks(iter(named), self._shape[1])
        self.leases.owner = "session (opening)"
        work = asyncio.ensure_future(asyncio.to_thread(self._pull_and_export, producer, buckets, digests))
        return FirstExport(producer, self._shape[1], digests is not None, buckets, work)

    async def commit(self, session: PushSession, chunks: int) -> dict[str, Any]:
        """Commit ``session`` (``push``'s last part)."""
        self._committed.clear()  # before the first await: a lease report pending from the stream waits for it
        try:
            return await self._client.commit(session.session_id, chunks)
        finally:
            self._committed.set()

    def _shape_refused(self, accepted: list[str] | None) -> bool:
        """The engines (a join's ``transports``) do not load the transport ``auto`` chose for the producer."""
        return self._transport == "auto" and bool(accepted) and self._shape[0] not in (accepted or ())

    def transport_for(self, device: torch.device) -> str:
        """The transport a stream of tensors on ``device`` uses: the one given, else ``auto_transport`` over what
        the last join said the engines accept."""
        return str(self._transport) if self._transport != "auto" else auto_transport(device, self._accepted())

    def _accepted(self) -> list[str] | None:
        return None if self.last_join is None else self.last_join.get("transports")

    def _shape_for(self, named: list[tuple[str, torch.Tensor]]) -> tuple[str, int]:
        """This stream's transport and bucket size: the ones given, else chosen from the (first) tensors and
        what the engines accept (the join reply's ``transports``)."""
        device = next((t.device for _, t in named), torch.device("cpu"))
        transport = self._transport if self._transport != "auto" else auto_transport(device, self._accepted())
        if self._bucket_bytes is not None:
            return transport, self._bucket_bytes
        return transport, auto_bucket_bytes(transport, device, self._depth)

    @staticmethod
    def _pull_and_export(producer: Producer, buckets: Iterator[list[tuple[str, torch.Tensor]]],
                         digests: DigestCache | None = None) -> tuple[ExportedPart, float, float] | None:
        """The next bucket, exported (with each tensor's digest, computed on its device, where ``digests`` is a
        cache), the export's seconds and the digests' share of them; None when the plan is done. Runs on a thread.
        An export that fails raises ``_ExportFailed`` (the tensors can still be walked); the iterator's own error is
        raised as it is."""
        bucket = next(buckets, None)
        if bucket is None:
            return None
        t0 = time.perf_counter()
        try:
            chunk = producer.export(bucket)
        except Exception as exc:
            raise _ExportFailed(exc) from exc
        t1 = time.perf_counter()
        if digests is not None:
            try:
                chunk.digests = tensor_digests(bucket, digests)
            except Exception as exc:
                chunk.release()
                raise _ExportFailed(exc) from exc
        t2 = time.perf_counter()
        return chunk, t2 - t0, t2 - t1

    @classmethod
    async def _next_export(cls, producer: Producer, buckets: Iterator[list[tuple[str, torch.Tensor]]],
                           digests: DigestCache | None = None) -> tuple[ExportedPart, float, float] | None:
        # One hop off the event loop per chunk for both (each hop costs ~0.2-0.3 ms on a busy host): pulling a
        # bucket may be a collective and an export may wait on the GPU, while acks
        # of earlier chunks must keep flowing. One export at a time.
        return await _exported(asyncio.ensure_future(asyncio.to_thread(cls._pull_and_export, producer, buckets,
                                                                       digests)))

    async def _join(self, session_id: str, device_id: str) -> None:
        """Join the session on ``device_id`` (``POST .../join``); sets ``last_join``."""
        self.last_join = await self._client.join_session(session_id, rank=self._rank, device_id=device_id)

    async def _join_or_walk(self, session_id: str, device_id: str,
                            remaining: Iterator[tuple[str, torch.Tensor]]) -> None:
        """``_join``; if it fails, abort the session, walk the tensors (as a failed stream does), then raise."""
        t0 = time.perf_counter()
        try:
            await self._join(session_id, device_id)
        except Exception as exc:
            await self._abort(session_id, exc)
            await self._walk(remaining)
            raise
        self.last_join_s = time.perf_counter() - t0

    async def stream(self, session_id: str, named: Iterable[tuple[str, torch.Tensor]], *,
                     session: PushSession | None = None) -> tuple[int, int]:
        """Join the session, then send this rank's part of every chunk; returns (chunks, bytes).

        A rank that feeds no engine rank (the join says ``streams: false``) sends nothing and returns (the chunk
        count of the plan, 0).

        A chunk (or the join) that fails aborts the session at once, naming this rank's error (every other
        rank's stream then fails with it within a chunk); the stream still pulls every tensor left, so the
        ranks' collectives in ``named`` stay matched, and then raises the first error.

        ``session``: what ``open`` opened and joined; the stream then sends without joining again."""
        # The iterator is pulled off the event loop, one item at a time: producing a tensor may be a collective
        # (FSDP's full_tensor, a TP all-gather) that waits for a slower rank, and the acks of this rank's chunks
        # in flight must keep flowing meanwhile (the slower rank's engine may be waiting for them).
        # With a declared device_id the rank joins before producing anything (so a rank blocked in its first
        # gather has already told the daemon its device); else the first tensor says where it is.
        items = iter(named)
        joined = session is not None
        if not joined and self._device_id is not None:
            await self._join_or_walk(session_id, self._device_id, items)
        # A list or tuple is already produced: its first item costs no thread hop (on a VM host one is
        # ~0.2-0.5 ms on the push's critical path).
        produced = isinstance(named, (list, tuple))
        first = next(items, None) if produced else await asyncio.to_thread(next, items, None)
        head = [first] if first is not None else []
        named = itertools.chain(head, items)
        if not joined and self._device_id is None:
            await self._join_or_walk(session_id, self.device_of(head), items)
        assert self.last_join is not None
        early = session.first if session is not None else None
        if not self.last_join["streams"]:
            # No engine rank is on this rank's device: walk the tensors (they may be collectives the other
            # ranks wait for) and count the plan's chunks, sending nothing.
            if early is not None:
                await early.discard()
            self.chunk_log = []
            bucket_bytes = self._shape[1] if self._producer is not None else self._shape_for(head)[1]
            buckets = plan_chunks(named, bucket_bytes)
            count = 0
            while await asyncio.to_thread(next, buckets, None) is not None:
                count += 1
            await self._check_still_open(session_id)
            return count, 0
        return await self._stream(session_id, head, named, first=early)

    async def _stream(self, session_id: str, head: list[tuple[str, torch.Tensor]],
                      named: Iterable[tuple[str, torch.Tensor]], *,
                      first: FirstExport | None = None) -> tuple[int, int]:
        if self._producer is not None and self._shape_refused(self._accepted()):
            if first is not None:
                await first.discard()  # its export ends before the producer it writes into is closed
            self._producer.close()  # the engines changed (e.g. another kind attached): choose again
            self._producer = None
        if self._producer is None:
            # Chosen with the producer and kept with it.
            self._shape = self._shape_for(head)
            self._producer = producer_for(self._shape[0], leases=self.leases)
        producer, bucket_bytes = self._producer, self._shape[1]
        self.early_export_s = 0.0
        join = self.last_join or {}
        if first is not None and not first.matches(producer, bucket_bytes, join):
            await first.discard()  # made under other terms than this join's: export it again
        if first is None or first.taken:
            first = None
        self.leases.owner = f"session {session_id}"
        window = asyncio.Semaphore(self._depth)
        tasks: list[asyncio.Task[None]] = []
        records: dict[int, ChunkRecord] = {}
        nbytes = 0
        sent = 0  # chunks exported and handed to a sender

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
            t0 = time.perf_counter()
            acked_at = t0
            try:
                ack = await self._client.send_chunk(session_id, seq=seq, rank=self._rank, chunk=chunk)
                acked_at = time.perf_counter()
            except Exception as exc:
                failed(exc)
                raise
            finally:
                chunk.release()  # after the ack (or the failure): the engines are done with it
                window.release()
            released_at = time.perf_counter()
            records[seq] = ChunkRecord(seq, chunk.nbytes, export_s, acked_at - t0, float(ack["load_s"]),
                                       released_at - acked_at, digest_s)

        buckets = plan_chunks(named, bucket_bytes) if first is None else first.buckets
        results: list[BaseException | None] = []
        raised: BaseException | None = None
        # The daemon's commit compares these with the engines' (policy sync.verify; daemon/verify.py).
        digests = self._digest_cache if _wants_digests(join) else None
        try:
            while not failure:
                await window.acquire()
                if sent >= self._depth:
                    # Acks may come back out of order (a later chunk's request can overtake an earlier one on
                    # another connection); the daemon counts the window from the first chunk it has not received,
                    # so chunk n goes only once chunk n - depth (and, in turn, every earlier one) has ended.
                    await asyncio.wait({tasks[sent - self._depth]})
                if failure:  # a chunk failed while this waited for a slot: pull nothing more here
                    window.release()
                    break
                try:
                    if first is not None and not first.taken:
                        made = await first.take()
                        self.early_export_s = made[1] if made is not None else 0.0
                    else:
                        made = await self._next_export(producer, buckets, digests)
                except _ExportFailed as exc:
                    window.release()
                    failed(exc.error)
                    break
                if made is None:
                    window.release()
                    break
                chunk, export_s, digest_s = made
                if failure:
                    chunk.release()
                    window.release()
                    break  # a chunk failed: the session is over, send nothing more
                nbytes += chunk.nbytes
                tasks.append(asyncio.create_task(send(sent, chunk, export_s, digest_s)))
                sent += 1
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
            if error is not None:
                # Every buffer is released; what a consumer still counts (one that died holding it, or that
                # never got to rebuild it) is reclaimed after the grace, before the error goes on.
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
        return sent, nbytes

    async def _check_still_open(self, session_id: str) -> None:
        """A rank that sent nothing learns at the end of its walk whether the session ended meanwhile (another
        rank failed it): it raises the session's error, as the streaming ranks do."""
        session = await self._client.session(session_id)
        if session.get("state") != "open":
            raise ColocdHTTPError(410, {"error": "SessionGone", "session_id": session_id,
                                        "session_state": session.get("state"),
                                        "message": f"session {session_id} {session.get('state')}: "
                                                   f"{session.get('error')}"})

    async def _abort(self, session_id: str, error: BaseException) -> None:
        """Abort the session naming this rank's error, so every other rank's wait ends now with it (best
        effort: a session another rank aborted first is gone already)."""
        detail = error.body.get("message", str(error)) if isinstance(error, ColocdHTTPError) else str(error)
        reason = f"rank {self._rank} stopped: {type(error).__name__}: {detail}"
        try:
            await self._client.abort(session_id, reason)
        except (ColocdHTTPError, DaemonUnreachable) as exc:
            log.debug("abort of session %s after rank %d's failure: %s", session_id, self._rank, exc)

    @staticmethod
    async def _walk(remaining: Iterable[object]) -> None:
        """Pull every item left, sending nothing: producing one may be a collective (FSDP's full_tensor, a TP
        all-gather) that the other ranks run too, so every rank walks all of its tensors, failed or not."""
        def walk() -> None:
            for _ in remaining:
                pass

        try:
            await asyncio.to_thread(walk)
        except Exception as exc:  # the stream's first error is what the caller needs
            log.warning("walking the tensors left after a failed stream raised: %s", exc)


def _session_gone(exc: Exception) -> bool:
    """The daemon's 410: the session already ended (what chunks after the failing one are answered)."""
    return isinstance(exc, ColocdHTTPError) and exc.status == 410


class _ExportFailed(Exception):
    """A bucket's export failed (the tensors themselves can still be produced, so the stream walks them)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error
