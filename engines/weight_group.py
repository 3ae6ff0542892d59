"""A weight-update process group built the way SGLang builds one, from a TCPStore and public torch classes.

The trainer (rank 0, serving the store) and the reference engine (ranks ``rank_offset + tp_rank``) use it. Both
sides must produce exactly SGLang's store keys (``init_custom_process_group``, utils/common.py:2859: the prefixes
``group_name``, ``"{group_name}/"`` and ``"{device}/"``) or the rendezvous hangs until its timeout
(lightseekorg/tokenspeed#1373), so the chain is rebuilt here without torch's private helper.

Every ``WeightGroup`` method blocks: call them through ``off_loop``, never on an event loop.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
from torch.distributed import (  # type: ignore[attr-defined]  # re-exported from torch._C at runtime
    BroadcastOptions,
    PrefixStore,
    ProcessGroupGloo,
    Store,
    TCPStore,
)

from .chunks import dtype_from_name, dtype_name
from .weight_group_protocol import BACKEND_DEVICES, flat_offsets

__all__ = ["BACKEND_DEVICES", "FlatEntry", "WeightGroup", "chunk_order", "dtype_name", "flattened_layout",
           "master_store", "off_loop", "parse_dtype"]

_T = TypeVar("_T")


_Collectives = Any  # ProcessGroupGloo or ProcessGroupNCCL (the latter absent from CPU builds)


def parse_dtype(name: str) -> torch.dtype:
    """SGLang resolves dtype strings with ``getattr(torch, name)``: accept ``bfloat16`` and ``torch.bfloat16``."""
    return dtype_from_name(name.removeprefix("torch."))


@dataclass(frozen=True, slots=True)
class FlatEntry:
    """Where one tensor lies in a ``flattened_bucket`` broadcast: byte range ``[start, end)``."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def flattened_layout(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]]) -> list[FlatEntry]:
    """The byte layout of one flattened bucket (``weight_group_protocol.flat_offsets``) with each tensor's dtype."""
    ranges = flat_offsets(names, dtypes, shapes)
    return [FlatEntry(name, parse_dtype(dtype), tuple(shape), start, end)
            for name, dtype, shape, (start, end) in zip(names, dtypes, shapes, ranges, strict=True)]


def chunk_order(named: Sequence[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """Tensors by decreasing itemsize (stable): every flattened offset is then aligned without padding."""
    return sorted(named, key=lambda item: -item[1].element_size())


def master_store(host: str, world_size: int, timeout_s: float) -> TCPStore:
    """The group's rendezvous store, served by rank 0 on an OS-chosen port (read it from ``.port``)."""
    return TCPStore(
        host, 0, world_size, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
    )


class WeightGroup:
    """This process's membership in one weight-update group; rank 0 is the broadcast source."""

    def __init__(self, pg: _Collectives, store: Store, *, rank: int, world_size: int,
                 group_name: str, backend: str) -> None:
        self._pg: _Collectives | None = pg
        self._store: Store | None = store
        self.rank = rank
        self.world_size = world_size
        self.group_name = group_name
        self.backend = backend

    @classmethod
    def join(cls, *, master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
             backend: str, timeout_s: float, store: Store | None = None) -> WeightGroup:
        """Rendezvous with every other rank; blocks until all joined (or raises after ``timeout_s``). ``store`` is
        rank 0's own ``master_store``; other ranks connect to ``master_address:master_port``."""
        device = BACKEND_DEVICES.get(backend)
        if device is None:
            raise ValueError(f"backend {backend!r} is not supported; use one of {sorted(BACKEND_DEVICES)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the group's world of {world_size}")
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = TCPStore(master_address, master_port, world_size, is_master=False, timeout=timeout)
        store.set_timeout(timeout)
        # SGLang's chain: PrefixStore(group_name) in init_custom_process_group, then the helper's
        # "{group_name}/" and "{device}/" (torch distributed_c10d._new_process_group_helper).
        named = PrefixStore(f"{group_name}/", PrefixStore(group_name, store))
        prefixed = PrefixStore(f"{device}/", named)
        pg: _Collectives
        if backend == "gloo":
            pg = ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            from torch.distributed import ProcessGroupNCCL  # CUDA builds only

            options = ProcessGroupNCCL.Options()
            options._timeout = timeout
            pg = ProcessGroupNCCL(prefixed, rank, world_size, options)
        # The helper does this for gloo and nccl alike; for gloo it is a store exchange rank 0 leads,
        # so a side that skipped it would leave the other waiting on the key.
        pg._set_sequence_number_for_group()
        return cls(pg, store, rank=rank, world_size=world_size, group_name=group_name, backend=backend)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Broadcast ``tensor`` from rank ``src`` (in place on receivers); returns once it has landed."""
        pg = self._pg  # a local reference: close() on another thread must not drop it mid-call
        if pg is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is closed")
        options = BroadcastOptions()
        options.rootRank = src
        options.rootTensor = 0
        pg.broadcast([tensor], options).wait()
        if tensor.is_cuda:
            # NCCL's wait() only orders the current stream after the collective; the caller reads or
            # frees the buffer next, so wait for the bytes themselves.
            torch.cuda.current_stream(tensor.device).synchronize()

    def close(self) -> None:
        """Leave the group. Blocks while a collective of this process is still pending (gloo joins its
        workers), so call it off the event loop; the peers' pending collectives then fail promptly."""
        self._pg = None
        self._store = None


def off_loop(fn: Callable[[], _T], *, name: str) -> asyncio.Future[_T]:
    """Run a blocking collective on a fresh daemon thread (a receive stuck until the group's timeout must not hold
    up a shared executor or interpreter exit); the returned future completes on this loop."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[_T] = loop.create_future()
    # Nobody may be awaiting it any more (a caller that gave up): retrieve the error so that asyncio
    # does not log it as never retrieved.
    future.add_done_callback(lambda f: f.cancelled() or f.exception())

    def settle(result: _T | None, error: BaseException | None) -> None:
        if future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        try:
            result = fn()
        except BaseException as exc:
            outcome: tuple[_T | None, BaseException | None] = (None, exc)
        else:
            outcome = (result, None)
        try:
            loop.call_soon_threadsafe(settle, *outcome)
        except RuntimeError:
            pass  # the loop is closed: nobody is left to tell

    threading.Thread(target=run, name=name, daemon=True).start()
    return future
