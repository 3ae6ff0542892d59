"""A benchmark sink loads a ``flattened_bucket`` by its shape's plan: the bucket's bytes, all or nothing."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace

import pytest
import torch

from benchmarks.load_plan import LoadPlans
from benchmarks.sink import WeightSink
from colocd.engines.reference.payloads import PayloadError

_NAMES = ("model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
          "model.layers.0.self_attn.q_proj.weight", "model.norm.weight")


def _sink() -> WeightSink:
    sink = WeightSink("tiny", torch.device("cpu"))
    for t in sink.tensors.values():
        t.view(torch.int16).fill_(7)  # known bytes, to see that a refused chunk changed none
    return sink


def _bucket(sink: WeightSink, *, lead: int = 0, seed: int = 0) -> tuple[torch.Tensor, list[SimpleNamespace]]:
    """A bucket of _NAMES' shapes with random bytes, starting ``lead`` bytes into its storage."""
    metadata, offset = [], 0
    for name in _NAMES:
        dst = sink.tensors[name]
        nbytes = dst.numel() * dst.element_size()
        metadata.append(SimpleNamespace(name=name, shape=dst.shape, dtype=dst.dtype, start_idx=offset,
                                        end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (lead + offset,), dtype=torch.uint8, generator=gen)
    return storage[lead:], metadata


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _snapshot(sink: WeightSink) -> dict[str, bytes]:
    return {n: _bytes(t) for n, t in sink.tensors.items()}


def test_a_bucket_lands_byte_for_byte_in_its_destinations() -> None:
    sink = _sink()
    flat, metadata = _bucket(sink)
    assert sink.load_bucket(flat, metadata) == list(_NAMES)
    for m in metadata:
        assert _bytes(sink.tensors[m.name]) == _bytes(flat[m.start_idx : m.end_idx])


def test_a_later_bucket_of_the_same_shape_lands_its_own_bytes() -> None:
    sink = _sink()
    sink.load_bucket(*_bucket(sink, seed=1))
    flat, metadata = _bucket(sink, seed=2)
    sink.load_bucket(flat, metadata)
    assert all(_bytes(sink.tensors[m.name]) == _bytes(flat[m.start_idx : m.end_idx]) for m in metadata)


def test_a_bucket_that_starts_inside_its_storage_lands_its_own_bytes_not_the_storages_head() -> None:
    sink = _sink()
    flat, metadata = _bucket(sink, lead=64)
    sink.load_bucket(flat, metadata)
    assert all(_bytes(sink.tensors[m.name]) == _bytes(flat[m.start_idx : m.end_idx]) for m in metadata)


def test_an_unknown_tensor_is_refused_naming_it_and_nothing_is_copied() -> None:
    sink = _sink()
    flat, metadata = _bucket(sink)
    metadata[-1].name = "model.layers.99.mlp.up_proj.weight"
    before = _snapshot(sink)
    with pytest.raises(ValueError, match=r"unknown tensor 'model\.layers\.99\.mlp\.up_proj\.weight'"):
        sink.load_bucket(flat, metadata)
    assert _snapshot(sink) == before


def test_a_wrong_shape_after_good_tensors_is_refused_naming_it_and_nothing_is_copied() -> None:
    sink = _sink()
    sink.load_bucket(*_bucket(sink, seed=1))  # the right shape's plan exists; a wrong one must not reuse it
    flat, metadata = _bucket(sink, seed=2)
    metadata[-1].shape = torch.Size([metadata[-1].shape[0] // 2, 2])
    before = _snapshot(sink)
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        sink.load_bucket(flat, metadata)
    assert _snapshot(sink) == before


def test_a_buffer_shorter_than_its_metadata_is_refused_and_nothing_is_copied() -> None:
    sink = _sink()
    flat, metadata = _bucket(sink)
    sink.load_bucket(flat, metadata)
    before = _snapshot(sink)
    with pytest.raises(PayloadError, match="does not fit"):
        sink.load_bucket(flat[:-2], metadata)
    assert _snapshot(sink) == before


def test_a_release_frees_the_destinations_a_plan_held() -> None:
    sink = _sink()
    sink.load_bucket(*_bucket(sink))
    held = weakref.ref(sink.tensors[_NAMES[0]])
    sink.release_weights()
    gc.collect()
    assert held() is None
    sink.resume_weights()
    flat, metadata = _bucket(sink, seed=3)
    sink.load_bucket(flat, metadata)  # the new destinations, not the released ones
    assert _bytes(sink.tensors[_NAMES[0]]) == _bytes(flat[metadata[0].start_idx : metadata[0].end_idx])


def test_a_buffer_that_cannot_hold_a_later_dtype_is_refused_before_any_copy() -> None:
    dsts = {"a": torch.zeros(8, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.float32)}
    metadata = [SimpleNamespace(name="a", shape=torch.Size([8]), dtype=torch.bfloat16, start_idx=0, end_idx=16),
                SimpleNamespace(name="b", shape=torch.Size([4]), dtype=torch.float32, start_idx=16, end_idx=32)]
    flat = torch.full((34,), 1, dtype=torch.uint8)[2:]  # 2 bytes into its storage: bf16 fits there, float32 not
    with pytest.raises(PayloadError, match=r"cannot hold torch\.float32"):
        LoadPlans("test").plan(flat, metadata, dsts).apply(flat)
    assert not dsts["a"].any() and not dsts["b"].any()
