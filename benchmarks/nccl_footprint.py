"""What one-rank NCCL communicators cost on this GPU: memory per communicator, and create/destroy time of 14.

    python3 -m benchmarks.nccl_footprint --out nccl.json

Each NCCL setting runs in a fresh process (NCCL reads its environment once): world size 1 over an
in-process store, 14 groups (Megatron's per-rank set) each warmed by one all-reduce, three rounds of
create → measure → destroy. Memory is ``cudaMemGetInfo``'s used bytes before and after. A last run
with ``NCCL_DEBUG_SUBSYS=ALLOC`` prints one communicator's allocations. Needs CUDA.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["SETTINGS", "main", "measure"]

SETTINGS: dict[str, dict[str, str]] = {
    "default": {},
    "nvls0": {"NCCL_NVLS_ENABLE": "0"},
    "cumem0": {"NCCL_CUMEM_ENABLE": "0"},
    "bound_split": {"FOOTPRINT_BIND": "1"},
    "bound_split_share": {"FOOTPRINT_BIND": "1", "NCCL_COMM_SPLIT_SHARE_RESOURCES": "1"},
    "ctas1": {"NCCL_MAX_CTAS": "1", "NCCL_MIN_CTAS": "1"},
    "buff1m": {"NCCL_BUFFSIZE": str(1 << 20), "NCCL_NVLS_ENABLE": "0"},
    "rc0": {"NCCL_RUNTIME_CONNECT": "0"},
}

# Runs in the child process: one setting, `rounds` rounds of `groups` groups.
_CHILD = r'''
import json, os, sys, time, torch, torch.distributed as dist
groups, rounds = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda", 0); torch.cuda.set_device(dev); torch.ones(1, device=dev)
def used():
    torch.cuda.synchronize(); free, total = torch.cuda.mem_get_info(dev); return total - free
kw = {"device_id": dev} if os.environ.get("FOOTPRINT_BIND") else {}
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1, **kw)
x = torch.ones(1, device=dev); dist.all_reduce(x)
out = {"context_and_world_bytes": used(), "rounds": []}
for _ in range(rounds):
    t0 = time.perf_counter(); base = used(); made = []
    for _ in range(groups):
        g = dist.new_group([0]); dist.all_reduce(x, group=g); made.append(g)
    t1 = time.perf_counter(); after = used()
    for g in made:
        dist.destroy_process_group(g)
    torch.cuda.synchronize(); t2 = time.perf_counter()
    out["rounds"].append({"create_s": t1 - t0, "destroy_s": t2 - t1,
                          "per_comm_bytes": (after - base) / groups, "left_after_destroy_bytes": used() - base})
print("RESULT " + json.dumps(out))
'''


# Runs in the child process: create and tear down `groups` groups in several ways, `rounds` rounds each.
# Each communicator's init and destroy are independent of the others', so they may run one thread per
# communicator (on every rank the same set, so a cross-rank collective destroy still meets its peers).
_TEARDOWN_CHILD = r'''
import json, sys, time, torch, torch.distributed as dist
from concurrent.futures import ThreadPoolExecutor
groups, rounds = int(sys.argv[1]), int(sys.argv[2])
dev = torch.device("cuda", 0); torch.cuda.set_device(dev); torch.ones(1, device=dev)
def used():
    torch.cuda.synchronize(); free, total = torch.cuda.mem_get_info(dev); return total - free
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
x = torch.ones(1, device=dev); dist.all_reduce(x)
def warm(g):
    torch.cuda.set_device(dev); y = torch.ones(1, device=dev); dist.all_reduce(y, group=g); return float(y.item())
def shut(g):
    g.shutdown()
abort = dist.distributed_c10d._abort_process_group
# threads/threads runs again last: it shows whether the aborts before it left anything that slows a later round.
modes = [("serial", "serial"), ("threads", "threads"), ("serial", "abort_serial"), ("threads", "abort_threads"),
         ("threads", "threads")]
out = {"rounds": []}
pool = ThreadPoolExecutor(groups)
for create_mode, destroy_mode in modes:
    for _ in range(rounds):
        base = used(); t0 = time.perf_counter()
        made = [dist.new_group([0]) for _ in range(groups)]
        t_new = time.perf_counter()
        if create_mode == "serial":
            sums = [warm(g) for g in made]
        else:
            sums = list(pool.map(warm, made))
        torch.cuda.synchronize(); t1 = time.perf_counter(); after = used()
        if destroy_mode == "serial":
            for g in made: dist.destroy_process_group(g)
        elif destroy_mode == "threads":
            list(pool.map(dist.destroy_process_group, made))
        elif destroy_mode == "abort_serial":
            for g in made: abort(g)
        else:
            list(pool.map(abort, made))
        torch.cuda.synchronize(); t2 = time.perf_counter()
        out["rounds"].append({"create": create_mode, "destroy": destroy_mode, "new_group_s": t_new - t0,
                              "create_s": t1 - t0, "destroy_s": t2 - t1, "sums_ok": all(s == 1.0 for s in sums),
                              "per_comm_bytes": (after - base) / groups, "left_after_destroy_bytes": used() - base})
print("RESULT " + json.dumps(out))
'''


def measure(env: dict[str, str], *, groups: int = 14, rounds: int = 3, child: str = _CHILD) -> dict[str, Any]:
    """One setting in a fresh process; its result, or the error it printed."""
    proc = subprocess.run([sys.executable, "-c", child, str(groups), str(rounds)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=300, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        return {"error": proc.stderr[-2000:]}
    result: dict[str, Any] = json.loads(lines[0].removeprefix("RESULT "))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--groups", type=int, default=14)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated NCCL settings to measure (empty: only the teardown modes)")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    args = parser.parse_args(argv)
    record: dict[str, Any] = {"groups": args.groups, "settings": {}}
    print(f"{'setting':<20}{'MiB/comm':>10}{'create s':>10}{'destroy s':>11}")
    for name in filter(None, args.settings.split(",")):
        env = SETTINGS[name]
        result = record["settings"][name] = {"env": env, **measure(env, groups=args.groups, rounds=args.rounds)}
        if "error" in result:
            print(f"{name:<20} failed: {result['error'][-200:]}")
            continue
        last = result["rounds"][-1]  # after the first round's one-time costs
        print(f"{name:<20}{last['per_comm_bytes'] / 2**20:>10.0f}{last['create_s']:>10.3f}{last['destroy_s']:>11.3f}")
    teardown = record["teardown"] = measure({}, groups=args.groups, rounds=args.rounds, child=_TEARDOWN_CHILD)
    if "error" in teardown:
        print(f"teardown modes failed: {teardown['error'][-400:]}")
    else:
        print(f"{'create':<10}{'destroy':<15}{'new_group s':>12}{'create s':>10}{'destroy s':>11}{'MiB left':>10}")
        for r in teardown["rounds"]:
            print(f"{r['create']:<10}{r['destroy']:<15}{r['new_group_s']:>12.3f}{r['create_s']:>10.3f}"
                  f"{r['destroy_s']:>11.3f}{r['left_after_destroy_bytes'] / 2**20:>10.0f}")
    alloc = subprocess.run([sys.executable, "-c", _CHILD, "1", "1"], capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "ALLOC,INIT"}, check=False)
    record["one_comm_alloc_lines"] = [line for line in (alloc.stdout + alloc.stderr).splitlines() if "Alloc" in line]
    print(f"one communicator: {len(record['one_comm_alloc_lines'])} NCCL allocation lines (NCCL_DEBUG_SUBSYS=ALLOC)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
