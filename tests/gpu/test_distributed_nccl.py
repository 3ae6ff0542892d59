"""The separated-GPU path over NCCL: the trainer (this process) on cuda:0, a reference engine on cuda:1."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
import torch
from support import daemon_node, reference_engine, served_checksums, weights_checksum

from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.engines.weight_group import WeightGroup, master_store
from colocd.trainer.broadcast import DistributedWeightSender

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                       reason="NCCL needs one GPU per rank: two CUDA devices"),
]


@pytest.mark.parametrize("flattened", [False, True], ids=["per_tensor", "flattened_bucket"])
async def test_full_step_over_nccl_serves_exactly_the_trainers_weights(flattened: bool) -> None:
    torch.cuda.set_device(0)
    trained = build_model(QwenLikeConfig(), seed=123, device="cuda:0")
    async with asyncio.timeout(240), reference_engine(device="cuda:1", launch={"ready_timeout_s": 300}) as engine:
        async with daemon_node([{"kind": "reference", "name": "ref0", "url": str(engine.url), "device": "cuda:1"}],
                               timeouts={"chunk_s": 60, "default_s": 60}) as node:
            client = node.client
            async with DistributedWeightSender(client, backend="nccl", bucket_mb=0.05, flattened=flattened,
                                               timeout_s=60) as trainer:
                await trainer.open_group()
                await client.phase("train", 1)
                await client.phase("sync", 1)
                report = await trainer.push(trained.named_parameters(), version="v1", step=1)
                await client.phase("rollout", 1)
            served = await served_checksums(str(engine.url))
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                generated = (await http.post(f"{engine.url}/generate", json={
                    "input_ids": [1], "sampling_params": {"max_new_tokens": 4, "temperature": 0}})).json()
        assert report.chunks > 1
        assert served == [weights_checksum(trained.named_parameters())]
        assert generated["meta_info"]["weight_version"] == "v1"


_SGLANG_SIDE = """
import sys, datetime, torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous
port, timeout = int(sys.argv[1]), datetime.timedelta(seconds=60)
torch.cuda.set_device(1)
# sglang utils/common.py init_custom_process_group, as of 0.5.23
store, rank, world_size = next(rendezvous(f"tcp://127.0.0.1:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
pg, _ = _new_process_group_helper(world_size, rank, [], Backend("nccl"), PrefixStore("weight_update_group", store),
                                  group_name="weight_update_group", timeout=timeout)
_world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
t = torch.zeros(4, dtype=torch.bfloat16, device="cuda:1")
dist.broadcast(t, src=0, group=pg)
print(t.float().tolist())
"""


def test_the_trainers_nccl_group_joins_one_built_the_way_sglang_builds_it() -> None:
    torch.cuda.set_device(0)
    store = master_store("127.0.0.1", 2, 60)
    with subprocess.Popen([sys.executable, "-c", _SGLANG_SIDE, str(store.port)], stdout=subprocess.PIPE) as peer:
        group = WeightGroup.join(master_address="127.0.0.1", master_port=store.port, rank=0, world_size=2,
                                 group_name="weight_update_group", backend="nccl", timeout_s=60, store=store)
        group.broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16, device="cuda:0"))
        out, _ = peer.communicate(timeout=120)
    group.close()
    assert out.decode().strip().splitlines()[-1] == "[1.0, 2.0, 3.0, 4.0]"
