"""colocd.trainer: the library that runs inside the trainer process.

Client-side weight push (``push``; LoRA adapters: ``adapters``; bucketing, ``producer``: IPC export), the synchronous
``TrainerClient``, separated-GPU broadcast (``broadcast``), the asynchronous push from a snapshot
(``async_push``), process-group lifecycle (``groups``), cleanup (``cleanup``) and the agent that
enacts the daemon's directives (``agent``). Engines never import this package; the chunk formats both
sides read live in ``colocd.engines.chunks`` and ``colocd.engines.cuda_handles``.
"""

from .adapters import push_adapter
from .agent import TrainerAgent
from .async_push import AsyncWeightSync
from .broadcast import DistributedWeightSender
from .client import TrainerClient
from .push import ChunkRecord, PushReport, WeightPusher, manifest_of

__all__ = [
    "AsyncWeightSync",
    "ChunkRecord",
    "DistributedWeightSender",
    "PushReport",
    "TrainerAgent",
    "TrainerClient",
    "WeightPusher",
    "manifest_of",
    "push_adapter",
]
