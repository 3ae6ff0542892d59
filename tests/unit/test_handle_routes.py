"""What the daemon reads of a chunk handle is parsed once, where the chunk comes in, into one type per transport
on the wire (engines/handles.py): the orchestration reads the route of that model, never the handle's keys, and an
adapter forwards the JSON object the trainer sent."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from support import chunk_part

from colocd.engines.handles import HostRoute, PayloadRoute, ShmRoute
from colocd.engines.vllm.wire import update_info
from colocd.policies import Transport


@pytest.mark.parametrize("transport, handle, route", [
    (Transport.SHM, {"shm_name": "colocd-1-ab", "nbytes": 8}, ShmRoute(None, "colocd-1-ab")),
    (Transport.CUDA_IPC, {"payload_b64": "", "device_uuid": "GPU-1", "load_format": "direct"},
     PayloadRoute("GPU-1", "", "direct")),
    (Transport.PER_TENSOR, {"payload_b64": "", "device_uuid": "GPU-2"}, PayloadRoute("GPU-2", "")),  # as cuda_ipc
    (Transport.DISK, {"path": "/x"}, HostRoute(None)),
    (Transport.INLINE, {"payload_b64": "", "load_format": "direct"}, PayloadRoute(None, "", "direct")),
])
def test_each_transport_parses_into_its_route(transport: Transport, handle: dict[str, object],
                                               route: object) -> None:
    assert chunk_part(0, transport, 8, handle).route == route


@pytest.mark.parametrize("transport, handle", [
    (Transport.DISK, {"path": "/x", "device_uuid": "GPU-1"}),  # a colocd format takes no key it does not name
    (Transport.INLINE, {"payload_b64": "", "load_format": 5}),  # a field of the wrong type
    (Transport.CUDA_IPC, {"payload_b64": "", "shm_name": "colocd-1-ab"}),  # another colocd transport's field
])
def test_a_handle_its_transports_model_refuses_never_becomes_a_part(transport: Transport,
                                                                    handle: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        chunk_part(0, transport, 8, handle)


def test_a_typed_handle_travels_on_as_the_json_it_was_parsed_from_with_its_route_from_the_model() -> None:
    sent = {"payload_b64": "AAAA", "layout": [], "device_uuid": "GPU-1", "ipc_handles_pickled": "x"}
    part = chunk_part(0, Transport.CUDA_IPC, 8, sent)
    assert part.handle.wire is sent  # forwarded as sent, the engine's keys the model does not name included
    assert part.route == PayloadRoute("GPU-1", "AAAA")


def test_vllms_extension_gets_each_part_as_the_trainer_sent_it_under_its_wire_transport() -> None:
    handle = {"payload_b64": "AAAA", "load_format": "direct", "device_uuid": "GPU-1"}
    sent = update_info(3, (chunk_part(0, Transport.PER_TENSOR, 8, handle),))
    assert sent == {"seq": 3, "payloads": [{"rank": 0, "transport": "cuda_ipc", "nbytes": 8, "handle": handle}]}
