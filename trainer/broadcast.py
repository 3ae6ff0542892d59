"""The trainer's side of separated-GPU weight updates: rank 0 of a weight-update group, broadcasting while
the daemon's request is in flight (docs/client.md, "Separated GPUs").

Every collective overlaps its HTTP call (research/engine-apis.md §6.3): the daemon answers only once the engines
have received, so the request goes out first and the two are awaited together. After a failure on either side the
group's collective sequence is unknown: the sender leaves the group (the engines' pending receives fail at once),
has the daemon destroy it, and raises; ``open_group()`` builds a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

import torch

from ..api.client import AsyncColocdClient, ColocdHTTPError, DaemonUnreachable
from ..engines.chunks import plan_chunks
from ..engines.weight_group import WeightGroup, chunk_order, dtype_name, master_store, off_loop
from .push import PushReport, push_session

__all__ = ["DistributedWeightSender"]

_T = TypeVar("_T")
FLATTENED = "flattened_bucket"


class DistributedWeightSender:
    """Rank 0 of one weight-update group. ``flattened``: one uint8 broadcast per bucket (SGLang's
    ``flattened_bucket``), else one per tensor; ``backend``: ``nccl`` between GPUs, ``gloo`` on CPU; ``timeout_s``
    bounds the rendezvous and each collective."""

    def __init__(self, client: AsyncColocdClient, *, group_name: str = "weight_update_group",
                 backend: str = "nccl", master_address: str = "127.0.0.1", bucket_mb: float = 64.0,
                 flattened: bool = True, timeout_s: float = 600.0) -> None:
        self._client = client
        self.group_name = group_name
        self.backend = backend
        self.master_address = master_address
        self._bucket_bytes = max(int(bucket_mb * 1024 * 1024), 1)
        self._flattened = flattened
        self._timeout_s = timeout_s
        self._group: WeightGroup | None = None

    async def __aenter__(self) -> DistributedWeightSender:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_group()

    async def open_group(self) -> dict[str, Any]:
        """Serve the group's store, then join as rank 0 while the daemon has every engine join."""
        if self._group is not None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is already open")
        world_size = int((await self._client.weight_groups())["layout"]["world_size"])
        store = await off_loop(lambda: master_store(self.master_address, world_size, self._timeout_s),
                               name="colocd-trainer-store")
        http = asyncio.ensure_future(self._client.open_weight_group(
            group_name=self.group_name, master_address=self.master_address, master_port=store.port,
            backend=self.backend, world_size=world_size))
        joining = off_loop(lambda: WeightGroup.join(
            master_address=self.master_address, master_port=store.port, rank=0, world_size=world_size,
            group_name=self.group_name, backend=self.backend, timeout_s=self._timeout_s, store=store),
            name="colocd-trainer-join")
        try:
            group, reply = await self._together(joining, http)
        except BaseException:
            joining.add_done_callback(_leave_when_joined)
            with contextlib.suppress(ColocdHTTPError, DaemonUnreachable):
                await self._client.close_weight_group(self.group_name)  # the daemon may have kept nothing
            raise
        self._group = group
        return reply

    async def broadcast(self, session_id: str, seq: int, named: Sequence[tuple[str, torch.Tensor]]) -> dict[str, Any]:
        """Send one bucket: the descriptor first, then the broadcast(s), then await the daemon's answer."""
        if (group := self._group) is None:
            raise RuntimeError(f"weight-update group {self.group_name!r} is not open; call open_group() first")
        ordered = chunk_order(named) if self._flattened else list(named)
        descriptor = {"seq": seq, "group_name": self.group_name, "names": [n for n, _ in ordered],
                      "dtypes": [dtype_name(t.dtype) for _, t in ordered],
                      "shapes": [list(t.shape) for _, t in ordered],
                      "load_format": FLATTENED if self._flattened else None}
        device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")

        def send() -> None:
            # Staging copies run here, off the event loop, after the descriptor went out.
            tensors = [t.detach().to(device).contiguous() for _, t in ordered]
            if self._flattened:
                tensors = [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])]
            for tensor in tensors:
                group.broadcast(tensor, src=0)

        http = asyncio.ensure_future(self._client.send_broadcast(session_id, descriptor))
        try:
            _, reply = await self._together(off_loop(send, name=f"colocd-trainer-bcast-{seq}"), http)
        except BaseException:
            await self.close_group(wait=False)
            raise
        return reply

    async def stream(self, session_id: str, named: Iterable[tuple[str, torch.Tensor]]) -> tuple[int, int]:
        """Broadcast every bucket of an open session, one at a time; returns (broadcasts, bytes)."""
        count = nbytes = 0
        for seq, bucket in enumerate(plan_chunks(named, self._bucket_bytes)):
            reply = await self.broadcast(session_id, seq, bucket)
            count, nbytes = seq + 1, nbytes + int(reply["nbytes"])
        return count, nbytes

    async def push(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str,
                   step: int | None = None) -> PushReport:
        """``push_session`` with this sender's broadcasts."""
        return await push_session(self._client, named, self.stream, version=version, step=step, chunks_counted=False)

    async def close_group(self, *, wait: bool = True) -> dict[str, Any] | None:
        """Have the daemon destroy the group on every engine, then leave it; returns the daemon's answer, or None
        if it no longer had the group. ``wait=False`` (after a failure): the daemon's refusal is not raised, and
        the group is left without waiting (a broadcast of ours may still be pending on it)."""
        group, self._group = self._group, None
        if group is None:
            return None
        try:
            return await self._client.close_weight_group(self.group_name)
        except (ColocdHTTPError, DaemonUnreachable) as exc:
            if wait and not (isinstance(exc, ColocdHTTPError) and exc.status == 404):
                raise
            return None
        finally:
            leaving = off_loop(group.close, name="colocd-trainer-leave")
            if wait:
                await leaving

    async def _together(self, collective: asyncio.Future[_T], http: asyncio.Future[dict[str, Any]],
                        ) -> tuple[_T, dict[str, Any]]:
        """Await a collective and its HTTP call together; whichever fails first is raised at once."""
        pending: set[asyncio.Future[Any]] = {collective, http}
        try:
            async with asyncio.timeout(self._timeout_s):
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for future in done:
                        if (error := future.exception()) is not None:
                            raise error
        except BaseException:
            http.cancel()  # the daemon's own budget ends its side
            raise
        return collective.result(), http.result()


def _leave_when_joined(joining: asyncio.Future[WeightGroup]) -> None:
    if not joining.cancelled() and joining.exception() is None:
        off_loop(joining.result().close, name="colocd-trainer-leave")
