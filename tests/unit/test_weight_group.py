"""The flattened-bucket layout, dtype names and broadcast descriptors of the separated-GPU path (no I/O)."""

from __future__ import annotations

import pytest
import torch

from colocd.daemon.distributed import BroadcastDescriptor
from colocd.engines.weight_group import chunk_order, flattened_layout, parse_dtype


def test_flattened_layout_packs_tensors_back_to_back_without_padding() -> None:
    layout = flattened_layout(["a", "b", "c"], ["float32", "bfloat16", "int8"], [[2, 3], [5], [3]])
    assert [(e.name, e.start, e.end) for e in layout] == [("a", 0, 24), ("b", 24, 34), ("c", 34, 37)]
    assert layout[1].dtype is torch.bfloat16 and layout[0].shape == (2, 3)


def test_a_misaligned_offset_is_refused_naming_the_tensor_and_its_itemsize() -> None:
    expected = r"tensor 'w' \(float32\) would start at byte 3, not a multiple of its itemsize 4"
    with pytest.raises(ValueError, match=expected):
        flattened_layout(["b", "w"], ["int8", "float32"], [[3], [2]])


def test_bucket_order_makes_any_mix_of_dtypes_aligned() -> None:
    named = [("i8", torch.zeros(3, dtype=torch.int8)), ("f32", torch.zeros(5)),
             ("bf16", torch.zeros(7, dtype=torch.bfloat16)), ("f64", torch.zeros(1, dtype=torch.float64))]
    ordered = chunk_order(named)
    assert [n for n, _ in ordered] == ["f64", "f32", "bf16", "i8"]
    flattened_layout([n for n, _ in ordered], [str(t.dtype).removeprefix("torch.") for _, t in ordered],
                     [list(t.shape) for _, t in ordered])


def test_dtype_names_are_sglangs_getattr_torch_names() -> None:
    assert parse_dtype("bfloat16") is parse_dtype("torch.bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype 'complex7'"):
        parse_dtype("complex7")


@pytest.mark.parametrize(("fields", "message"), [
    ({"names": ()}, "at least one tensor"),
    ({"dtypes": ("float32", "float32")}, "one entry per tensor"),
    ({"load_format": "direct"}, "load_format"),
    ({"shapes": ((-1,),)}, "negative dimension"),
    ({"dtypes": ("float33",)}, "unknown dtype"),
])
def test_a_broadcast_descriptor_validates_itself(fields: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"seq": 0, "group_name": "g", "names": ("w",), "dtypes": ("float32",), "shapes": ((2,),)}
    with pytest.raises(ValueError, match=message):
        BroadcastDescriptor(**{**base, **fields})  # type: ignore[arg-type]


def test_a_broadcast_descriptor_counts_its_bytes() -> None:
    desc = BroadcastDescriptor(seq=0, group_name="g", names=("a", "b"), dtypes=("float32", "bfloat16"),
                               shapes=((2, 3), (4,)), load_format="flattened_bucket")
    assert desc.nbytes == 24 + 8
