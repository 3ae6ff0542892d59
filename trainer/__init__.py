"""colocd.trainer: the library that runs inside the trainer process; engines never import it.

The weight and LoRA adapter push (``push``, exporting through ``producer``, its buffers accounted in ``leases``),
separated-GPU broadcast (``broadcast``), the push from a snapshot (``async_push``), process groups (``groups``),
cleanup (``cleanup``) and the ``agent`` enacting the directives.
"""

from .agent import TrainerAgent
from .async_push import AsyncWeightSync
from .broadcast import DistributedWeightSender
from .push import ChunkRecord, PushReport, TrainerClient, WeightPusher, manifest_of, push_adapter

__all__ = [
    "AsyncWeightSync", "ChunkRecord", "DistributedWeightSender", "PushReport", "TrainerAgent", "TrainerClient",
    "WeightPusher", "manifest_of", "push_adapter",
]
