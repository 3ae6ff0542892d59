"""The trainer's GPU memory over a whole paused window, not at two instants.

    sampler = PeakSampler(lambda: nvml.read(pids), interval_s=0.002)
    sampler.start()          # just before the trainer posts rollout
    ... reply = await agent.rollout(step) ...
    sampler.mark()           # the rollout reply: the engines generate from here on (the paused window)
    ... the rollout ...
    peaks = sampler.stop()   # just before the next train

A thread reads every ``interval_s`` and keeps the largest value per key; ``start``, ``mark`` and ``stop``
also read once themselves, so the three defined points are always in the maxima even where the thread
got no turn. ``peaks.call`` covers everything from ``start`` (the engines' KV resume included, which
the daemon admits beside trainer memory still being freed only when NVML shows the room); ``peaks.window``
covers ``mark`` to ``stop``, the window the memory-neutral target is about. A reading of None (no NVML)
is skipped; a key never read stays None.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = ["PeakSampler", "Peaks"]

Reading = Mapping[str, int | None]


@dataclass
class Peaks:
    """Maxima per key from ``start`` (``call``) and from ``mark`` (``window``), and how many readings each."""

    call: dict[str, int | None] = field(default_factory=dict)
    window: dict[str, int | None] = field(default_factory=dict)
    samples: int = 0
    window_samples: int = 0
    interval_s: float = 0.0

    def to_dict(self) -> dict[str, object]:
        return {"call": dict(self.call), "window": dict(self.window), "samples": self.samples,
                "window_samples": self.window_samples, "interval_s": self.interval_s}


class PeakSampler:
    """Reads ``read()`` in a thread every ``interval_s`` between ``start`` and ``stop``; keeps the maxima."""

    def __init__(self, read: Callable[[], Reading], interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self._read = read
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peaks = Peaks(interval_s=interval_s)
        self._marked = False

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the sampler runs already")
        self._take()
        self._thread = threading.Thread(target=self._run, name="colocd-window-memory", daemon=True)
        self._thread.start()

    def mark(self) -> None:
        """From now on readings count for the window as well."""
        with self._lock:
            self._marked = True
        self._take()

    def stop(self) -> Peaks:
        if self._thread is None:
            raise RuntimeError("the sampler was not started")
        self._stop.set()
        self._thread.join()
        self._take()
        return self._peaks

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._take()

    def _take(self) -> None:
        reading = self._read()
        with self._lock:
            peaks = self._peaks
            peaks.samples += 1
            _fold(peaks.call, reading)
            if self._marked:
                peaks.window_samples += 1
                _fold(peaks.window, reading)


def _fold(into: dict[str, int | None], reading: Reading) -> None:
    for key, value in reading.items():
        old = into.get(key)
        if value is not None and (old is None or value > old):
            into[key] = value
        elif key not in into:
            into[key] = None
