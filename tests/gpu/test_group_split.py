"""``rebuild: split_shared`` on one GPU: the groups come back as splits of one parent, work, and all go at the pause."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="communicator splits need CUDA and NCCL"),
]

# Its own process: a world of one NCCL rank, four groups, two pause/resume cycles with split_shared.
_RANK = r'''
import json, torch, torch.distributed as dist
from dataclasses import asdict
from colocd.policies import GroupDirective, RebuildMode, WaitPoint
from colocd.trainer.groups import GroupLifecycle, GroupSpec
dev = torch.device("cuda", 0); torch.cuda.set_device(dev); torch.ones(1, device=dev)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
life = GroupLifecycle([GroupSpec(f"g{i}", (0,)) for i in range(4)], device=dev)
life.build()
split = GroupDirective.destroy("destroy", "test", wait_point=WaitPoint.BEFORE_REBUILD, rebuild=RebuildMode.SPLIT_SHARED)
out = {"first_pause": asdict(life.pause(split)), "resume": asdict(life.resume())}
sums = []
for _spec, group in life.groups():
    x = torch.ones(1, device=dev); dist.all_reduce(x, group=group); sums.append(float(x.item()))
out["sums"] = sums
out["resident"] = life.snapshot().resident_bytes
out["pause"] = asdict(life.pause(split))
life.close(); dist.destroy_process_group()
print("RESULT " + json.dumps(out))
'''


def test_split_shared_groups_are_split_from_one_parent_work_and_go_with_it_at_the_pause() -> None:
    proc = subprocess.run([sys.executable, "-c", _RANK], capture_output=True, text=True, timeout=240, check=False)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    out = json.loads(lines[0].removeprefix("RESULT "))

    resume = out["resume"]
    assert resume["fallback_reason"] is None, resume
    assert any("split from one parent" in a for a in resume["actions"]), resume["actions"]
    assert out["sums"] == [1.0] * 4
    assert out["resident"] > 0  # the parent's memory counts with its children's
    pause = out["pause"]
    assert any("and the parent they were split from" in a for a in pause["actions"]), pause["actions"]
    assert pause["freed_bytes"] > 0
