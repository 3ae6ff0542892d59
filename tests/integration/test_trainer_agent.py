"""The trainer agent enacts the daemon's directives for real (a gloo world of one) and reports the costs."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import torch.distributed as dist
from support import daemon_node

from colocd.api.client import AsyncColocdClient
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.reference.model import QwenLikeConfig, build_model
from colocd.trainer.agent import TrainerAgent
from colocd.trainer.groups import GroupLifecycle, GroupSpec
from colocd.trainer.push import WeightPusher


@pytest.fixture
def gloo_world(tmp_path: object) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
async def client(pooled_engine: ReferenceEngineProcess, tmp_path: object) -> AsyncIterator[AsyncColocdClient]:
    policy = tmp_path / "policies.yaml"  # type: ignore[operator]
    policy.write_text("apiVersion: colocd/v1\nprocess_groups:\n  policy: keep_alive\ncleanup:\n  policy: aggressive\n")
    async with daemon_node({"ref0": str(pooled_engine.url)}, policy_file=str(policy)) as node:
        yield node.client


async def test_agent_keeps_groups_alive_and_reports_groups_and_cleanup_in_the_step_trace(
        gloo_world: None, client: AsyncColocdClient) -> None:
    lifecycle = GroupLifecycle([GroupSpec("tp"), GroupSpec("dp")], agree_timeout_s=10, group_timeout_s=10)
    lifecycle.build()
    agent = TrainerAgent(client, groups=lifecycle)
    model = build_model(QwenLikeConfig(), seed=3)
    for step in (1, 2):
        train = await agent.train(step)
        assert train["directives"]["process_groups"]["action"] == "keep"
        sync = await agent.sync(step)
        await WeightPusher(client).push(model.named_parameters(), version=str(step), step=step)
        await agent.rollout(step)
        report = agent.last_reports["groups_report"]
        assert report["action"] == "keep" and report["policy"] == "keep_alive"
        names = {s["name"] for s in sync["trace"]["spans"]}
        assert "trainer.process_groups" in names
        assert {"trainer.cleanup.gc_collect", "trainer.cleanup.empty_cache"} <= names
    lifecycle.close()


async def test_overlapped_agent_destroys_groups_off_the_sync_path_and_reports_it_with_rollout(
        gloo_world: None, client: AsyncColocdClient) -> None:
    document = b"apiVersion: colocd/v1\nprocess_groups: {policy: destroy, post_destroy_wait_s: 0}\n"
    async with client._session().put("/v1/policies", headers={"Content-Type": "application/yaml"},
                                     data=document) as staged:
        assert staged.status == 200, await staged.text()
    lifecycle = GroupLifecycle([GroupSpec("tp"), GroupSpec("dp")], agree_timeout_s=10, group_timeout_s=10)
    lifecycle.build()
    agent = TrainerAgent(client, groups=lifecycle, overlap_groups=True)
    model = build_model(QwenLikeConfig(), seed=3)
    for step in (1, 2):
        await agent.train(step)
        await agent.groups_ready()
        assert lifecycle.state == "live"  # usable for the step's collectives
        sync = await agent.sync(step)
        await WeightPusher(client).push(model.named_parameters(), version=str(step), step=step)
        rollout = await agent.rollout(step)
        # The destroy ran between sync and rollout; its report came with the rollout call.
        assert lifecycle.state == "destroyed"
        assert "trainer.process_groups" not in {s["name"] for s in sync["trace"]["spans"]}
        spans = {s["name"]: s for s in rollout["trace"]["spans"]}
        assert spans["trainer.process_groups"]["attrs"]["action"] == "destroy"
    lifecycle.close()
