"""CUDA transports end to end: this process is the trainer, a reference engine on the same GPU the consumer.

One engine (holding ``tiny`` sink tensors on the GPU) and one in-process daemon serve the module;
every push is verified by device checksums of what the engine received.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import torch
from support import DaemonNode, daemon_node, reference_engine, shm_segments

from benchmarks.sink import device_checksum
from benchmarks.sink_engine import sink_launch
from colocd.api.client import ColocdHTTPError
from colocd.engines import cuda_handles
from colocd.trainer.push import WeightPusher

pytestmark = [pytest.mark.gpu, pytest.mark.asyncio(loop_scope="module")]

_DEVICE = torch.device("cuda", 0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def node() -> AsyncIterator[DaemonNode]:
    """The module's engine (``tiny`` sink tensors on the GPU) and a daemon over it, left in ``sync`` at step 1."""
    async with reference_engine(device="cuda", launch=sink_launch("tiny", ready_timeout_s=300)) \
            as engine, daemon_node(
                [{"kind": "reference", "name": "ref0", "url": str(engine.url), "device": "cuda"}],
                timeouts={"chunk_s": 60}, synced_at=1) as daemon:
        yield daemon


async def _push(pusher: WeightPusher, named: list[tuple[str, torch.Tensor]]) -> list[list[int]]:
    """Fill ``named`` with fresh values, push them as a new version, return the trainer-side checksums."""
    for _, t in named:
        t.normal_()
    await pusher.push(named, version=uuid.uuid4().hex)
    return device_checksum(t for _, t in named)


async def _sink(node: DaemonNode) -> dict[str, Any]:
    return dict(await node.engine_get("/colocd/sink"))


def _received(sink: dict[str, Any], named: list[tuple[str, torch.Tensor]]) -> list[list[int]]:
    return [sink["checksums"][n] for n, _ in named]


@pytest.mark.parametrize("transport", ["cuda_ipc", "per_tensor", "inline"])
async def test_every_transport_delivers_byte_identical_weights_twice(
    node: DaemonNode, named: list[tuple[str, torch.Tensor]], transport: str
) -> None:
    async with WeightPusher(node.client, transport=transport, bucket_mb=1, depth=2) as pusher:
        expected = await _push(pusher, named)
        assert _received(await _sink(node), named) == expected
        expected = await _push(pusher, named)
        assert _received(await _sink(node), named) == expected
    assert not shm_segments()


async def test_fresh_cuda_ipc_buckets_are_given_back_after_each_ack(
    node: DaemonNode, named: list[tuple[str, torch.Tensor]]
) -> None:
    async with WeightPusher(node.client, transport="cuda_ipc", bucket_mb=1, depth=3) as pusher:
        await _push(pusher, named)
        after_first = torch.cuda.memory_allocated(_DEVICE)
        for _ in range(3):
            await _push(pusher, named)
        assert torch.cuda.memory_allocated(_DEVICE) <= after_first


async def test_an_aborted_stream_leaves_the_pusher_ready_for_the_next_push(
    node: DaemonNode, named: list[tuple[str, torch.Tensor]]
) -> None:
    async with WeightPusher(node.client, transport="cuda_ipc", bucket_mb=1, depth=2) as pusher:
        sid = (await node.client.open_session("aborted", ranks=1, depth=2))["session_id"]
        chunks, _ = await pusher.stream(sid, named[:3])
        await node.client.abort(sid)
        assert chunks >= 1
        expected = await _push(pusher, named)
    assert _received(await _sink(node), named) == expected


async def test_a_handle_from_a_gpu_the_engine_cannot_see_is_a_clear_error(
    node: DaemonNode, named: list[tuple[str, torch.Tensor]], monkeypatch: pytest.MonkeyPatch
) -> None:
    bogus = "GPU-00000000-0000-0000-0000-000000000000"
    monkeypatch.setattr(cuda_handles, "device_uuid", lambda index: bogus)  # what the producer's handle names
    async with WeightPusher(node.client, transport="cuda_ipc", bucket_mb=1, depth=1) as pusher:
        with pytest.raises(ColocdHTTPError) as err:
            await _push(pusher, named)
    # The caller's handle is wrong, not the engine: a 422 naming the field, before any engine opens it.
    assert err.value.status == 422 and err.value.body["field"] == "handle.device_uuid", err.value.body
    assert bogus in err.value.body["message"] and "its own GPU" in err.value.body["message"]
