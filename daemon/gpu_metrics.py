"""GPU memory gauges from NVML: per GPU (used, free, total: one metric each, labelled by the GPU's index and
UUID so they join dcgm-exporter's series) and per compute process.

Without NVML (no driver, no package, a CPU node) it sets ``colocd_nvml_available 0`` and no GPU
series at all: an absent series is honest, a zero would claim a reading that never happened.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from .memory import NvmlProbe
from .metrics import Metrics
from .worker import EngineHandle

__all__ = ["refresh_gpu_metrics"]

log = logging.getLogger("colocd.daemon")


def refresh_gpu_metrics(metrics: Metrics, probe: NvmlProbe | None, engines: Iterable[EngineHandle]) -> None:
    """Read every engine's GPUs once and set the gauges; a failed read leaves the last values and logs."""
    engines = list(engines)
    metrics.nvml_available.set(1 if probe is not None else 0)
    metrics.engine_gpu.clear()
    for engine in engines:
        for gpu in engine.gpus:
            metrics.engine_gpu.labels(engine.name, str(gpu)).set(1)
    if probe is None:
        return
    gpus = list(dict.fromkeys(g for e in engines for g in e.gpus))  # a GPU shared by engines is read once
    try:
        readings = probe.read_all(gpus)
        per_process = {str(g): probe.processes(g) for g in gpus}
        uuids = {str(g): probe.uuid(g) for g in gpus}
    except Exception as exc:  # NVML errors (a GPU fell off the bus) must not break a transition
        log.warning("NVML read failed; GPU memory gauges keep their last values: %s", exc)
        return
    for gpu, reading in readings.items():
        metrics.gpu_memory_used.labels(gpu, uuids[gpu]).set(reading.used_bytes)
        metrics.gpu_memory_free.labels(gpu, uuids[gpu]).set(reading.free_bytes)
        metrics.gpu_memory_total.labels(gpu, uuids[gpu]).set(reading.total_bytes)
    metrics.gpu_process_memory.clear()  # processes come and go; keep only the live ones
    for gpu, procs in per_process.items():
        for pid, nbytes in procs.items():
            metrics.gpu_process_memory.labels(gpu, str(pid)).set(nbytes)
