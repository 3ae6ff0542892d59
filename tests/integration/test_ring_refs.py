"""ipc_ring by reference through the daemon (issue 12 item 5): a repeated push carries refs, not content.

The forwarding rules run on ``WeightSession`` with an in-memory engine that records every descriptor it is
sent (CUDA IPC cannot run here; tests/gpu/test_ring_refs.py pushes real ring chunks). What the daemon
process answers a trainer that names a ref it never got is checked against ``colocd serve`` over HTTP.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import daemon_node

from colocd.api.client import AsyncColocdClient, ColocdHTTPError
from colocd.daemon.engine_ops import EngineHandle
from colocd.daemon.errors import RequestInvalid, RingRefUnknown
from colocd.daemon.metrics import Metrics
from colocd.daemon.states import EngineRecord
from colocd.daemon.trace import Trace
from colocd.daemon.weights import WeightSession
from colocd.engines.base import ChunkLoad, ChunkPart, EngineInfo
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.errors import RingRefsUnknown
from colocd.engines.reference.launcher import ReferenceEngineProcess
from colocd.engines.ring_refs import UNKNOWN_REF_MARK, RingDirectory, layout_digest
from colocd.policies import Transport

LAYOUT = [{"name": "w", "dtype": "float32", "shape": [4], "offset": 0, "slot": 2},
          {"name": "b", "dtype": "float32", "shape": [2], "offset": 256, "slot": 2}]
REF = layout_digest(LAYOUT)
HANDLES = {"2": {"handle": "aGFuZGxlMg==", "storage_offset": 0}}


class RecordingEngine:
    """An in-memory engine adapter that keeps every ring descriptor it is sent and, like the reference engine's
    ring table, refuses a ref it was never sent in full (``forget`` plays a restart the daemon did not see)."""

    transports = frozenset(Transport)

    def __init__(self, name: str = "e0") -> None:
        self.name = name
        self.received: list[dict[str, Any]] = []
        self._layouts: set[str] = set()
        self._slots: set[str] = set()

    def forget(self) -> None:
        self._layouts.clear()
        self._slots.clear()

    async def load_weights(self, load: ChunkLoad) -> None:
        (part,) = load.payloads
        handle = part.handle
        self.received.append(handle)
        if "layout_ref" not in handle:
            return  # the original format: everything inline
        if ("layout" not in handle and handle["layout_ref"] not in self._layouts) or any(
                str(e["slot"]) not in self._slots and str(e["slot"]) not in (handle.get("open") or {})
                for e in handle.get("layout") or LAYOUT):
            raise RingRefsUnknown(self.name, f"ring {handle['ring']}: not held here ({UNKNOWN_REF_MARK})", status=400)
        self._layouts.add(handle["layout_ref"])
        self._slots.update(handle.get("open") or {})


def _handle_of(engine: RecordingEngine) -> EngineHandle:
    return EngineHandle(adapter=engine, state=EngineRecord(engine.name),  # type: ignore[arg-type]
                        config=ReferenceEngineConfig(name=engine.name, url="http://127.0.0.1:9"))


def _session(handle: EngineHandle, rings: RingDirectory) -> WeightSession:
    return WeightSession(step=1, version="v1", ranks=1, engines=[handle], depth=1, chunk_timeout_s=10.0,
                         trace=Trace(1, "weights"), metrics=Metrics(), rings=rings)


def _part(**handle: Any) -> ChunkPart:
    return ChunkPart(rank=0, transport=Transport.IPC_RING, nbytes=24,
                       handle={"ring": "r1", "device_uuid": "u", "layout_ref": REF, **handle})


ANNOUNCING = {"layout": LAYOUT, "open": HANDLES}
FULL = {"ring": "r1", "device_uuid": "u", "layout_ref": REF, **ANNOUNCING}
BY_REF = {"ring": "r1", "device_uuid": "u", "layout_ref": REF}


async def test_a_repeated_layout_reaches_the_engine_as_a_ref_only() -> None:
    engine, rings = RecordingEngine(), RingDirectory()
    handle = _handle_of(engine)
    await _session(handle, rings).submit(0, _part(**ANNOUNCING))
    await _session(handle, rings).submit(0, _part())
    assert engine.received == [FULL, BY_REF]


async def test_an_engine_that_attached_again_gets_the_layout_and_handles_inline() -> None:
    engine, rings = RecordingEngine(), RingDirectory()
    handle = _handle_of(engine)
    await _session(handle, rings).submit(0, _part(**ANNOUNCING))
    engine.forget()
    handle.attached(EngineInfo(name="e0", engine_kind="reference", version="x", protocol="p",
                               weight_version=None, tp_size=1))  # what reconciliation does on a new incarnation
    await _session(handle, rings).submit(0, _part())
    assert engine.received == [FULL, FULL]


async def test_an_engine_that_lacks_a_ref_the_daemon_believed_it_held_gets_the_chunk_again_in_full() -> None:
    engine, rings = RecordingEngine(), RingDirectory()
    handle = _handle_of(engine)
    await _session(handle, rings).submit(0, _part(**ANNOUNCING))
    engine.forget()  # restarted without the daemon observing it
    ack = await _session(handle, rings).submit(0, _part())
    assert engine.received == [FULL, BY_REF, FULL] and ack.seq == 0


async def test_a_ref_this_daemon_never_got_is_a_409_naming_it_and_the_chunk_may_come_again_in_full() -> None:
    engine = RecordingEngine()
    session = _session(_handle_of(engine), RingDirectory())  # e.g. a daemon restarted since the announcement
    with pytest.raises(RingRefUnknown) as err:
        await session.submit(0, _part())
    assert err.value.state["ring"] == "r1" and err.value.state["layout_ref"] == REF
    assert engine.received == []
    await session.submit(0, _part(**ANNOUNCING))  # nothing was accepted: the same seq, in full
    assert engine.received == [FULL]


async def test_a_layout_ref_that_is_not_its_layouts_digest_is_refused_naming_the_field() -> None:
    session = _session(_handle_of(RecordingEngine()), RingDirectory())
    with pytest.raises(RequestInvalid) as err:
        await session.submit(0, _part(**ANNOUNCING, layout_ref="0" * 32))
    assert err.value.field == "handle.layout_ref"


async def test_a_descriptor_without_a_layout_ref_travels_as_before() -> None:
    engine = RecordingEngine()
    legacy = {"ring": "r1", "device_uuid": "u", "layout": LAYOUT, "open": HANDLES}
    handle = _handle_of(engine)
    for _ in range(2):
        await _session(handle, RingDirectory()).submit(0, ChunkPart(0, Transport.IPC_RING, 24, legacy))
    assert engine.received == [legacy, legacy]  # nothing stripped, nothing added


# --- colocd serve -------------------------------------------------------------------------------


@pytest.fixture
async def client(pooled_engine: ReferenceEngineProcess, tmp_path: Any) -> AsyncIterator[AsyncColocdClient]:
    async with daemon_node({"ref0": str(pooled_engine.url)}, subprocess=True, workdir=tmp_path) as daemon:
        await daemon.client.phase("train", 1)
        await daemon.client.phase("sync", 1)
        yield daemon.client


async def test_the_daemon_names_its_ring_record_in_every_join_and_refuses_an_unknown_ref_with_409(
        client: AsyncColocdClient) -> None:
    first = (await client.open_session("v1", ranks=1))["session_id"]
    joined = await client.join_session(first, rank=0, device_id="cpu:0")
    await client.abort(first)
    second = (await client.open_session("v1", ranks=1))["session_id"]
    rejoined = await client.join_session(second, rank=0, device_id="cpu:0")
    assert joined["ring_refs"] and rejoined["ring_refs"] == joined["ring_refs"]  # one record per daemon process
    with pytest.raises(ColocdHTTPError) as err:
        await client.send_chunk(second, seq=0, rank=0, chunk=ChunkPart(0, Transport.IPC_RING, 24, BY_REF))
    assert err.value.status == 409 and err.value.error == "RingRefUnknown"
    assert err.value.body["state"]["layout_ref"] == REF and REF in err.value.body["message"]
    assert (await client.session(second))["state"] == "open"  # refused, nothing accepted
