"""What the daemon reads of a chunk handle is parsed once, when the payload is made, into one type per transport
on the wire (engines/handles.py): the orchestration reads these fields, never the handle's keys."""

from __future__ import annotations

from dataclasses import replace

import pytest

from colocd.engines.base import ChunkPart
from colocd.engines.handles import HostRoute, PayloadRoute, ShmRoute, parse_handle
from colocd.engines.vllm.wire import update_info
from colocd.policies import Transport


def _part(transport: Transport, **handle: object) -> ChunkPart:
    return ChunkPart(rank=0, transport=transport, nbytes=8, handle=dict(handle))


@pytest.mark.parametrize("transport, handle, route", [
    (Transport.SHM, {"shm_name": "colocd-x", "nbytes": 8}, ShmRoute(None, "colocd-x")),
    (Transport.CUDA_IPC, {"payload_b64": "", "device_uuid": "GPU-1", "load_format": "direct"},
     PayloadRoute("GPU-1", "", "direct")),
    (Transport.PER_TENSOR, {"device_uuid": "GPU-2"}, PayloadRoute("GPU-2")),  # travels as cuda_ipc
    (Transport.DISK, {"path": "/x", "device_uuid": 7}, HostRoute(None)),  # a device not named as a string
    (Transport.INLINE, {"payload_b64": "", "load_format": 5}, PayloadRoute(None, "", None)),  # not a string: unsaid
])
def test_each_transport_parses_into_its_route(transport: Transport, handle: dict[str, object],
                                               route: object) -> None:
    assert _part(transport, **handle).route == route


def test_a_new_handle_is_parsed_anew() -> None:
    part = _part(Transport.SHM, shm_name="colocd-x", nbytes=8)
    assert replace(part, handle={"shm_name": "colocd-y", "nbytes": 8}).route == ShmRoute(None, "colocd-y")


def test_a_typed_handle_travels_on_as_the_json_it_was_parsed_from_with_its_route_from_the_model() -> None:
    sent = {"payload_b64": "AAAA", "layout": [], "device_uuid": "GPU-1", "ipc_handles_pickled": "x"}
    part = ChunkPart.of(rank=0, transport=Transport.CUDA_IPC, nbytes=8,
                        handle=parse_handle(Transport.CUDA_IPC, sent))
    assert part.handle is sent  # forwarded as the trainer sent it, the engine's keys the model does not name included
    assert part.route == PayloadRoute("GPU-1", "AAAA")


def test_vllms_extension_gets_each_part_as_the_trainer_sent_it_under_its_wire_transport() -> None:
    handle = {"payload_b64": "AAAA", "load_format": "direct", "device_uuid": "GPU-1"}
    sent = update_info(3, (_part(Transport.PER_TENSOR, **handle),))
    assert sent == {"seq": 3, "payloads": [{"rank": 0, "transport": "cuda_ipc", "nbytes": 8, "handle": handle}]}
