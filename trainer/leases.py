"""IPC lease accounting: every buffer the trainer exports (a ``cuda_ipc`` bucket, an ``shm`` segment) is a lease,
``exported`` while a chunk in flight holds it, ``retained`` while torch keeps it for a consumer's count, then
``freed`` (the consumer let go) or ``reclaimed``.

Torch keeps a shared CUDA storage alive while its consumers' int64 slots in a shared-memory ref-counter file are
nonzero (torch/csrc/CudaIPCTypes.cpp); an engine killed before it dropped the payload never decrements, and the
block stays until the trainer exits. ``reclaim`` zeroes a released lease's slots (a late decrement hits a slot torch
never hands out again) and collects; never for a storage a trainer tensor still holds (a live consumer's decrement
would wrap torch's unsigned counter), and only after a failed stream or a closed producer, past ``settle``'s grace.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from enum import StrEnum

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["LEASE_GRACE_S", "REF_COUNTER_SLOTS", "Lease", "LeaseBook", "LeaseState", "RefCounter"]

log = logging.getLogger("colocd.trainer.leases")

# A live engine drops a payload right after its load, well inside this; a dead one never does. The trainer's
# memory must be back within 5 s of an engine killed mid-push (docs/runbook.md).
LEASE_GRACE_S = 1.0
_POLL_S = 0.02

# torch's ref-counter file (CUDA_IPC_REF_COUNTER_FILE_SIZE int64 slots) behind RefcountedMapAllocator's header
# (map_alloc_alignment bytes holding the mapping's own refcount; ATen/MapAllocator.cpp).
REF_COUNTER_SLOTS = 10000
_HEADER_BYTES = 64
_SLOT_BYTES = 8
_FILE_BYTES = _HEADER_BYTES + REF_COUNTER_SLOTS * _SLOT_BYTES
_SHM_DIR = "/dev/shm"


@dataclass(frozen=True, slots=True)
class RefCounter:
    """One consumer's count for one CUDA share: slot ``offset`` of torch's ref-counter file ``handle``
    (a POSIX shared-memory name such as ``/torch_1234_5678_0``)."""

    handle: str
    offset: int
    directory: str = _SHM_DIR

    def _slot(self, write: bytes | None = None) -> int:
        """The count, or 0 after writing ``write`` over it, or where torch removed the file; a file of another
        layout is refused."""
        if not 0 <= self.offset < REF_COUNTER_SLOTS:
            raise ValueError(f"ref-counter slot {self.offset} is outside torch's {REF_COUNTER_SLOTS}")
        path = os.path.join(self.directory, self.handle.lstrip("/"))
        try:
            fd = os.open(path, (os.O_RDONLY if write is None else os.O_RDWR) | os.O_NOFOLLOW)
        except FileNotFoundError:
            return 0
        try:
            if (size := os.fstat(fd).st_size) != _FILE_BYTES:
                raise RuntimeError(f"torch ref-counter file {path} is {size} bytes, not {_FILE_BYTES}: "
                                   "its layout changed; IPC leases cannot be reclaimed")
            at = _HEADER_BYTES + self.offset * _SLOT_BYTES
            if write is not None:
                os.pwrite(fd, write, at)
                return 0
            return int.from_bytes(os.pread(fd, _SLOT_BYTES, at), "little", signed=True)
        finally:
            os.close(fd)

    def read(self) -> int:
        return self._slot()

    def zero(self) -> None:
        self._slot(bytes(_SLOT_BYTES))


class LeaseState(StrEnum):
    EXPORTED = "exported"
    RETAINED = "retained"
    FREED = "freed"
    RECLAIMED = "reclaimed"


@dataclass(slots=True, eq=False)
class Lease:
    """One exported buffer. ``counters``: the consumers' counts torch keeps it alive for (CUDA shares only)."""

    id: int
    transport: str
    nbytes: int
    owner: str
    counters: tuple[RefCounter, ...]
    storages: tuple[StorageWeakRef, ...] = ()  # the exported storages: does a trainer tensor still hold one?
    state: LeaseState = LeaseState.EXPORTED
    released_at: float | None = None


def ipc_collect() -> None:
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()  # type: ignore[no-untyped-call]


