"""colocd.trainer: the library that runs inside the trainer process (weight and adapter push, broadcast, async push,
process groups, cleanup, the agent enacting the directives); engines never import it."""

from .agent import TrainerAgent
from .async_push import AsyncWeightSync
from .broadcast import DistributedWeightSender
from .push import ChunkRecord, PushReport, TrainerClient, WeightPusher, manifest_of, push_adapter

__all__ = [
    "AsyncWeightSync", "ChunkRecord", "DistributedWeightSender", "PushReport", "TrainerAgent", "TrainerClient",
    "WeightPusher", "manifest_of", "push_adapter",
]
