"""What the daemon checks on this node of a trainer's chunk handle before any engine sees it (``Handle.inspect``,
engines/handles.py); the form of each field the API's handle models refuse (tests/integration/test_handle_models.py)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from colocd.engines.chunks import MAX_LAYOUT_ENTRIES, ChunkLayout, SharedSegment
from colocd.engines.handles import parse_handle
from colocd.errors import RequestInvalid
from colocd.policies import Transport


@pytest.fixture
def segment() -> Any:
    seg = SharedSegment.create(1024)
    yield seg
    seg.close()
    seg.unlink()


def inspect_handle(transport: str, nbytes: int, handle: dict[str, Any]) -> ChunkLayout:
    """As the daemon inspects a chunk: its handle parsed once (the API), then checked on this node."""
    return parse_handle(Transport(transport), handle).inspect(nbytes)


def _layout() -> list[dict[str, Any]]:
    return ChunkLayout.for_tensors([("a", torch.zeros(4)), ("b", torch.zeros(2, 2))]).to_json()


def test_a_readable_shm_handle_yields_its_layout(segment: SharedSegment) -> None:
    layout = inspect_handle("shm", 1024, {"shm_name": segment.name, "nbytes": 1024, "layout": _layout()})
    assert layout is not None and [t.name for t in layout.tensors] == ["a", "b"]


@pytest.mark.parametrize(
    ("transport", "nbytes", "handle", "field", "words"),
    [
        ("shm", 8, {"shm_name": "colocd-1-0a1b2c3d4e5f", "nbytes": 8, "layout": []}, "handle.shm_name",
         "no shared-memory segment"),
        ("shm", 8, {"shm_name": "colocd-1-0a1b2c3d4e5f", "nbytes": 16, "layout": []}, "handle.nbytes", "got 16"),
        ("cuda_ipc", 8, {"payload_b64": "not base64!"}, "handle.payload_b64", "not base64"),
        ("disk", 8, {"path": "relative.safetensors"}, "handle.path", "absolute path"),
    ],
)
def test_unreadable_handles_are_refused_naming_the_field(
    transport: str, nbytes: int, handle: dict[str, Any], field: str, words: str
) -> None:
    with pytest.raises(RequestInvalid, match=words) as err:
        inspect_handle(transport, nbytes, handle)
    assert err.value.field == field


@pytest.mark.parametrize(
    ("layout", "words"),
    [
        ("nope", "must be a list"),
        ([{"name": "a", "dtype": "float32", "shape": [4], "offset": 1020}], "past the chunk"),
        ([{"name": "a", "dtype": "complex7", "shape": [4], "offset": 0}], "unknown dtype"),
        ([{"name": "a", "dtype": "float32", "shape": [1], "offset": 0}] * 2, "more than once"),
        ([{"name": "a", "dtype": "float32"}], "KeyError"),
    ],
)
def test_bad_layouts_are_refused(segment: SharedSegment, layout: Any, words: str) -> None:
    with pytest.raises(RequestInvalid, match=words) as err:
        inspect_handle("shm", 1024, {"shm_name": segment.name, "nbytes": 1024, "layout": layout})
    assert err.value.field == "handle.layout"


def test_a_segment_smaller_than_nbytes_is_refused(segment: SharedSegment) -> None:
    with pytest.raises(RequestInvalid, match="holds 1024 bytes") as err:
        inspect_handle("shm", 10**12, {"shm_name": segment.name, "nbytes": 10**12, "layout": []})
    assert err.value.field == "nbytes"


def test_a_layout_longer_than_any_chunk_is_refused_before_parsing_it(segment: SharedSegment) -> None:
    huge = [{"name": f"t{i}", "dtype": "uint8", "shape": [0], "offset": 0} for i in range(MAX_LAYOUT_ENTRIES + 1)]
    with pytest.raises(RequestInvalid, match=f"at most {MAX_LAYOUT_ENTRIES}"):
        inspect_handle("shm", 1024, {"shm_name": segment.name, "nbytes": 1024, "layout": huge})
