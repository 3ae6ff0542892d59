"""Every transport's chunk carries its layout, and the daemon checks it (daemon/weights.py, engines/chunks.py).

The CUDA transports' handles are built here as their producers build them (trainer/producer.py, trainer/ring.py),
with no GPU: the daemon never opens their bytes, so what it checks is the layout each one carries. Two trainer
ranks feed one TP=1 engine each (``feed_ranks``), the layout of the issue's disjoint push.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support import chunk_part

from colocd.daemon.manifests import manifest_from_json
from colocd.daemon.metrics import Metrics
from colocd.daemon.states import EngineRecord
from colocd.daemon.trace import Trace
from colocd.daemon.weights import WeightSession
from colocd.daemon.worker import EngineHandle
from colocd.engines.base import ChunkLoad, ChunkPart
from colocd.engines.chunks import ChunkLayout
from colocd.engines.config import ReferenceEngineConfig
from colocd.errors import RequestInvalid
from colocd.policies import Transport
from colocd.trainer.push import manifest_of

TENSORS = [(f"w{i}", torch.zeros(4, 2)) for i in range(4)]


class RecordingEngine:
    """Loads nothing; records which chunks reached it."""

    transports = frozenset(Transport)

    def __init__(self, name: str) -> None:
        self.name = name
        self.loads: list[int] = []

    async def load_weights(self, load: ChunkLoad) -> None:
        self.loads.append(load.seq)


def _session(engines: list[RecordingEngine]) -> WeightSession:
    handles = [EngineHandle(adapter=e, state=EngineRecord(e.name),  # type: ignore[arg-type]
                            config=ReferenceEngineConfig(name=e.name, url="http://127.0.0.1:9"))
               for e in engines]
    return WeightSession(step=1, version="v", ranks=2, engines=handles, depth=2, chunk_timeout_s=5.0,
                         trace=Trace(1, "weights"), metrics=Metrics(),
                         sources={"a": (0,), "b": (1,)}, manifest=manifest_from_json(manifest_of(TENSORS)))


def _layout(named: list[tuple[str, torch.Tensor]]) -> list[dict[str, Any]]:
    return ChunkLayout.for_tensors(named).to_json()


def _part(transport: str, rank: int, named: list[tuple[str, torch.Tensor]]) -> ChunkPart:
    """One rank's chunk as its producer describes it."""
    layout = _layout(named)
    handles: dict[str, tuple[str, dict[str, Any]]] = {
        "cuda_ipc": ("cuda_ipc", {"payload_b64": "", "load_format": "flattened_bucket", "device_uuid": "u",
                                  "layout": layout}),
        "per_tensor": ("cuda_ipc", {"payload_b64": "", "load_format": "direct", "device_uuid": "u",
                                    "layout": layout}),
    }
    wire, handle = handles[transport]
    return chunk_part(rank=rank, transport=wire, nbytes=ChunkLayout.for_tensors(named).nbytes, handle=handle)


CUDA_TRANSPORTS = ["cuda_ipc", "per_tensor"]


@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
async def test_disjoint_chunks_from_two_ranks_are_refused_at_the_second_naming_both(transport: str) -> None:
    a, b = RecordingEngine("a"), RecordingEngine("b")
    session = _session([a, b])
    await session.submit(0, _part(transport, 0, TENSORS[0::2]))
    with pytest.raises(RequestInvalid, match="carries other tensors than rank 0's chunk 0") as refused:
        await session.submit(0, _part(transport, 1, TENSORS[1::2]))
    assert refused.value.field == "handle.layout" and "missing 'w0', 'w2'" in str(refused.value)
    assert (a.loads, b.loads) == ([0], [])  # nothing of the refused part reached its engine


@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
async def test_a_chunk_without_its_layout_is_refused_before_any_engine_sees_it(transport: str) -> None:
    a, b = RecordingEngine("a"), RecordingEngine("b")
    with_layout = _part(transport, 0, TENSORS)
    part = chunk_part(0, with_layout.transport, with_layout.nbytes,
                      {k: v for k, v in with_layout.handle.wire.items() if k != "layout"})
    with pytest.raises(RequestInvalid, match="carries its layout") as refused:
        await _session([a, b]).submit(0, part)
    assert refused.value.field == "handle.layout" and a.loads == []


@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
async def test_a_tensor_outside_the_manifest_or_of_another_shape_is_refused(transport: str) -> None:
    session = _session([RecordingEngine("a"), RecordingEngine("b")])
    with pytest.raises(RequestInvalid, match="not in the session's manifest"):
        await session.submit(0, _part(transport, 0, [("stray", torch.zeros(4, 2))]))
    with pytest.raises(RequestInvalid, match=r"'w0' is float32\[8\], the manifest says float32\[4, 2\]"):
        await session.submit(0, _part(transport, 0, [("w0", torch.zeros(8))]))


@pytest.mark.parametrize("transport", CUDA_TRANSPORTS)
async def test_what_counts_as_sent_is_what_the_layouts_carried_never_the_manifest(transport: str) -> None:
    # Both ranks send the same half: the plan agrees, and at commit each engine lacks the other half.
    a, b = RecordingEngine("a"), RecordingEngine("b")
    session = _session([a, b])
    for rank in (0, 1):
        await session.submit(0, _part(transport, rank, TENSORS[:2]))
    with pytest.raises(RequestInvalid, match=r"engine 'a' never received 'w2', 'w3', declared in the manifest "
                                              r"\(TP rank 0 \(device .*\) lacks 'w2', 'w3'\)"):
        session.check_complete()


def test_a_disk_chunk_without_its_layout_is_refused_and_with_it_yields_the_layout(tmp_path: Any) -> None:
    from colocd.engines.handles import DiskHandle

    path = tmp_path / "chunk.safetensors"
    path.write_bytes(b"\0" * 8)
    with pytest.raises(RequestInvalid, match="a disk chunk carries its layout") as refused:
        DiskHandle(path=str(path)).inspect(8)
    assert refused.value.field == "handle.layout"
    layout = DiskHandle(path=str(path), layout=_layout(TENSORS)).inspect(8)
    assert [t.name for t in layout.tensors] == [n for n, _ in TENSORS]


def test_a_broadcasts_descriptor_is_checked_against_the_manifest_before_any_engine_joins_it() -> None:
    from colocd.daemon.manifests import TensorMeta

    session = _session([RecordingEngine("a"), RecordingEngine("b")])
    session.check_broadcast(0, [("w0", TensorMeta("float32", (4, 2)))])
    with pytest.raises(RequestInvalid, match="broadcast 1: tensors not in the session's manifest: 'stray'"):
        session.check_broadcast(1, [("stray", TensorMeta("float32", (4, 2)))])
    with pytest.raises(RequestInvalid, match=r"'w1' is bfloat16\[4, 2\], the manifest says float32\[4, 2\]"):
        session.check_broadcast(1, [("w1", TensorMeta("bfloat16", (4, 2)))])
