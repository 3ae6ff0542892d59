"""Ways to bring a training rank's state back onto its GPU, for ``benchmarks.switch`` to measure side by side.

``bulk`` is ``RankState.onload`` (benchmarks/offload.py): every tensor of a part is allocated, then the part's
copies are queued, part after part (weights, grads, optimizer). Its allocations (one ``cudaMalloc`` per weight
tensor after the cleanup gave the blocks back to the driver, then 16 GB of grads and 12 GB of optimizer shard on
8B) sit in front of the copies, so the switch pays both in a row.

``interleaved`` queues each copy as soon as its destination exists, largest part first: the optimizer shard
(one allocation, then 12 GB of copies on the PCIe link), then each weight tensor (allocated while the link is
busy with what was queued before it), then the grads (allocated and zeroed on the compute stream, beside the
copies). The host allocates while the copy engine moves bytes; same bytes, same streams, same final state.

``interleaved2`` is ``interleaved`` with the copies dealt over two copy streams (two copy engines); the link is
one, so this measures whether a second queue hides any per-copy gap.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch

from .offload import OffloadReport, Part, RankState

__all__ = ["ONLOADS", "Onload", "onloader"]

Onload = Callable[[Iterable[Part]], OffloadReport]
ONLOADS = ("bulk", "interleaved", "interleaved2")


def onloader(state: RankState, how: str) -> Onload:
    """The onload ``how`` (one of ``ONLOADS``) for ``state``."""
    if how == "bulk":
        return state.onload
    if how not in ONLOADS:
        raise ValueError(f"unknown onload {how!r}; known: {ONLOADS}")
    extra = 1 if how == "interleaved2" else 0
    cuda = state.device.type == "cuda"
    streams = [torch.cuda.Stream(state.device) for _ in range(extra)] if cuda else []  # type: ignore[no-untyped-call]
    return lambda parts: _interleaved(state, parts, streams)


def _interleaved(state: RankState, parts: Iterable[Part], extra: list[torch.cuda.Stream]) -> OffloadReport:
    t0 = time.perf_counter()
    wanted = [p for p in ("optimizer", "weights", "grads") if p in set(parts) and not state.resident(p)]
    cuda = state.device.type == "cuda"
    compute = torch.cuda.current_stream(state.device) if cuda else None
    # The state's own copy stream first.
    lanes: list[torch.cuda.Stream | None] = [state._copy_stream, *extra] if cuda else [None]
    for lane in lanes:
        if lane is not None and compute is not None:
            lane.wait_stream(compute)  # behind what the caller queued (the blocks' last uses)
    deal = _dealer(lanes)
    copied = allocated = 0

    def alloc(make: Callable[[], torch.Tensor]) -> torch.Tensor:
        # On the compute stream, as RankState.onload allocates: the tensors are the training's.
        with _on(compute):
            return make()

    for part in wanted:
        if part == "optimizer":
            state.optimizer = alloc(lambda: torch.empty(3 * state.shard_numel, dtype=torch.float32,
                                                        device=state.device))
            _queue(state, [(state._host["optimizer"], state.optimizer)], deal)
            copied += state.nbytes(part)
        elif part == "weights":
            host = state._host["weights"]
            weights, offset = [], 0
            for shape, n in zip(state.shapes, state.numels, strict=True):
                w = alloc(functools.partial(torch.empty, shape, dtype=torch.bfloat16, device=state.device))
                _queue(state, [(host[offset : offset + n].view(shape), w)], deal)
                weights.append(w)
                offset += n
            state.weights = weights
            copied += state.nbytes(part)
        else:  # grads: no copy, a zero fill on the compute stream beside the copies
            state.grads = alloc(lambda: torch.zeros(state.param_numel, dtype=torch.bfloat16, device=state.device))
        allocated += state.nbytes(part)
    for lane in lanes:
        if lane is not None:
            lane.synchronize()
    if compute is not None:
        compute.synchronize()
    order = tuple(p for p in ("weights", "grads", "optimizer") if p in wanted)
    return OffloadReport(order, copied, allocated, time.perf_counter() - t0)


def _dealer(lanes: list[torch.cuda.Stream | None]) -> Iterator[torch.cuda.Stream | None]:
    while True:
        yield from lanes


def _queue(state: RankState, pairs: list[tuple[torch.Tensor, torch.Tensor]],
           deal: Iterator[torch.cuda.Stream | None]) -> None:
    """Each piece (RankState's 256 MiB pieces) of each (host, device) pair copied onto the next lane."""
    pin = state.device.type == "cuda"
    for host, gpu in state._pieces(pairs):
        with _on(next(deal)):
            gpu.copy_(host, non_blocking=pin)


@contextmanager
def _on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        yield
