"""``python3 -m benchmarks.switch`` on the CPU: the whole handoff per preset, every sync verified, the JSON's shape."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from benchmarks.switch import PRESETS, SwitchSettings, run_switch_bench

PHASES = ("resume_s", "sleep_s", "update_s", "wake_s", "switch_s")


async def test_bench_switch_cpu_smoke_run_verifies_every_sync_and_writes_the_record(tmp_path: Path) -> None:
    out = tmp_path / "switch.json"
    record = await run_switch_bench(SwitchSettings(
        model="tiny", device="cpu", presets=("seed-baseline", "tuned-early"), steps=1, warmup=1, groups=2,
        train_tokens=8, gen_requests=2, gen_tokens=4, post_destroy_wait_s=0.0, out=str(out)))

    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    assert [p["name"] for p in record["presets"]] == ["seed-baseline", "tuned-early"]
    assert {"offload_s", "onload_s", "device_copy_s", "alloc_s", "total_s", "strict_total_s"} <= set(record["floor"])
    weights = record["state_bytes"]["weights"]
    for name, steps in record["steps"].items():
        assert [s["warmup"] for s in steps] == [True, False], name
        for s in steps:
            assert s["verified"] is True, (name, s["step"])  # the engine's checksums equal the trainer's
            assert s["pushed_bytes"] >= weights and s["chunks"] >= 1  # flattened: aligned offsets
            assert s["offloaded_bytes"] == weights + record["state_bytes"]["optimizer"]
            assert s["switch_s"] == sum(s[k] for k in PHASES[:-1]) and s["switch_s"] > 0
            assert s["generated_tokens"] > 0
    by = {s["preset"]: s for s in record["summary"]}
    assert by["seed-baseline"]["transport"] == "inline"  # per-tensor IPC needs CUDA; the CPU path is inline
    assert "pause:destroy" in by["seed-baseline"]["group_actions"]
    assert all(by[p]["verified_all"] and by[p]["x_floor"] > 0 for p in by)
    assert {"memory_neutral", "x_floor", "paused_window_max_gib"} <= set(record["targets"])
    # tuned-early overlaps its offloads with the phase calls: the rollout was posted while the weights went out
    # (with no NVML here nothing refuses it), and the optimizer's offload ran beside the sync and the push.
    early = by["tuned-early"]["parts"]
    assert early["wake.rollout_posted_early"] == 1.0 and early["wake.rollout_room_wait"] == 0.0
    assert early["sleep.offload_optimizer"] > 0 and "wake.rollout_posted_early" not in by["seed-baseline"]["parts"]
    assert early["wake.settled_before_rollout"] == 0.0  # its window may open beside memory still going


async def test_bench_switch_sync_and_async_in_one_run_verify_every_push_and_compare_step_time(tmp_path: Path) -> None:
    record = await run_switch_bench(SwitchSettings(
        model="tiny", device="cpu", presets=("tuned",), steps=1, warmup=0, groups=2, train_tokens=8,
        gen_requests=2, gen_tokens=4, post_destroy_wait_s=0.0, sync_modes=("sync", "async")))

    by = {s["preset"]: s for s in record["summary"]}
    assert set(by) == {"tuned", "tuned+async"}
    assert by["tuned"]["sync_modes"] == ["sync"] and by["tuned+async"]["sync_modes"] == ["async"]
    assert all(by[p]["verified_all"] for p in by)  # the engine holds exactly the snapshot the push carried
    async_step = record["steps"]["tuned+async"][0]
    assert async_step["step_s"] == async_step["train_s"] + async_step["switch_s"]
    assert "update.snapshot" in async_step["parts"] and "wake.join_wait" in async_step["parts"]
    assert record["targets"]["async_step_speedup"]["tuned"] > 0
    assert record["targets"]["async_ran_async"] == {"tuned": True}


async def test_tuned_and_the_split_presets_post_the_rollout_only_beside_a_settled_trainer(tmp_path: Path) -> None:
    record = await run_switch_bench(SwitchSettings(
        model="tiny", device="cpu", presets=("tuned", "tuned-split-early"), steps=1, warmup=1, groups=2,
        train_tokens=8, gen_requests=2, gen_tokens=4, post_destroy_wait_s=0.0))

    by = {s["preset"]: s for s in record["summary"]}
    weights, optimizer = record["state_bytes"]["weights"], record["state_bytes"]["optimizer"]
    for name in ("tuned", "tuned-split-early"):
        parts = by[name]["parts"]
        assert by[name]["verified_all"], name
        # Posted once the offload, its cleanup and the group destroy had ended: nothing left for the window.
        assert parts["wake.settled_before_rollout"] == 1.0 and parts["wake.rollout_posted_early"] == 0.0, name
        for step in record["steps"][name]:
            assert step["offloaded_bytes"] == weights + optimizer
            assert step["memory_peak"]["window_samples"] >= 2  # the reply and the window's end, at least
    # split_shared cannot apply on gloo: the groups came back separate, and the step says why.
    notes = [n for step in record["steps"]["tuned-split-early"] for n in step["notes"]]
    assert any("split_shared unavailable" in n for n in notes), notes


async def test_a_preset_that_fails_is_recorded_and_the_run_keeps_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(PRESETS, "broken", dataclasses.replace(PRESETS["tuned"], name="broken", onload="bogus"))
    record = await run_switch_bench(SwitchSettings(
        model="tiny", device="cpu", presets=("tuned", "broken"), steps=1, warmup=0, groups=2, train_tokens=8,
        gen_requests=2, gen_tokens=4, post_destroy_wait_s=0.0))

    assert [s["preset"] for s in record["summary"]] == ["tuned"]
    assert record["summary"][0]["verified_all"]
    assert list(record["failed_presets"]) == ["broken"]
    assert "unknown onload 'bogus'" in record["failed_presets"]["broken"]
