"""The trainer rank's side on Ray: push this rank's weights to the daemon of the node it runs on.

    @ray.remote
    class Trainer:
        async def push(self, step):
            return await push_to_this_node(self.model.named_parameters(), version=f"v{step}", step=step)

A failure raises ``ColocdHTTPError``, which pickles with the daemon's error body: the driver's ``ClusterClient``
names the node, engine and reason from it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from ..api.client import AsyncColocdClient
from ..policies import Transport
from ..trainer.push import DEFAULT_DEPTH, WeightPusher
from .registry import adaemon_for_this_node

__all__ = ["push_to_this_node"]


async def push_to_this_node(named: Iterable[tuple[str, torch.Tensor]], *, version: str, step: int | None = None,
                            token: str | None = None, transport: Transport | str = "auto",
                            bucket_mb: float | None = None, depth: int = DEFAULT_DEPTH) -> dict[str, Any]:
    """One whole push to this node's daemon (``WeightPusher``'s defaults); returns a summary the driver keeps."""
    info = await adaemon_for_this_node()
    async with AsyncColocdClient(info["url"], token=token) as client, \
            WeightPusher(client, transport=transport, bucket_mb=bucket_mb, depth=depth) as pusher:
        report = await pusher.push(named, version=version, step=step)
    return {"node_id": info["node_id"], "session_id": report.session_id, "version": report.version,
            "chunks": report.chunks, "nbytes": report.nbytes, "seconds": report.seconds}
