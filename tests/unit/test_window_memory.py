"""The paused window's memory: a sampled maximum, and the switch summary's memory-neutral verdict built on it."""

from __future__ import annotations

import threading
import time

from benchmarks.switch import StepRecord, _summary, _targets
from benchmarks.window_memory import PeakSampler

GIB = 1 << 30


class _Level:
    """A memory reading the test sets; counts how often the sampler read it."""

    def __init__(self, value: int) -> None:
        self.value = value
        self.reads = 0
        self._lock = threading.Lock()

    def read(self) -> dict[str, int | None]:
        with self._lock:
            self.reads += 1
            return {"trainer_nvml_bytes": self.value, "engine_nvml_bytes": None}

    def hold(self, value: int) -> None:
        """Set ``value`` and return once the sampler has read it (two reads later: one may have begun before)."""
        self.value = value
        seen = self.reads
        deadline = time.monotonic() + 10
        while self.reads < seen + 2:
            assert time.monotonic() < deadline, "the sampler stopped reading"
            time.sleep(0.001)


def test_the_sampler_catches_a_peak_that_neither_defined_point_sees_and_splits_call_from_window() -> None:
    level = _Level(1)
    sampler = PeakSampler(level.read, interval_s=0.001)
    sampler.start()
    level.hold(9)  # the tail of an offload beside the rollout call
    level.hold(2)
    sampler.mark()  # the rollout reply: the window starts
    level.hold(5)  # a background destroy still holding memory in the window
    level.value = 3
    peaks = sampler.stop()

    assert peaks.call["trainer_nvml_bytes"] == 9
    assert peaks.window["trainer_nvml_bytes"] == 5
    assert peaks.call["engine_nvml_bytes"] is None and peaks.window["engine_nvml_bytes"] is None
    assert peaks.samples > peaks.window_samples >= 3


def _step(step: int, *, start: int, settled: int | None, peak: int | None) -> StepRecord:
    rec = StepRecord(step, warmup=False, switch_s=1.0)
    rec.memory = {"trainer_nvml_bytes": start}
    if settled is not None:
        rec.memory_settled = {"trainer_nvml_bytes": settled}
    rec.memory_peak = {"window": {"trainer_nvml_bytes": peak}, "call": {"trainer_nvml_bytes": peak},
                       "window_samples": 4}
    return rec


def test_the_memory_neutral_verdict_uses_the_window_maximum_not_the_settled_reading() -> None:
    seed = _summary("seed-baseline", [_step(1, start=GIB, settled=None, peak=GIB)], 1.0, 1.0)
    # Starts and settles at the seed's level + 0.1 GiB, but held 4 GiB more in between: not memory-neutral.
    tuned = _summary("tuned", [_step(2, start=int(1.1 * GIB), settled=int(1.1 * GIB), peak=5 * GIB)], 1.0, 1.0)
    settled = _summary("tuned-split", [_step(3, start=int(1.1 * GIB), settled=int(1.1 * GIB),
                                               peak=int(1.2 * GIB))], 1.0, 1.0)

    assert tuned["trainer_window_peak_gib"] == 5.0
    targets = _targets([seed, tuned, settled])
    assert targets["memory_neutral"] == {"seed-baseline": True, "tuned": False, "tuned-split": True}
    assert targets["paused_memory_within_0_25_gib"] is False
    assert targets["paused_window_max_gib"]["tuned"] == 5.0


def test_without_nvml_the_verdict_is_unknown_not_a_pass() -> None:
    def blind(step: int) -> StepRecord:
        rec = StepRecord(step, warmup=False, switch_s=1.0)
        rec.memory_peak = {"window": {"trainer_nvml_bytes": None}, "window_samples": 3}
        return rec

    targets = _targets([_summary("seed-baseline", [blind(1)], 1.0, 1.0), _summary("tuned", [blind(2)], 1.0, 1.0)])
    assert targets["memory_neutral"] == {"seed-baseline": None, "tuned": None}
    assert targets["paused_memory_within_0_25_gib"] is None
