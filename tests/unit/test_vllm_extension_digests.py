"""colocd's vLLM worker extension records the digest of every tensor as it loads it (without vLLM: a stand-in
model; the real server is tests/vllm/test_vllm_verify.py)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from colocd.engines.chunks import ChunkLayout, SharedSegment, flatten_into
from colocd.engines.digest import tensor_digests
from colocd.engines.vllm import extension


class _Model:
    """Takes whatever ``load_weights`` is given, as vLLM's model does (it may also fuse or convert it)."""

    def __init__(self) -> None:
        self.loaded: list[str] = []

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        for name, t in weights:
            self.loaded.append(name)
            t.zero_()  # what the model does with a tensor afterwards does not change what was received


def _payload(named: list[tuple[str, torch.Tensor]], segment: SharedSegment, layout: ChunkLayout) -> dict[str, Any]:
    flatten_into(segment.tensor(), layout, named)
    return {"rank": 0, "transport": "shm",
            "handle": {"shm_name": segment.name, "nbytes": layout.nbytes, "layout": layout.to_json()}}


def test_the_worker_reports_the_digest_of_each_tensor_as_it_received_it(monkeypatch: Any) -> None:
    monkeypatch.setattr(extension, "_STATE", extension._UpdateState(active=True))
    named = [("a.weight", torch.randn(8, 4)), ("b.bias", torch.randn(3).to(torch.bfloat16))]
    layout = ChunkLayout.for_tensors(named)
    segment = SharedSegment.create(layout.nbytes)
    try:
        model = _Model()
        assert extension.load(model, None, extension.ChunkReceiver(torch.device("cpu")),
                              [_payload(named, segment, layout)]) == 2
    finally:
        segment.close()
        segment.unlink()
    assert model.loaded == ["a.weight", "b.bias"]
    worker = extension.ColocdWorkerExtension()
    assert worker.colocd_received_digests(["a.weight", "b.bias", "c"]) == tensor_digests(named)
