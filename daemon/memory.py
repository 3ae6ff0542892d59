"""Proof that memory moved: NVML readings of the engines' GPUs, polled until a release has landed.

An engine's HTTP reply to a release is not proof (SGLang replies before the pages are unmapped:
THUDM/slime#579), so the trainer is let in only once NVML shows the bytes free.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from .errors import MemoryNotConfirmed

__all__ = ["GpuReading", "NvmlProbe", "ReleaseConfirmation", "open_probe"]


@dataclass(frozen=True, slots=True)
class GpuReading:
    gpu: str  # index as the operator configured it, or UUID
    used_bytes: int
    free_bytes: int
    total_bytes: int


@dataclass(frozen=True, slots=True)
class ReleaseConfirmation:
    """Freed bytes per GPU as NVML saw them, and how long it took for them to show."""

    freed_bytes: dict[str, int]
    waited_s: float
    settled: bool


class NvmlProbe:
    """Reads used/free memory of GPUs through NVML (nvidia-ml-py). One per daemon; closed with it."""

    def __init__(self, nvml: Any) -> None:
        self._nvml = nvml

    def read(self, gpu: int | str) -> GpuReading:
        n = self._nvml
        handle = (n.nvmlDeviceGetHandleByUUID(gpu) if isinstance(gpu, str)
                  else n.nvmlDeviceGetHandleByIndex(gpu))
        info = n.nvmlDeviceGetMemoryInfo(handle)
        return GpuReading(str(gpu), int(info.used), int(info.free), int(info.total))

    def read_all(self, gpus: list[int | str]) -> dict[str, GpuReading]:
        return {str(g): self.read(g) for g in gpus}

    def processes(self, gpu: int | str) -> dict[int, int]:
        """Bytes NVML attributes to each compute process (pid) on ``gpu``; empty where NVML cannot tell
        (no permission, or a MIG/vGPU setup that hides it: ``usedGpuMemory`` is then None)."""
        n = self._nvml
        try:
            handle = (n.nvmlDeviceGetHandleByUUID(gpu) if isinstance(gpu, str)
                      else n.nvmlDeviceGetHandleByIndex(gpu))
            procs = n.nvmlDeviceGetComputeRunningProcesses(handle)
        except Exception:  # NVMLError_NoPermission / NotSupported: nothing to attribute
            return {}
        out: dict[int, int] = {}
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is not None:
                out[int(p.pid)] = out.get(int(p.pid), 0) + int(used)
        return out

    async def confirm_release(self, gpus: list[int | str], before: dict[str, GpuReading], *,
                              expected_bytes: int | None, timeout_s: float,
                              poll_s: float = 0.02, settle_polls: int = 3) -> ReleaseConfirmation:
        """Poll until the GPUs' used memory dropped by ``expected_bytes`` in total, or, when that is
        unknown, until it dropped and stayed put for ``settle_polls`` readings. Timeout → error."""
        t0 = time.perf_counter()
        deadline = t0 + timeout_s
        last: dict[str, int] | None = None
        stable = 0
        while True:
            now = self.read_all(gpus)
            freed = {g: before[g].used_bytes - now[g].used_bytes for g in now}
            total = sum(freed.values())
            if expected_bytes is not None and total >= expected_bytes:
                return ReleaseConfirmation(freed, time.perf_counter() - t0, True)
            if expected_bytes is None:
                stable = stable + 1 if last == freed and total > 0 else 0
                if stable >= settle_polls:
                    return ReleaseConfirmation(freed, time.perf_counter() - t0, True)
            last = freed
            if time.perf_counter() >= deadline:
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
        import pynvml  # type: ignore[import-not-found]

        pynvml.nvmlInit()
        if pynvml.nvmlDeviceGetCount() == 0:
            return None
    except Exception:  # no package, no driver, no device: all mean "no NVML here"
        return None
    return NvmlProbe(pynvml)
