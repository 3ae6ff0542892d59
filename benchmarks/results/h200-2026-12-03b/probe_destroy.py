"""Probe (device call N): does an NCCL communicator's destroy wait for its proxy socket thread's 500 ms poll?

If it does, a one-rank group destroyed W ms after it was made takes about 500 - (W mod 500) ms (the poll's clock
starts with the communicator), and 14 groups destroyed together take at most one period. Run on one GPU:
``python3 probe_destroy.py``; prints one JSON line.
"""

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
store = dist.HashStore()  # type: ignore[attr-defined]  # exported by torch.distributed, not declared
dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=dev)


def made() -> Any:
    g = dist.new_group([0])
    x = torch.ones(1, device=dev)
    dist.all_reduce(x, group=g)  # the communicator is made lazily, by its first collective
    torch.cuda.synchronize()
    return g


out: dict[str, Any] = {"torch": torch.__version__,
                       "nccl": ".".join(map(str, torch.cuda.nccl.version()))}  # type: ignore[no-untyped-call]
by_wait = []
for wait_ms in (0, 100, 200, 300, 400, 600, 800) * 2:
    g = made()
    time.sleep(wait_ms / 1e3)
    t0 = time.perf_counter()
    dist.destroy_process_group(g)
    by_wait.append({"wait_ms": wait_ms, "destroy_ms": round((time.perf_counter() - t0) * 1e3, 1)})
out["one_group_destroyed_after_wait"] = by_wait
pool = ThreadPoolExecutor(14)
for mode in ("serial", "together", "serial", "together"):
    groups = [made() for _ in range(14)]
    t0 = time.perf_counter()
    if mode == "serial":
        for g in groups:
            dist.destroy_process_group(g)
    else:
        list(pool.map(dist.destroy_process_group, groups))
    out.setdefault("fourteen_destroyed_s", []).append({"mode": mode, "s": round(time.perf_counter() - t0, 3)})
print(json.dumps(out))
