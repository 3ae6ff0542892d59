"""Proof that memory moved: NVML readings of the engines' GPUs, polled until a release has landed.

An engine's HTTP reply to a release is not proof (SGLang replies before the pages are unmapped:
THUDM/slime#579), so the trainer is let in only once NVML shows the bytes free.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ..errors import MemoryNotConfirmed

__all__ = ["GpuReading", "NvmlProbe", "ReleaseConfirmation", "Settled", "open_probe"]


@dataclass(frozen=True, slots=True)
class GpuReading:
    gpu: str  # index as the operator configured it, or UUID
    used_bytes: int
    free_bytes: int
    total_bytes: int


class Settled(StrEnum):
    """Which criterion let a release confirmation end."""

    EXPECTED = "expected"  # the GPUs freed at least the bytes the release was expected to free
    STABLE = "stable"  # the drop stopped moving for the settle window (expectation unknown or not reached)


@dataclass(frozen=True, slots=True)
class ReleaseConfirmation:
    """Freed bytes per GPU as NVML saw them, how long it took for them to show, and why it ended."""

    freed_bytes: dict[str, int]
    waited_s: float
    criterion: Settled
    polls: int


class NvmlProbe:
    """Reads used/free memory of GPUs through NVML (nvidia-ml-py). One per daemon; closed with it."""

    def __init__(self, nvml: Any, *, clock: Callable[[], float] = time.perf_counter) -> None:
        self._nvml = nvml
        self._clock = clock  # injectable so a test can script how long a drop stays put
        self._uuids: dict[str, str] = {}

    def _handle(self, gpu: int | str) -> Any:
        n = self._nvml
        return n.nvmlDeviceGetHandleByUUID(gpu) if isinstance(gpu, str) else n.nvmlDeviceGetHandleByIndex(gpu)

    def read(self, gpu: int | str) -> GpuReading:
        info = self._nvml.nvmlDeviceGetMemoryInfo(self._handle(gpu))
        return GpuReading(str(gpu), int(info.used), int(info.free), int(info.total))

    def uuid(self, gpu: int | str) -> str:
        """The GPU's UUID (``GPU-...``); "" where NVML cannot say."""
        key = str(gpu)
        if key not in self._uuids:
            try:
                raw = self._nvml.nvmlDeviceGetUUID(self._handle(gpu))
                self._uuids[key] = raw.decode() if isinstance(raw, bytes) else str(raw)
            except Exception:  # an old driver or a vGPU without the query: the index still names it
                return ""
        return self._uuids[key]

    def read_all(self, gpus: list[int | str]) -> dict[str, GpuReading]:
        return {str(g): self.read(g) for g in gpus}

    def processes(self, gpu: int | str) -> dict[int, int]:
        """Bytes NVML attributes to each compute process (pid) on ``gpu``; empty where it cannot (MIG, vGPU)."""
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle(gpu))
        except Exception:  # NVMLError_NoPermission / NotSupported: nothing to attribute
            return {}
        out: dict[int, int] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is not None:
                out[int(p.pid)] = out.get(int(p.pid), 0) + int(used)
        return out

    async def confirm_release(self, gpus: list[int | str], before: dict[str, GpuReading], *,
                              expected_bytes: int | None, timeout_s: float, poll_s: float = 0.001,
                              settle_s: float = 0.05) -> ReleaseConfirmation:
        """Poll NVML until the release landed: ``expected`` once used memory dropped by ``expected_bytes`` in all
        (the engine's report, or NVML's drop when these tags were last released), ``stable`` once a positive drop
        held for ``settle_s`` (no or an unmet expectation); no positive drop within ``timeout_s``: not confirmed."""
        t0 = self._clock()
        deadline = t0 + timeout_s
        last: dict[str, int] | None = None
        since = t0  # when the drop last changed
        polls = 0
        while True:
            now = self.read_all(gpus)
            polls += 1
            read_at = self._clock()
            freed = {g: before[g].used_bytes - now[g].used_bytes for g in now}
            total = sum(freed.values())
            if expected_bytes is not None and total >= expected_bytes:
                return ReleaseConfirmation(freed, read_at - t0, Settled.EXPECTED, polls)
            if freed != last or total <= 0:
                last, since = freed, read_at
            elif read_at - since >= settle_s:
                return ReleaseConfirmation(freed, read_at - t0, Settled.STABLE, polls)
            if read_at >= deadline:
                raise MemoryNotConfirmed(
                    f"GPUs {list(map(str, gpus))} freed {total} bytes within {timeout_s:.1f}s, "
                    f"expected {expected_bytes if expected_bytes is not None else 'a settled drop'}")
            await asyncio.sleep(poll_s)  # a measurement cadence, not a synchronisation

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:  # NVML may already be gone at interpreter exit
            pass


def open_probe() -> NvmlProbe | None:
    """An NVML probe if the driver and nvidia-ml-py are present, else None (CPU machines)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except Exception:  # no package, no driver, no device: all mean "no NVML here"
        return None
    return NvmlProbe(pynvml)
