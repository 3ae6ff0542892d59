"""What a trainer-side producer hands out: an exported chunk and the ``Producer`` interface.

Its own module so the pusher (``push.py``) and the producers (``producer.py``) share it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..engines.chunks import ChunkLayout
from ..policies import Transport

__all__ = ["ExportedPart", "Producer"]


@dataclass
class ExportedPart:
    """A chunk ready to describe to the daemon; ``release`` frees its buffer (after the ack)."""

    transport: Transport  # as on the wire (Transport.wire)
    nbytes: int
    handle: dict[str, Any]
    layout: ChunkLayout
    _release: Any = field(default=None, repr=False)
    # Each tensor's digest (engines/digest.py) computed on its device at export; None: not asked for.
    digests: dict[str, str] | None = field(default=None, repr=False)

    def release(self) -> None:
        if self._release is not None:
            release, self._release = self._release, None
            release()


class Producer(Protocol):
    """Exports chunks for one transport; may be reused across streams (sessions)."""

    transport: Transport

    def export(self, named: Sequence[tuple[str, torch.Tensor]]) -> ExportedPart: ...
    def close(self) -> None: ...
