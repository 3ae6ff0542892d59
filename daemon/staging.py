"""What the pipeline policy is told about memory when it plans a weight sync: the bytes the sync will move and
the GPU memory left to stage its buckets in. Read, never guessed: a figure no source gives stays None."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

from ..engines.base import MemoryTag
from ..engines.chunks import dtype_itemsize
from .manifests import Manifest
from .memory import NvmlProbe
from .worker import EngineHandle

__all__ = ["StagingMemory", "staging_memory"]

log = logging.getLogger("colocd.daemon")


@dataclass(frozen=True, slots=True)
class StagingMemory:
    total_bytes: int | None  # bytes the sync will move
    free_bytes: int | None  # GPU memory free on the tightest of the engines' GPUs, now
    total_from: str | None  # "last_push" (the last complete push's manifest) | "engine_report"
    free_from: str | None  # "nvml:<gpu>" (the GPU with the least free)

    def describe(self) -> str:
        total = (f"sync {self.total_bytes / 2**20:.1f} MiB ({self.total_from})" if self.total_bytes is not None
                 else "sync size unknown (no complete push yet, no engine report)")
        free = (f"{self.free_bytes / 2**20:.1f} MiB free ({self.free_from})" if self.free_bytes is not None
                else "free GPU memory unknown (no NVML)")
        return f"{total}; {free}"


def staging_memory(engines: Iterable[EngineHandle], probe: NvmlProbe | None,
                   last_push: Manifest | None) -> StagingMemory:
    """NVML for the engines' GPUs (the trainer's too, colocated); the size of the last complete push, else the
    largest weights an engine reported taking (SGLang's ``memory_usage``)."""
    engines = list(engines)
    total, total_from = None, None
    if last_push:
        total = sum(math.prod(meta.shape) * dtype_itemsize(meta.dtype) for meta in last_push.values())
        total_from = "last_push"
    else:
        reported = [e.learned_tag_bytes[MemoryTag.WEIGHTS] for e in engines
                    if e.learned_tag_bytes.get(MemoryTag.WEIGHTS)]
        if reported:
            total, total_from = max(reported), "engine_report"
    free, free_from = None, None
    gpus = list(dict.fromkeys(g for e in engines for g in e.gpus))
    if probe is not None and gpus:
        try:
            readings = probe.read_all(gpus)
        except Exception as exc:  # an NVML error must not fail the sync; the plan just knows less
            log.warning("NVML read for the pipeline plan failed; staging is not bounded by free memory: %s", exc)
        else:
            tightest = min(readings.values(), key=lambda r: r.free_bytes)
            free, free_from = tightest.free_bytes, f"nvml:{tightest.gpu}"
    return StagingMemory(total, free, total_from, free_from)