class LeaseBook:
    """The leases of one trainer rank's producers: ``export`` when a buffer goes out, ``release`` when the
    producer lets go, ``settle`` after a failed stream or a closed producer (``collect``: torch's ipc_collect)."""

    def __init__(self, rank: int = 0, *, collect: Callable[[], object] = ipc_collect) -> None:
        self.rank = rank
        self.owner = "-"  # what new leases belong to: the pusher sets the session id of each stream
        self._collect = collect
        self._ids = itertools.count(1)
        self._live: dict[int, Lease] = {}  # exported or retained
        self.reclaimed = 0  # leases reclaimed, in this book's lifetime
        self.reclaimed_bytes = 0

    def export(self, transport: str, nbytes: int, counters: Iterable[RefCounter] = (),
               owner: str | None = None, buffers: Iterable[torch.Tensor] = ()) -> Lease:
        """A new exported lease; ``buffers``: the tensors whose storages were shared (weakly referenced)."""
        storages = tuple(StorageWeakRef(t.untyped_storage()) for t in buffers)  # type: ignore[no-untyped-call]
        lease = Lease(next(self._ids), str(transport), int(nbytes), owner or self.owner, tuple(counters), storages)
        self._live[lease.id] = lease
        return lease

    def release(self, lease: Lease) -> None:
        """The producer dropped its last reference to the buffer: freed, or retained while a consumer counts."""
        if lease.state is not LeaseState.EXPORTED:
            return
        lease.released_at = time.monotonic()
        # Nothing but the producer held it (an unlinked shm segment), or a trainer tensor still holds it (its
        # memory is the trainer's, not torch's limbo).
        if not lease.counters or any(not s.expired() for s in lease.storages):  # type: ignore[no-untyped-call]
            self._end(lease, LeaseState.FREED)
            return
        lease.state = LeaseState.RETAINED
        self.collect()

    def release_all(self) -> None:
        """Every exported lease is released: its producer is gone."""
        for lease in list(self._live.values()):
            self.release(lease)

    def collect(self) -> int:
        """Frees, in torch and here, every retained lease whose consumers let go; returns the bytes still retained."""
        retained = self.leases(LeaseState.RETAINED)
        if not retained:
            return 0
        # Counts first, then torch's collect: a lease read as 0 is one torch frees in this very collect.
        done = [lease for lease in retained if all(c.read() <= 0 for c in lease.counters)]
        self._collect()
        for lease in done:
            self._end(lease, LeaseState.FREED)
        return self.retained_bytes

    def reclaim(self, reason: str) -> int:
        """Zero the consumers' counts of every retained lease and let torch free them; returns the bytes."""
        retained = self.leases(LeaseState.RETAINED)
        for lease in retained:
            for counter in lease.counters:
                counter.zero()
        if retained:
            self._collect()
        nbytes = 0
        for lease in retained:
            self._end(lease, LeaseState.RECLAIMED)
            nbytes += lease.nbytes
            held = time.monotonic() - (lease.released_at or time.monotonic())
            log.warning("reclaimed IPC lease %d (%s, %d bytes, owner %s, rank %d), still counted by a consumer "
                    "%.2fs after its release: %s", lease.id, lease.transport, lease.nbytes, lease.owner, self.rank,
                    held, reason)
        self.reclaimed += len(retained)
        self.reclaimed_bytes += nbytes
        return nbytes

    async def settle(self, reason: str, grace_s: float = LEASE_GRACE_S) -> int:
        """After a failure or a close: wait up to ``grace_s`` for retained leases' consumers to let go, then
        ``reclaim`` what is left; returns the bytes reclaimed (0 when every consumer let go in time)."""
        deadline = time.monotonic() + grace_s
        # Polling another process's count (no event can cross processes), bounded by the grace.
        while self.collect() and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(_POLL_S)
        return self.reclaim(reason)

    def leases(self, state: LeaseState | None = None) -> list[Lease]:
        return [lease for lease in self._live.values() if state is None or lease.state is state]

    def _end(self, lease: Lease, state: LeaseState) -> None:
        lease.state = state
        del self._live[lease.id]

    @property
    def exported_bytes(self) -> int:
        return sum(lease.nbytes for lease in self.leases(LeaseState.EXPORTED))

    @property
    def retained_bytes(self) -> int:
        return sum(lease.nbytes for lease in self.leases(LeaseState.RETAINED))

    def report(self) -> dict[str, int]:
        """What the trainer tells the daemon (``POST /v1/trainer/leases``): this rank's bytes now, and totals."""
        return {"rank": self.rank, "exported_bytes": self.exported_bytes, "retained_bytes": self.retained_bytes,
                "reclaimed": self.reclaimed, "reclaimed_bytes": self.reclaimed_bytes}
