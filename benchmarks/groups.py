"""Benchmark: each process-group policy side by side on a Megatron-like set of groups, world size 1.

    python3 -m benchmarks.groups --device cuda --groups 14 --steps 3 --out benchmarks/results/groups.json
    python3 -m benchmarks.groups --device cpu --steps 1              # smoke test (gloo, no GPU numbers)

Per policy and step it runs what the trainer agent runs around one colocated pause: the policy's
decision, ``GroupLifecycle.pause``, a simulated rollout (``--rollout-s``), ``GroupLifecycle.resume``.
It reports seconds spent on groups (pause + resume, the rollout excluded) and the GPU memory the
groups keep through the pause, measured from the device's free memory inside the pause window.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from colocd.policies import load_policy_yaml
from colocd.trainer.groups import GroupLifecycle, GroupSpec

GIB = 1 << 30

# Megatron's usual per-rank groups (parallel_state.py): at world size 1 every one of them is a
# separate one-rank communicator, which is what the trainer holds on each GPU.
MEGATRON_GROUPS = (
    "tp",
    "pp",
    "dp",
    "dp_cp",
    "cp",
    "tp_pp",
    "tp_dp",
    "tp_dp_cp",
    "ep",
    "tp_ep",
    "expert_dp",
    "embedding",
    "position_embedding",
    "mp",
)

WORLD_SIZE_1_CAVEAT = (
    "World size 1: every group is a one-rank communicator on one GPU. This shows each policy's fixed "
    "costs (communicator init/destroy, the post-destroy waits, canary and vote overhead) and the "
    "per-communicator memory a kept group holds. It does not show NVLink/NVLS buffers, real channel "
    "counts, P2P handle exchange or cross-rank skew, which grow both the rebuild time and the kept "
    "memory at 8 GPUs (research/nccl-keepalive.md §6)."
)


@dataclass
class Row:
    """One policy's results across steps."""

    label: str
    document: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    budget_gib: float | None = None

    def summary(self) -> dict[str, Any]:
        def mean(key: str) -> float | None:
            values = [s[key] for s in self.steps if s[key] is not None]
            return statistics.fmean(values) if values else None

        window = [s["kept_in_window_bytes"] for s in self.steps if s["kept_in_window_bytes"] is not None]
        return {
            "policy": self.label,
            "actions": sorted({s["action"] for s in self.steps}),
            "groups_s_per_step": mean("groups_s"),
            "waited_s_per_step": mean("waited_s"),
            "pause_s": mean("pause_s"),
            "resume_s": mean("resume_s"),
            "kept_in_window_gib_max": max(window) / GIB if window else None,
            "kept_reported_gib_max": _max_gib([s["kept_reported_bytes"] for s in self.steps]),
            "within_budget": None
            if self.budget_gib is None or not window
            else max(window) / GIB <= self.budget_gib,
        }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    device = _setup(args.device)
    specs = [GroupSpec(MEGATRON_GROUPS[i % len(MEGATRON_GROUPS)] + f"#{i}", (0,)) for i in range(args.groups)]
    rows = _rows(args)
    meta = _meta(args, device)
    print(f"# {meta['device_name']}; torch {meta['torch']}; NCCL {meta['nccl']}", end="")
    print(f"; NCCL_CUMEM_ENABLE={meta['cumem']}")
    print(f"# {args.groups} groups, {args.steps} steps per policy", end="")
    print(f", rollout {args.rollout_s} s, post-destroy wait {args.wait_s} s")
    print("# " + WORLD_SIZE_1_CAVEAT)
    for row in rows:
        _run_policy(row, specs, device, args)
        print(f"  done: {row.label}", file=sys.stderr)
    summaries = [row.summary() for row in rows]
    _print_table(summaries, meta)
    if args.out:
        out = {
            "meta": meta,
            "summary": summaries,
            "rows": [{"policy": r.label, "document": r.document, "steps": r.steps} for r in rows],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.out}")
    dist.destroy_process_group()
    over = [s["policy"] for s in summaries if s["within_budget"] is False]
    if over:
        print(f"FAIL: over budget: {over}", file=sys.stderr)
        return 1
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--groups", type=int, default=14, help="communicators per rank (Megatron-like: 14)")
    p.add_argument("--steps", type=int, default=3, help="pause/resume cycles per policy")
    p.add_argument("--wait-s", type=float, default=2.0, help="post_destroy_wait_s for destroy/deferred/auto")
    p.add_argument("--rollout-s", type=float, default=1.0, help="simulated pause (rollout) length")
    p.add_argument("--auto-budgets", default="4,16", help="comma-separated max_resident_gib values for auto")
    p.add_argument("--out", help="write the results as JSON here")
    return p.parse_args(argv)


