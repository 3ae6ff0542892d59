"""The trainer's synchronous client: every daemon call, plus ``push_weights`` (which needs torch).

    with TrainerClient("http://127.0.0.1:7000") as c:
        c.phase("train", step)
        ...
        c.phase("sync", step)
        c.push_weights(model.named_parameters(), version=str(step), step=step)
        c.phase("rollout", step)
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..api.client import ColocdClient
from ..policies import Transport
from .push import DEFAULT_DEPTH, PushReport, WeightPusher

__all__ = ["TrainerClient"]


class TrainerClient(ColocdClient):
    """``ColocdClient`` with the weight push; each push opens, streams and commits one session."""

    def push_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, version: str, step: int | None = None,
                     transport: Transport | str = "auto", bucket_mb: float | None = None, depth: int = DEFAULT_DEPTH,
                     partial: bool = False) -> PushReport:
        """Open, stream and commit one session, with ``WeightPusher``'s defaults (the ``tuned`` preset)."""
        async def push() -> PushReport:
            async with WeightPusher(self.async_client, transport=transport, bucket_mb=bucket_mb,
                                    depth=depth) as pusher:
                return await pusher.push(named, version=version, step=step, partial=partial)

        return self.run(push())
