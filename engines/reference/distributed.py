"""SGLang's separated-GPU weight routes on the reference engine: join a group, receive broadcasts, destroy it.

Routes and bodies follow SGLang 0.5.23 (http_server.py:1404, 1420, 1488; research/engine-apis.md §1.6). Joining and
receiving block until the trainer (rank 0) acts, so both run on their own threads (``weight_group.off_loop``), never
on the loop or the model thread; received tensors reach the model through ``ReferenceEngine.apply_update``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse
from torch.distributed import default_pg_timeout

from ..base import MemoryTag
from ..sglang.wire import DestroyWeightsUpdateGroupReqInput as DestroyBody
from ..sglang.wire import InitWeightsUpdateGroupReqInput as InitBody
from ..sglang.wire import UpdateWeightsFromDistributedReqInput as UpdateBody
from ..weight_group import WeightGroup, flattened_layout, off_loop, parse_dtype
from .memory import TagState
from .wire import SGLangBody, success

if TYPE_CHECKING:
    from .engine import ReferenceEngine

__all__ = ["DistributedUpdates", "distributed_routes"]

logger = logging.getLogger(__name__)

_R = TypeVar("_R")

# SGLang builds the group with init_custom_process_group(timeout=None), i.e. torch's default
# process-group timeout; a receive whose trainer never broadcasts fails after it.
GROUP_TIMEOUT_S = default_pg_timeout.total_seconds()


@dataclass(eq=False)
class _Member:
    """One group as this engine holds it; ``gone`` is set once it is destroyed or replaced."""

    name: str
    group: WeightGroup | None = None
    receiving: asyncio.Lock = field(default_factory=asyncio.Lock)  # a group's collectives run in order
    gone: asyncio.Event = field(default_factory=asyncio.Event)


class _Gone(Exception):
    """The group was destroyed (or replaced) while this request waited on it."""


class DistributedUpdates:
    """The three routes' behaviour for one ``ReferenceEngine``; ``close()`` at shutdown."""

    def __init__(self, engine: ReferenceEngine) -> None:
        self._engine = engine
        self._members: dict[str, _Member] = {}

    async def init_group(self, body: InitBody) -> tuple[bool, str]:
        """Join ``body.group_name`` as rank ``rank_offset``; returns once every rank joined."""
        self._engine._running()
        failed, rank, device = "Failed to initialize custom process group:", body.rank_offset, self._engine.device
        if self._engine.tp_size != 1:
            # SGLang joins one group rank per TP rank (rank_offset + tp_rank); this engine's ranks share one process.
            return False, (f"{failed} the reference engine joins weight-update groups only with tp_size 1 (this one "
                           f"has tp_size {self._engine.tp_size}); use update_weights_from_tensor")
        if not 1 <= rank < body.world_size:
            return False, (f"{failed} rank {rank} (rank_offset {body.rank_offset}) must lie in "
                           f"1..{body.world_size - 1}; rank 0 is the trainer")
        if body.backend == "nccl" and device.type != "cuda":
            return False, f"{failed} backend 'nccl' needs CUDA; this engine runs on {device}"
        # SGLang replaces a group of the same name (model_runner keeps a dict by name).
        self._forget(body.group_name)
        member = self._members[body.group_name] = _Member(body.group_name)

        joining = off_loop(lambda: WeightGroup.join(
            master_address=body.master_address, master_port=body.master_port, rank=rank, world_size=body.world_size,
            group_name=body.group_name, backend=body.backend, timeout_s=GROUP_TIMEOUT_S),
            name=f"colocd-ref-join-{body.group_name}")
        try:
            member.group = await _unless_gone(member, joining)
        except _Gone:
            # Destroyed while the rendezvous ran: leave the group as soon as it completes.
            joining.add_done_callback(_close_when_joined)
            return False, f"{failed} group {body.group_name!r} was destroyed"
        except Exception as exc:  # RuntimeError/DistStoreError from torch, ValueError from our checks
            self._members.pop(body.group_name, None)
            return False, f"{failed} {type(exc).__name__}: {exc}."
        logger.info("joined weight-update group %r as rank %d of %d (%s)", body.group_name, rank,
                    body.world_size, body.backend)
        return True, "Succeeded to initialize custom process group."

    async def update(self, body: UpdateBody) -> tuple[bool, str]:
        """Receive every tensor of ``body`` from rank 0 and load them all, or none."""
        engine = self._engine
        _, memory, model = engine._running()
        if (refusal := engine.outside_session("update_weights_from_distributed")) is not None:
            return False, refusal
        member = self._members.get(body.group_name)
        if member is None or member.group is None:
            return False, f"Group {body.group_name!r} not in model update groups; call /init_weights_update_group"
        try:
            buffers = self._buffers(body, member.group)
        except ValueError as exc:
            return False, f"Failed to update weights, nothing applied: {exc}"
        if memory.state(MemoryTag.WEIGHTS) is TagState.RELEASED:
            return False, "memory tag 'weights' is released; resume it before loading weights"
        group = member.group

        def receive() -> None:
            for buffer in buffers:  # one broadcast per buffer, in ``names`` order
                group.broadcast(buffer, src=0)

        async with member.receiving:
            try:
                await _unless_gone(member, off_loop(receive, name=f"colocd-ref-recv-{body.group_name}"))
            except _Gone:
                return False, f"Failed to update weights: group {body.group_name!r} was destroyed while receiving"
            except RuntimeError as exc:  # gloo/NCCL: timeout, peer closed
                return False, f"Failed to update weights: receiving from group {body.group_name!r}: {exc}"
        # The layout is checked after the receive, not before: refusing first would leave the trainer's broadcast
        # without a receiver and the group out of step; this way only the request fails.
        ok, message = await engine.apply_update(lambda: model.load_weights(self._named(body, buffers)), body)
        return ok, "Succeeded to update parameter online from distributed." if ok else message

    def _buffers(self, body: UpdateBody, group: WeightGroup) -> list[torch.Tensor]:
        """Temporary receive buffers: one per tensor, or one uint8 buffer for a flattened bucket."""
        # gloo receives into host memory; NCCL into the engine's device.
        device = self._engine.device if group.backend == "nccl" else torch.device("cpu")
        if body.load_format == "flattened_bucket":
            nbytes = sum(parse_dtype(d).itemsize * math.prod(s) for d, s in zip(body.dtypes, body.shapes, strict=True))
            return [torch.empty(nbytes, dtype=torch.uint8, device=device)]
        if body.load_format is not None:
            raise ValueError(f"load_format {body.load_format!r} is not supported; use null or 'flattened_bucket'")
        pairs = zip(body.dtypes, body.shapes, strict=True)
        return [torch.empty(s, dtype=parse_dtype(d), device=device) for d, s in pairs]

    @staticmethod
    def _named(body: UpdateBody, buffers: list[torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        if body.load_format != "flattened_bucket":
            return list(zip(body.names, buffers, strict=True))
        flat = buffers[0]
        return [(e.name, flat[e.start:e.end].view(e.dtype).reshape(e.shape))
                for e in flattened_layout(body.names, body.dtypes, body.shapes)]

    async def destroy(self, group_name: str) -> tuple[bool, str]:
        """Leave the group; a receive still waiting on it answers failure at once."""
        self._engine._running()
        if not self._forget(group_name):
            return False, f"The group to be destroyed does not exist: {group_name!r}"
        return True, "Succeeded to destroy custom process group."

    def _forget(self, group_name: str) -> bool:
        member = self._members.pop(group_name, None)
        if member is None:
            return False
        member.gone.set()
        if member.group is not None:
            # Off the loop: leaving blocks while a receive of ours is still pending on the group.
            off_loop(member.group.close, name=f"colocd-ref-leave-{group_name}")
        return True

    def close(self) -> None:
        """Leave every group (shutdown)."""
        for name in list(self._members):
            self._forget(name)


async def _unless_gone(member: _Member, work: asyncio.Future[_R]) -> _R:
    """Await ``work`` unless the group goes first (then ``_Gone``; the thread finishes on its own)."""
    gone: asyncio.Future[Any] = asyncio.ensure_future(member.gone.wait())
    try:
        await asyncio.wait([work, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not work.done():
        raise _Gone()
    return work.result()


def _close_when_joined(joining: asyncio.Future[WeightGroup]) -> None:
    if not joining.cancelled() and joining.exception() is None:
        off_loop(joining.result().close, name="colocd-ref-leave")


def distributed_routes(updates: DistributedUpdates) -> APIRouter:
    """The three routes, present in every protocol band (0.5.4 had them too)."""
    router = APIRouter()

    @router.post("/init_weights_update_group")
    async def init_weights_update_group(body: SGLangBody[InitBody]) -> JSONResponse:
        return success(*await updates.init_group(body))

    @router.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: SGLangBody[UpdateBody]) -> JSONResponse:
        return success(*await updates.update(body))

    @router.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: SGLangBody[DestroyBody]) -> JSONResponse:
        return success(*await updates.destroy(body.group_name))

    return router
