"""How the daemon decides a release has landed on the GPU: NVML readings scripted by a stand-in NVML
and a scripted clock (each reading takes 1 ms), so every criterion is checked without a GPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from colocd.daemon.memory import GpuReading, NvmlProbe, Settled
from colocd.daemon.states import EngineRecord
from colocd.daemon.worker import EngineHandle, expected_release_bytes
from colocd.engines.base import MemoryReport, MemoryTag
from colocd.errors import MemoryNotConfirmed

GIB = 1 << 30
TOTAL = 140 * GIB


class ScriptedNvml:
    """GPU 0's used bytes follow ``script``, one value per reading, then stay at the last one; each
    reading advances the clock by 1 ms (a fast NVML poll)."""

    def __init__(self, script: list[int]) -> None:
        self.script = list(script)
        self.reads = 0
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        used = self.script[min(self.reads, len(self.script) - 1)]
        self.reads += 1
        self.now += 0.001
        return SimpleNamespace(used=used, free=TOTAL - used, total=TOTAL)


def _probe(script: list[int]) -> tuple[NvmlProbe, ScriptedNvml]:
    nvml = ScriptedNvml(script)
    return NvmlProbe(nvml, clock=nvml.clock), nvml


BEFORE = {"0": GpuReading("0", 40 * GIB, TOTAL - 40 * GIB, TOTAL)}


async def test_with_the_expected_bytes_known_the_first_reading_that_shows_them_ends_the_wait() -> None:
    probe, _ = _probe([40 * GIB, 20 * GIB, 10 * GIB])
    confirmation = await probe.confirm_release([0], BEFORE, expected_bytes=20 * GIB, timeout_s=5)
    assert confirmation.criterion is Settled.EXPECTED
    assert confirmation.polls == 2
    assert confirmation.freed_bytes == {"0": 20 * GIB}  # what NVML showed then, not the expectation
    assert confirmation.waited_s == pytest.approx(0.002)


async def test_without_an_expectation_a_drop_must_stay_put_for_the_settle_window() -> None:
    # A release landing in two steps: the first plateau lasts 10 ms, shorter than the window.
    probe, _ = _probe([40 * GIB] + [30 * GIB] * 10 + [12 * GIB])
    confirmation = await probe.confirm_release([0], BEFORE, expected_bytes=None, timeout_s=5, settle_s=0.02)
    assert confirmation.criterion is Settled.STABLE
    assert confirmation.freed_bytes == {"0": 28 * GIB}
    assert confirmation.waited_s >= 0.011 + 0.02


async def test_an_engine_that_frees_less_than_expected_settles_on_stability_and_reports_what_it_freed() -> None:
    probe, _ = _probe([40 * GIB, 35 * GIB])
    confirmation = await probe.confirm_release([0], BEFORE, expected_bytes=8 * GIB, timeout_s=5, settle_s=0.02)
    assert confirmation.criterion is Settled.STABLE
    assert confirmation.freed_bytes == {"0": 5 * GIB}


async def test_memory_that_never_shows_free_is_an_error_naming_the_gpus_and_the_expectation() -> None:
    probe, _ = _probe([40 * GIB])
    with pytest.raises(MemoryNotConfirmed, match=r"GPUs \['0'\] freed 0 bytes .* expected 1073741824"):
        await probe.confirm_release([0], BEFORE, expected_bytes=GIB, timeout_s=0.05)


def _engine() -> EngineHandle:
    return EngineHandle(adapter=SimpleNamespace(), config=SimpleNamespace(gpus=[0], gpu_uuids=None),
                        state=EngineRecord(name="e0"))


TAGS = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE)
REPORT = MemoryReport({MemoryTag.WEIGHTS: 16 * GIB, MemoryTag.KV_CACHE: 60 * GIB, MemoryTag.CUDA_GRAPH: GIB})


def test_the_expectation_is_the_smaller_of_the_engines_report_and_the_last_release_of_the_same_tags() -> None:
    engine = _engine()
    assert expected_release_bytes(engine, TAGS, None) == (None, None)
    assert expected_release_bytes(engine, TAGS, REPORT) == (76 * GIB, "engine_report")
    engine.learned_release_bytes[frozenset(TAGS)] = 75 * GIB  # the allocator kept a little last time
    assert expected_release_bytes(engine, TAGS, REPORT) == (75 * GIB, "last_release")
    assert expected_release_bytes(engine, TAGS, None) == (75 * GIB, "last_release")
    # Another set of tags has not been seen released: only the report speaks for it.
    assert expected_release_bytes(engine, (MemoryTag.WEIGHTS,), REPORT) == (16 * GIB, "engine_report")
