"""Every CUDA producer's chunk carries the layout the daemon reads (trainer/producer.py,
``Handle.inspect``, engines/handles.py): the tensors of the bucket, by name, dtype and shape, in order."""

from __future__ import annotations

import pytest
import torch

from colocd.engines.handles import parse_handle
from colocd.policies import Transport
from colocd.trainer.producer import Producer

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("transport", [Transport.CUDA_IPC, Transport.PER_TENSOR])
def test_a_cuda_producers_chunk_carries_the_layout_of_its_tensors(transport: Transport) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    named = [("a", torch.randn(4, 8, device="cuda")), ("b", torch.randn(16, device="cuda").half()),
             ("c", torch.ones(3, device="cuda", dtype=torch.int64))]
    producer = Producer(transport)
    try:
        chunk = producer.export(named)
        try:
            assert chunk.transport == transport.wire
            layout = parse_handle(chunk.transport, chunk.handle).inspect(chunk.nbytes)
            assert [(t.name, t.dtype, t.shape) for t in layout.tensors] == [
                ("a", "float32", (4, 8)), ("b", "float16", (16,)), ("c", "int64", (3,))]
        finally:
            chunk.release()
    finally:
        producer.close()
