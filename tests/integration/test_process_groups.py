"""GroupLifecycle in a real 4-rank gloo world: churn without EADDRINUSE, keep-alive fallback, cooldowns.

One module-scoped world of four subprocesses (this file run with ``--worker``) plays every scenario
in turn, because starting torch four times costs more than the scenarios themselves; each test then
checks its own scenario's results. Every wait is bounded, and a world that outlives its deadline is
killed and reported as a hang.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import traceback
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

WORLD = 4
# A Megatron-like layout for 4 ranks: TP pairs, DP pairs, and one world group.
SPECS: list[tuple[str, tuple[int, ...] | None]] = [
    ("tp", (0, 1)),
    ("tp", (2, 3)),
    ("dp", (0, 2)),
    ("dp", (1, 3)),
    ("world", None),
]
_INIT_FAILED = 3  # worker exit code: the rendezvous port was taken before rank 0 bound it
# Destroy → rebuild cycles with no wait, back to back: each rebuilds all five groups right after destroying them,
# and all of them run well inside the 60 s TIME_WAIT of the first destroy, where a rebuild that bound a port would
# clash. A clash is a property of one rebuild, not of their number (new_group binds no port;
# research/nccl-keepalive.md §2): 50 cycles (250 rebuilds a rank) prove it as 200 did, in a quarter of the time.
CHURN_CYCLES = 50


# --- the harness (pytest side) -------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _run_world(tmp_path: Path, scenario: str, deadline_s: float) -> list[dict[str, Any]]:
    """Run ``scenario`` (or ``all``) on 4 ranks; return each rank's results. Retries once on a stolen port."""
    for attempt in range(2):
        out = tmp_path / f"{scenario}-{attempt}"
        out.mkdir()
        port = _free_port()
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", scenario, str(rank), str(port), str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
            )
            for rank in range(WORLD)
        ]
        end = time.monotonic() + deadline_s
        logs: list[str] = []
        hung = False
        for proc in procs:
            try:
                stdout, _ = proc.communicate(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                hung = True
                proc.kill()
                stdout, _ = proc.communicate()
            logs.append(stdout.decode(errors="replace"))
        if hung:
            raise AssertionError(f"{scenario}: world hung past {deadline_s} s\n" + "\n---\n".join(logs))
        if any(p.returncode == _INIT_FAILED for p in procs) and attempt == 0:
            continue
        codes = [p.returncode for p in procs]
        assert codes == [0] * WORLD, f"{scenario}: exit codes {codes}\n" + "\n---\n".join(logs)
        return [json.loads((out / f"{rank}.json").read_text()) for rank in range(WORLD)]
    raise AssertionError("unreachable")


# --- the tests -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run_world(tmp_path_factory.mktemp("world"), "all", deadline_s=100)


def _scenario(world: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    results = [rank[name] for rank in world]
    for rank, r in enumerate(results):
        assert "error" not in r, f"rank {rank}: {r['error']}"
    return results


@pytest.mark.timeout(150)
def test_destroy_rebuild_back_to_back_without_waits_never_hits_address_in_use(
    world: list[dict[str, Any]],
) -> None:
    for r in _scenario(world, "churn"):
        assert r["errors"] == [], r["errors"]
        assert r["cycles"] == CHURN_CYCLES
        assert r["address_in_use"] == 0
        assert r["final_sums_ok"] is True
        assert r["max_waited_s"] == 0.0


def test_keep_alive_canary_reporting_failure_on_one_rank_makes_every_rank_fall_back(
    world: list[dict[str, Any]],
) -> None:
    for r in _scenario(world, "keep_fail_report"):
        # Phase one: eligible after the first keep, ready once a canary vote passed.
        assert r["first"] == {"pause": "keep", "state": "eligible", "resume": "canary", "after": "ready"}
        # Phase two: rank 1 alone says its canary failed; everyone falls back together.
        assert r["second_resume"]["action"] == "rebuild"
        assert r["second_resume"]["keep_alive"] == "disabled"
        # Every collective completed, so nobody sat out a canary timeout (5 s) waiting for rank 1.
        assert r["second_resume"]["seconds"] < 4.0
        assert r["works_after_fallback"] is True
        # Keep-alive stays off for the process: the next keep directive destroys with no wait.
        assert r["third_pause"]["action"] == "destroy"
        assert r["third_pause"]["waited_s"] == 0.0


def test_keep_alive_canary_raising_on_one_rank_falls_back_everywhere_within_the_timeouts(
    world: list[dict[str, Any]],
) -> None:
    for r in _scenario(world, "keep_fail_raise"):
        assert r["resume"]["action"] == "rebuild"
        assert r["resume"]["keep_alive"] == "disabled"
        assert r["works_after_fallback"] is True
        # Peers of rank 2 wait one canary timeout (1.5 s) on the group it skipped, then vote.
        assert r["resume"]["seconds"] < 10.0


def test_deferred_cooldown_sleeps_only_the_remainder_and_destroy_sleeps_in_full(
    world: list[dict[str, Any]],
) -> None:
    for r in _scenario(world, "waits"):
        # wait 1.0 s deferred, ~0.4 s of "rollout" elapsed: only the remainder (~0.6 s) is slept.
        # The remainder counts from the destroy, a little before the pause returned, so it can only
        # be shorter than expected_remainder; 0.15 s covers a loaded machine's sleep overshoot.
        assert r["deferred_pause_waited"] == 0.0
        expected = r["deferred_expected_remainder"]
        assert expected - 0.15 <= r["deferred_resume_waited"] <= expected + 0.15, r
        assert r["deferred_resume_waited"] < 0.9
        # The rollout outlasted the wait: nothing left to sleep.
        assert r["expired_resume_waited"] == 0.0
        # destroy: the full wait, on the pause's critical path.
        assert 0.45 <= r["destroy_pause_waited"] <= 0.7, r
        assert r["destroy_resume_waited"] == 0.0
        assert r["memory"] == {"kept_bytes": None, "note_says_no_cuda": True}


def test_policy_decisions_drive_the_lifecycle_end_to_end(world: list[dict[str, Any]]) -> None:
    for r in _scenario(world, "policies"):
        # auto on CPU cannot measure resident memory, so it must not keep (the budget is a promise).
        assert r["auto_action"] == "destroy"
        assert r["auto_wait_point"] == "before_rebuild"
        # suspend without NCCL: the configured fallback (keep_alive) is enacted instead, said so.
        assert r["suspend_pause"]["action"] == "keep"
        assert "suspend unavailable" in r["suspend_pause"]["fallback_reason"]
        assert r["suspend_resume"]["action"] == "canary"
        # Abandoning kept groups rebuilds them at once and turns keep-alive off for good.
        assert (r["abandon"]["action"], r["abandon"]["waited_s"]) == ("rebuild", 0.0)
        assert r["abandon"]["keep_alive"] == "disabled"
        assert r["works_after_abandon"] is True
        assert r["directive_after_abandon"] == "destroy"


# --- the worker (subprocess side) ------------------------------------------------------------------


def _worker(scenario: str, rank: int, port: int, out: Path) -> int:
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=WORLD,
            timeout=timedelta(seconds=30),
        )
    except Exception as exc:
        if rank == 0 and "Address already in use" in str(exc):
            return _INIT_FAILED
        raise
    names = list(_SCENARIOS) if scenario == "all" else [scenario]
    results: dict[str, Any] = {}
    for name in names:
        # One scenario failing must not hide the others' results; the barrier realigns the ranks.
        begin = time.monotonic()
        try:
            results[name] = _SCENARIOS[name](rank)
            results[name]["scenario_s"] = time.monotonic() - begin
        except Exception:
            results[name] = {"error": traceback.format_exc()}
            sys.stderr.write(results[name]["error"])
        dist.barrier()
    dist.destroy_process_group()
    (out / f"{rank}.json").write_text(json.dumps(results if scenario == "all" else results[scenario]))
    return 0


def _lifecycle(**kwargs: Any) -> Any:
    from colocd.trainer.groups import GroupLifecycle, GroupSpec

    specs = [GroupSpec(name=f"{name}{ranks or ''}", ranks=ranks) for name, ranks in SPECS]
    return GroupLifecycle(specs, group_timeout_s=20, agree_timeout_s=30, **kwargs)


def _sums_ok(life: Any) -> bool:
    import torch
    import torch.distributed as dist

    for _spec, group in life.groups():
        t = torch.ones(1)
        dist.all_reduce(t, group=group)
        if int(t.item()) != dist.get_world_size(group):
            return False
    return True


def _churn(rank: int) -> dict[str, Any]:
    from colocd.policies import GroupDirective

    life = _lifecycle()
    life.build()
    errors: list[str] = []
    address_in_use = 0
    cycles = 0
    max_waited = 0.0
    directive = GroupDirective.destroy("destroy", "churn test", wait_s=0.0)
    for _ in range(CHURN_CYCLES):
        try:
            paused = life.pause(directive)
            resumed = life.resume()
        except Exception as exc:
            errors.append(repr(exc))
            address_in_use += "Address already in use" in repr(exc)
            break
        max_waited = max(max_waited, paused.waited_s, resumed.waited_s)
        cycles += 1
    ok = _sums_ok(life)
    life.close()
    return {
        "cycles": cycles,
        "errors": errors,
        "address_in_use": address_in_use,
        "final_sums_ok": ok,
        "max_waited_s": max_waited,
    }


def _keep_fail_report(rank: int) -> dict[str, Any]:
    from colocd.policies import GroupDirective
    from colocd.trainer.groups import all_reduce_canary

    armed = {"fail": False}

    def canary(name: str, group: Any, timeout_s: float) -> bool:
        import torch

        ok = all_reduce_canary(name, group, timeout_s, device=torch.device("cpu"))
        # The collective completed everywhere; only rank 1 claims it is broken.
        return ok and not (armed["fail"] and rank == 1)

    life = _lifecycle(canary=canary)
    life.build()
    keep = GroupDirective.keep("keep_alive", "test", canary_timeout_s=5)
    first_pause = life.pause(keep)
    state = first_pause.keep_alive
    first_resume = life.resume()
    first = {
        "pause": first_pause.action,
        "state": state,
        "resume": first_resume.action,
        "after": first_resume.keep_alive,
    }
    armed["fail"] = True
    life.pause(keep)
    second = life.resume()
    works = _sums_ok(life)
    third = life.pause(keep)
    life.resume()
    life.close()
    return {
        "first": first,
        "second_resume": asdict(second),
        "works_after_fallback": works,
        "third_pause": asdict(third),
    }


def _keep_fail_raise(rank: int) -> dict[str, Any]:
    from colocd.policies import GroupDirective
    from colocd.trainer.groups import all_reduce_canary

    def canary(name: str, group: Any, timeout_s: float) -> bool:
        import torch

        if rank == 2:
            raise RuntimeError("injected: communicator broken on rank 2")
        return all_reduce_canary(name, group, timeout_s, device=torch.device("cpu"))

    life = _lifecycle(canary=canary)
    life.build()
    life.pause(GroupDirective.keep("keep_alive", "test", canary_timeout_s=1.5))
    resumed = life.resume()
    works = _sums_ok(life)
    life.close()
    return {"resume": asdict(resumed), "works_after_fallback": works}


def _waits(rank: int) -> dict[str, Any]:
    import torch.distributed as dist

    from colocd.policies import GroupDirective, WaitPoint

    life = _lifecycle()
    life.build()
    deferred = GroupDirective.destroy(
        "deferred_cooldown", "t", wait_s=1.0, wait_point=WaitPoint.BEFORE_REBUILD
    )
    p1 = life.pause(deferred)
    paused_at = time.monotonic()
    time.sleep(0.4)  # stands in for the rollout the pause lasts; the wait under test is the lifecycle's
    elapsed = time.monotonic() - paused_at
    r1 = life.resume()
    dist.barrier()
    life.pause(
        GroupDirective.destroy("deferred_cooldown", "t", wait_s=0.3, wait_point=WaitPoint.BEFORE_REBUILD)
    )
    time.sleep(0.5)
    r2 = life.resume()
    dist.barrier()
    p3 = life.pause(GroupDirective.destroy("destroy", "t", wait_s=0.5))
    r3 = life.resume()
    life.close()
    return {
        "deferred_pause_waited": p1.waited_s,
        "deferred_resume_waited": r1.waited_s,
        "deferred_expected_remainder": 1.0 - elapsed,
        "expired_resume_waited": r2.waited_s,
        "destroy_pause_waited": p3.waited_s,
        "destroy_resume_waited": r3.waited_s,
        "memory": {"kept_bytes": p1.kept_bytes, "note_says_no_cuda": "no CUDA" in p1.memory_note},
    }


def _policies(rank: int) -> dict[str, Any]:
    from colocd.policies import load_policy_yaml

    life = _lifecycle()
    life.build()
    auto = load_policy_yaml("apiVersion: colocd/v1\nprocess_groups: {policy: auto, max_resident_gib: 100}\n")
    directive = auto.process_groups.before_pause(life.snapshot())
    life.pause(directive)
    life.resume()
    suspend = load_policy_yaml(
        "apiVersion: colocd/v1\n"
        "process_groups: {policy: suspend, fallback: keep_alive, canary_timeout_s: 5}\n"
    )
    # The daemon has not heard about capabilities: it asks for suspend and the trainer falls back.
    snap = life.snapshot().model_copy(update={"suspend_supported": None})
    sp = life.pause(suspend.process_groups.before_pause(snap))
    sr = life.resume()
    # The kept groups then fail in real use (say the weight sync raised): the trainer abandons them.
    ab = life.abandon("weight sync raised")
    works = _sums_ok(life)
    after = suspend.process_groups.before_pause(life.snapshot())
    life.close()
    return {
        "auto_action": directive.action,
        "auto_wait_point": directive.wait_point,
        "suspend_pause": asdict(sp),
        "suspend_resume": asdict(sr),
        "abandon": asdict(ab),
        "works_after_abandon": works,
        "directive_after_abandon": after.action,
    }


# Run in this order: the scenarios that break groups on purpose come last.
_SCENARIOS = {
    "waits": _waits,
    "policies": _policies,
    "churn": _churn,
    "keep_fail_report": _keep_fail_report,
    "keep_fail_raise": _keep_fail_raise,
}


if __name__ == "__main__" and len(sys.argv) == 6 and sys.argv[1] == "--worker":
    sys.exit(_worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), Path(sys.argv[5])))
