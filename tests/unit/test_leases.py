"""IPC leases: states, the consumer counts read from (and zeroed in) torch's ref-counter file, settle and reclaim.

torch's file is stood for by one of the same layout (a 64-byte header, then 10000 int64 slots) in a temporary
directory; ``collect`` stands for ``torch.cuda.ipc_collect`` and records when it ran. The same code reads
torch's real file on a GPU (tests/gpu/test_ipc_leases.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest
import torch

from colocd.trainer.leases import REF_COUNTER_SLOTS, LeaseBook, LeaseState, RefCounter

HEADER = 64


def ref_file(directory: Path, name: str = "torch_1_2_0") -> str:
    (directory / name).write_bytes(bytes(HEADER + 8 * REF_COUNTER_SLOTS))
    return "/" + name


def set_count(directory: Path, handle: str, offset: int, value: int) -> None:
    with open(directory / handle.lstrip("/"), "r+b") as f:
        f.seek(HEADER + 8 * offset)
        f.write(value.to_bytes(8, "little", signed=True))


class Collects:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1


def test_a_counter_reads_and_zeroes_its_own_slot_of_the_file(tmp_path: Path) -> None:
    handle = ref_file(tmp_path)
    set_count(tmp_path, handle, 3, 1)
    set_count(tmp_path, handle, 4, 1)
    counter = RefCounter(handle, 3, str(tmp_path))
    assert counter.read() == 1
    counter.zero()
    assert counter.read() == 0
    assert RefCounter(handle, 4, str(tmp_path)).read() == 1  # its neighbour's count is untouched


def test_a_counter_whose_file_torch_removed_reads_zero(tmp_path: Path) -> None:
    counter = RefCounter("/torch_9_9_0", 0, str(tmp_path))
    assert counter.read() == 0
    counter.zero()  # nothing to do, no error
    assert not os.listdir(tmp_path)


def test_a_file_of_another_layout_is_refused_not_written(tmp_path: Path) -> None:
    (tmp_path / "torch_1_2_0").write_bytes(bytes(100))
    with pytest.raises(RuntimeError, match="layout changed"):
        RefCounter("/torch_1_2_0", 0, str(tmp_path)).zero()
    assert (tmp_path / "torch_1_2_0").read_bytes() == bytes(100)


def test_a_lease_nobody_counts_is_freed_at_its_release() -> None:
    book = LeaseBook(collect=Collects())
    lease = book.export("shm", 100)
    assert (book.exported_bytes, book.retained_bytes) == (100, 0)
    book.release(lease)
    assert lease.state is LeaseState.FREED
    assert book.report() == {"rank": 0, "exported_bytes": 0, "retained_bytes": 0, "reclaimed": 0,
                             "reclaimed_bytes": 0}


def test_a_released_lease_stays_retained_while_its_consumer_counts_and_is_freed_once_it_lets_go(
        tmp_path: Path) -> None:
    handle = ref_file(tmp_path)
    set_count(tmp_path, handle, 0, 1)
    collect = Collects()
    book = LeaseBook(rank=2, collect=collect)
    lease = book.export("cuda_ipc", 1 << 20, [RefCounter(handle, 0, str(tmp_path))], owner="session s1")
    book.release(lease)
    assert lease.state is LeaseState.RETAINED
    assert (book.exported_bytes, book.retained_bytes) == (0, 1 << 20)
    set_count(tmp_path, handle, 0, 0)  # the engine dropped the storage it rebuilt
    assert book.collect() == 0
    assert lease.state is LeaseState.FREED and collect.calls >= 1
    assert book.reclaimed == 0


async def test_settle_reclaims_what_a_dead_consumer_still_counts_after_the_grace_and_says_so(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    handle = ref_file(tmp_path)
    for slot in (0, 1):  # one bucket shared twice (two consumers' counts), both never let go
        set_count(tmp_path, handle, slot, 1)
    collect = Collects()
    book = LeaseBook(rank=1, collect=collect)
    lease = book.export("cuda_ipc", 4096, [RefCounter(handle, 0, str(tmp_path)), RefCounter(handle, 1, str(tmp_path))],
                        owner="session s7")
    book.release(lease)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with caplog.at_level(logging.INFO, logger="colocd.trainer.leases"):
        reclaimed = await book.settle("session s7 failed: engine ref0 died", grace_s=0.2)
    assert loop.time() - started >= 0.2  # live consumers had their grace
    assert reclaimed == 4096 and lease.state is LeaseState.RECLAIMED
    assert RefCounter(handle, 0, str(tmp_path)).read() == 0 and RefCounter(handle, 1, str(tmp_path)).read() == 0
    assert book.report() == {"rank": 1, "exported_bytes": 0, "retained_bytes": 0, "reclaimed": 1,
                             "reclaimed_bytes": 4096}
    line = next(r.getMessage() for r in caplog.records if "reclaimed IPC lease" in r.getMessage())
    assert "4096 bytes" in line and "session s7" in line and "engine ref0 died" in line


async def test_settle_ends_without_reclaiming_once_a_live_consumer_lets_go(tmp_path: Path) -> None:
    handle = ref_file(tmp_path)
    set_count(tmp_path, handle, 5, 1)
    book = LeaseBook(collect=Collects())
    lease = book.export("cuda_ipc", 10, [RefCounter(handle, 5, str(tmp_path))])
    book.release(lease)
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, set_count, tmp_path, handle, 5, 0)  # the engine finishes its load
    started = loop.time()
    assert await book.settle("stream failed", grace_s=30) == 0
    assert loop.time() - started < 5
    assert lease.state is LeaseState.FREED and book.reclaimed == 0


def test_exported_leases_are_never_reclaimed(tmp_path: Path) -> None:
    handle = ref_file(tmp_path)
    set_count(tmp_path, handle, 0, 1)
    book = LeaseBook(collect=Collects())
    lease = book.export("cuda_ipc", 64, [RefCounter(handle, 0, str(tmp_path))], owner="session s")
    assert book.reclaim("stream failed") == 0  # the producer still holds it: a chunk in flight
    assert lease.state is LeaseState.EXPORTED and RefCounter(handle, 0, str(tmp_path)).read() == 1
    book.release_all()
    assert book.reclaim("the pusher closed its producer") == 64


async def test_a_storage_a_trainer_tensor_still_holds_is_never_reclaimed(tmp_path: Path) -> None:
    # A per_tensor share of a trainer parameter: torch does not hold it for the consumer, so nothing is
    # stranded, and zeroing a count a live engine decrements later would strand it for good once freed.
    handle = ref_file(tmp_path)
    set_count(tmp_path, handle, 0, 1)
    parameter = torch.zeros(16)
    book = LeaseBook(collect=Collects())
    lease = book.export("per_tensor", 64, [RefCounter(handle, 0, str(tmp_path))], owner="session s",
                        buffers=[parameter])
    book.release_all()
    assert lease.state is LeaseState.FREED and book.retained_bytes == 0
    assert await book.settle("the pusher closed its producer", grace_s=0) == 0
    assert RefCounter(handle, 0, str(tmp_path)).read() == 1  # the engine's count, untouched


async def test_a_released_buffer_no_tensor_holds_is_retained_and_reclaimed(tmp_path: Path) -> None:
    handle = ref_file(tmp_path)
    set_count(tmp_path, handle, 0, 1)
    bucket = torch.zeros(16)
    book = LeaseBook(collect=Collects())
    lease = book.export("cuda_ipc", 64, [RefCounter(handle, 0, str(tmp_path))], buffers=[bucket])
    del bucket  # the producer let go: only torch's limbo (on a GPU) would hold it now
    book.release(lease)
    assert lease.state is LeaseState.RETAINED
    assert await book.settle("stream failed", grace_s=0) == 64
    assert RefCounter(handle, 0, str(tmp_path)).read() == 0
