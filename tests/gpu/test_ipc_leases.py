"""IPC leases on a GPU (issue 26): an engine SIGKILLed mid-push leaves none of the trainer's CUDA memory behind.

torch keeps every CUDA buffer it exported alive while the consumer's count in its ref-counter file is nonzero,
and a killed engine never brings its count down. Real processes: a reference engine holding sink shapes on
cuda:0 (killed outright just before the trainer sends chunk 2, chunks 0 and 1 in flight), a daemon process, and
this process as the trainer, pushing with ``WeightPusher``'s default transport (fresh CUDA-IPC buckets).
"""

from __future__ import annotations

import os

import pytest

from benchmarks.ipc_reclaim import engine_kill_mid_push

pytestmark = [pytest.mark.gpu]

BACK_WITHIN_S = 5.0
MODEL = os.environ.get("COLOCD_GPU_LEASE_MODEL", "qwen3-0.6b")


async def test_an_engine_killed_mid_push_leaves_the_trainers_memory_at_its_pre_push_level_within_5s() -> None:
    record = await engine_kill_mid_push(model=MODEL, bucket_mb=128, depth=3, kill_at=2, watch_s=2 * BACK_WITHIN_S)
    assert record["killed"], record
    assert record["peak_bytes"] > record["baseline_bytes"], record  # buckets were exported when it died
    assert record["back_after_kill_s"] is not None, f"never back at the pre-push level: {record}"
    assert record["back_after_kill_s"] < BACK_WITHIN_S, record
    assert record["final_bytes"] <= record["baseline_bytes"], record
    assert record["leases"]["exported_bytes"] == record["leases"]["retained_bytes"] == 0, record
    assert record["leases"]["reclaimed"] >= 1, record  # the dead engine's counts were what held it
    assert 'colocd_ipc_retained_bytes{rank="0"} 0.0' in record["metrics"], record