def _setup(kind: str) -> torch.device:
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device; use --device cpu for the smoke test")
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        torch.ones(1, device=device)  # the CUDA context exists before any baseline is taken
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    # An in-process store: world size 1 needs no port at all.
    store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed, not declared
    dist.init_process_group(backend, store=store, rank=0, world_size=1)
    if kind == "cuda":
        # NCCL allocates some process-wide memory with its first communicator and keeps it after
        # destroy; pay that here so no policy's pause window is charged for it.
        warm = dist.new_group([0])
        dist.all_reduce(torch.ones(1, device=device), group=warm)
        dist.destroy_process_group(warm)
    return device


def _rows(args: argparse.Namespace) -> list[Row]:
    w = args.wait_s
    rows = [
        Row("destroy", f"{{policy: destroy, post_destroy_wait_s: {w}}}"),
        Row("destroy (no wait)", "{policy: destroy, post_destroy_wait_s: 0}"),
        Row("deferred_cooldown", f"{{policy: deferred_cooldown, post_destroy_wait_s: {w}}}"),
        # Groups rebuilt as splits of one parent sharing its resources; the build is separate, so step 0's
        # pause destroys separate groups and the later steps show the split ones (NCCL only, else a no-op).
        Row("split_shared (0 s)", "{policy: destroy, post_destroy_wait_s: 0, rebuild: split_shared}"),
        Row("keep_alive", "{policy: keep_alive}"),
        Row("suspend", f"{{policy: suspend, fallback: deferred_cooldown, post_destroy_wait_s: {w}}}"),
    ]
    for budget in (float(b) for b in args.auto_budgets.split(",") if b):
        doc = f"{{policy: auto, max_resident_gib: {budget}, post_destroy_wait_s: {w}}}"
        rows.append(Row(f"auto ({budget:g} GiB)", doc, budget_gib=budget))
    return rows


def _run_policy(row: Row, specs: list[GroupSpec], device: torch.device, args: argparse.Namespace) -> None:
    policies = load_policy_yaml(f"apiVersion: colocd/v1\nprocess_groups: {row.document}\n")
    baseline = _free(device)
    with GroupLifecycle(specs, device=device, group_timeout_s=300, agree_timeout_s=60) as life:
        build = life.build()
        for step in range(args.steps):
            directive = policies.process_groups.before_pause(life.snapshot())
            paused = life.pause(directive)
            window_start = time.monotonic()
            kept = None if baseline is None else baseline - (_free(device) or 0)
            # The rollout the engines run while the trainer is paused; deferred waits overlap it.
            time.sleep(max(0.0, args.rollout_s - (time.monotonic() - window_start)))
            resumed = life.resume()
            row.steps.append(
                {
                    "step": step,
                    "action": paused.action,
                    "reason": directive.reason,
                    "fallback_reason": paused.fallback_reason,
                    "pause_s": paused.seconds,
                    "resume_s": resumed.seconds,
                    "groups_s": paused.seconds + resumed.seconds,
                    "waited_s": paused.waited_s + resumed.waited_s,
                    "kept_in_window_bytes": kept,
                    "kept_reported_bytes": paused.kept_bytes,
                    "per_group_bytes": paused.per_group_bytes,
                    "build_s": build.seconds if step == 0 else None,
                    "resident_at_build_bytes": life.snapshot().resident_bytes,
                    "resume_action": resumed.action,
                    "resume_fallback_reason": resumed.fallback_reason,
                    "keep_alive": resumed.keep_alive,
                }
            )
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    return int(torch.cuda.mem_get_info(device)[0])


def _meta(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    cuda = device.type == "cuda"
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else None  # type: ignore[no-untyped-call]
    except Exception:
        nccl = None
    return {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else "CPU (gloo)",
        "torch": torch.__version__,
        "nccl": nccl,
        "cumem": os.environ.get("NCCL_CUMEM_ENABLE", "unset"),
        "groups": args.groups,
        "steps": args.steps,
        "wait_s": args.wait_s,
        "rollout_s": args.rollout_s,
        "world_size": 1,
        "caveat": WORLD_SIZE_1_CAVEAT,
        "command": " ".join(sys.argv),
    }


def _print_table(summaries: list[dict[str, Any]], meta: dict[str, Any]) -> None:
    head = (
        f"{'policy':<20} {'did':<16} {'groups s/step':>13} {'of it waits':>11} "
        f"{'kept GiB (window)':>17} {'kept GiB (report)':>17}"
    )
    print(head)
    print("-" * len(head))
    for s in summaries:
        print(
            f"{s['policy']:<20} {'/'.join(s['actions']):<16} {_fmt(s['groups_s_per_step'], 3):>13} "
            f"{_fmt(s['waited_s_per_step'], 3):>11} {_fmt(s['kept_in_window_gib_max'], 2):>17} "
            f"{_fmt(s['kept_reported_gib_max'], 2):>17}"
        )
    if meta["device"] != "cuda":
        print("(CPU: GPU memory is not measurable, shown as -)")


def _fmt(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _max_gib(values: list[int | None]) -> float | None:
    known = [v for v in values if v is not None]
    return max(known) / GIB if known else None


if __name__ == "__main__":
    sys.exit(main())
