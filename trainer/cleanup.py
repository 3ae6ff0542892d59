"""Enacts a ``CleanupPlan`` in the trainer's process before an engine resumes: each sub-step becomes a trace span
with the bytes it gave back to the driver (verl #7864's phase trace), so the trace shows what cleanup bought."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..policies import CleanupAction, CleanupPlan

__all__ = ["CleanupReport", "run_cleanup"]

_CPU_NOTE = "no CUDA device: bytes freed are not measurable, reported as None"
_CUDA_NOTE = "freed = drop in torch.cuda.memory_reserved across the step"


@dataclass(slots=True)
class CleanupReport:
    """What cleanup did; spans are ``{name, round, start_s (from started_at), duration_s, freed_bytes, ...}``;
    bytes are None where not measurable (``memory_note``)."""

    policy: str
    started_at: float  # wall clock (time.time()) when cleanup began, to place the spans in a step trace
    seconds: float
    rounds: int
    freed_bytes: int | None
    memory_note: str
    spans: list[dict[str, Any]] = field(default_factory=list)


def run_cleanup(plan: CleanupPlan, *, device: torch.device | None = None, collect: Callable[[], object] = gc.collect,
                meter: Callable[[], int] | None = None) -> CleanupReport:
    """Run ``plan``'s steps, again while a round freed >= ``min_freed_bytes`` (up to ``max_retries``); ``meter``:
    the bytes held (default: ``torch.cuda.memory_reserved`` on CUDA; on CPU every step runs, bytes are None)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    cuda = device.type == "cuda"
    if meter is None and cuda:
        meter = lambda: int(torch.cuda.memory_reserved(device))  # noqa: E731
    actions: dict[CleanupAction, Callable[[], object]] = {
        CleanupAction.GC_COLLECT: collect,
        CleanupAction.SYNCHRONIZE: (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None),
        CleanupAction.EMPTY_CACHE: torch.cuda.empty_cache if cuda else (lambda: None),
    }
    started_at = time.time()
    origin = time.perf_counter()
    spans: list[dict[str, Any]] = []
    total: int | None = 0 if meter else None
    rounds = 0
    while plan.steps and rounds <= plan.max_retries:
        rounds += 1
        round_freed = 0
        for step in plan.steps:
            before = meter() if meter else None
            allocated = torch.cuda.memory_allocated(device) if cuda else None
            begin = time.perf_counter()
            actions[step]()
            duration = time.perf_counter() - begin
            freed = None if before is None or meter is None else before - meter()
            # gc.collect frees tensors into torch's cache, not to the driver: shown apart, so a gc
            # step that "freed 0" is not mistaken for one that found nothing.
            uncached = None if allocated is None else allocated - torch.cuda.memory_allocated(device)
            spans.append({"name": f"cleanup.{step}", "round": rounds, "start_s": begin - origin,
                          "duration_s": duration, "freed_bytes": freed, "released_to_cache_bytes": uncached})
            round_freed += freed or 0
        if total is not None:
            total += round_freed
        # Retry only while it pays: on CPU nothing is measurable, so one round is all that runs.
        if meter is None or round_freed < plan.min_freed_bytes:
            break
    note = _CUDA_NOTE if cuda else (_CPU_NOTE if meter is None else "freed = drop in the given meter")
    return CleanupReport(policy=plan.policy, started_at=started_at, seconds=time.perf_counter() - origin, rounds=rounds,
                         freed_bytes=total, memory_note=note, spans=spans)
