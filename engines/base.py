"""The engine adapter seam: the verbs the daemon may ask of an inference engine, nothing else.

An adapter speaks one engine's HTTP protocol. It knows nothing of phases, policies, ordering,
retries or deadlines: the daemon owns those and wraps each call in its own timeout.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol, runtime_checkable

from ..policies import Transport
from .handles import Handle, HandleRoute

__all__ = ["ALL_TAGS", "ChunkLoad", "ChunkPart", "EngineAdapter", "EngineDigests", "EngineInfo", "MemoryReport",
           "MemoryTag", "Observation", "PauseMode", "ReleaseReport", "TagState"]


class MemoryTag(StrEnum):
    """A region of engine GPU memory that can be released and resumed on its own (SGLang's tags)."""

    WEIGHTS = "weights"
    KV_CACHE = "kv_cache"
    CUDA_GRAPH = "cuda_graph"


ALL_TAGS: tuple[MemoryTag, ...] = (MemoryTag.WEIGHTS, MemoryTag.KV_CACHE, MemoryTag.CUDA_GRAPH)


class TagState(StrEnum):
    """Whether a tag's memory is allocated (the daemon's record and the reference engine's regions alike)."""

    RESIDENT = "resident"
    RELEASED = "released"


class PauseMode(StrEnum):
    """How in-flight requests are treated when generation pauses (SGLang 0.5.23 names)."""

    ABORT = "abort"
    RETRACT = "retract"
    IN_PLACE = "in_place"


@dataclass(frozen=True, slots=True)
class EngineInfo:
    """What an engine told us at attach: its protocol and the state we can read from it."""

    name: str
    engine_kind: str
    version: str
    protocol: str
    weight_version: str | None
    tp_size: int = 1
    owned_tags: tuple[MemoryTag, ...] = ALL_TAGS
    extra: dict[str, object] | None = None  # engine-specific diagnostics for people and tests; the daemon reads none
    # Each TP rank's device identity (a GPU UUID, or a CPU rank's declared id), in TP-rank order; empty if unknown.
    # The daemon feeds each TP rank from the trainer rank that declared the same device.
    device_ids: tuple[str, ...] = ()
    # How many LoRA adapters the engine holds at once, as its flags say; None: no cap reported.
    max_adapters: int | None = None


@dataclass(frozen=True, slots=True)
class ReleaseReport:
    """The tags one release or resume reported (vLLM's sleep takes weights and kv_cache together)."""

    tags: tuple[MemoryTag, ...]


@dataclass(frozen=True, slots=True)
class MemoryReport:
    """What an engine reports each tag taking when resident (bytes, summed over TP ranks), not what is resident now:
    the expectation for an NVML confirmation, and where NVML cannot tell (CPU) the claim of what a release freed."""

    tags: Mapping[MemoryTag, int]

    def nbytes(self, tags: Iterable[MemoryTag]) -> int:
        """What ``tags`` hold when resident (a tag the engine does not report counts 0)."""
        return sum(self.tags.get(t, 0) for t in tags)


@dataclass(frozen=True, slots=True)
class ChunkPart:
    """One trainer rank's piece of a chunk. ``handle`` is its transport's model (engines/handles.py), parsed once
    where the chunk came in; adapters forward ``handle.wire``, the JSON object the trainer sent, in their engine's
    wire format without unpickling it; the facts the daemon needs of it are ``route``."""

    rank: int
    transport: Transport
    nbytes: int
    handle: Handle
    # Each tensor's digest as the trainer computed it (engines/digest.py), by name; None: none sent.
    digests: dict[str, str] | None = None
    route: HandleRoute = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "route", self.handle.route())


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """One gathered chunk for one engine: a payload per engine TP rank, in TP-rank order."""

    seq: int
    payloads: tuple[ChunkPart, ...]
    nbytes: int
    flush_cache: bool = False
    weight_version: str | None = None


@dataclass(frozen=True, slots=True)
class EngineDigests:
    """Digests (engines/digest.py) of the named weights an engine holds: one ``{name: digest}`` per TP rank, or None
    and ``unsupported`` saying why."""

    ranks: tuple[dict[str, str], ...] | None
    unsupported: str | None = None


@dataclass(frozen=True, slots=True)
class Observation:
    """What an engine can tell about itself right now; ``None`` in a field means it cannot tell (never guessed).
    ``incarnation`` changes exactly when the engine process restarted."""

    incarnation: str | None = None
    weight_version: str | None = None
    resident: dict[MemoryTag, bool] | None = None  # per tag, where the engine reports residency
    paused: bool | None = None  # generation paused at the engine's gate
    update_session_open: bool | None = None  # an engine-side weight-update session is open


@runtime_checkable
class EngineAdapter(Protocol):
    """Verbs over one engine's HTTP API. All async; none takes a timeout (the daemon sets deadlines)."""

    name: str

    @property
    def transports(self) -> frozenset[Transport]:
        """The transports this engine loads chunks by; exact after ``attach``, a guess from its config before."""
        ...

    async def attach(self) -> EngineInfo: ...
    async def started(self) -> bool:
        """Whether a server that just (re)started has finished its own start-up (SGLang's warm-up generation: a
        pause before it ends blocks the server for good)."""
        ...

    async def observe(self) -> Observation: ...
    async def pause_generation(self, mode: PauseMode) -> None: ...
    async def continue_generation(self) -> None: ...
    async def flush_cache(self) -> bool: ...
    async def release_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport: ...
    async def resume_memory(self, tags: tuple[MemoryTag, ...]) -> ReleaseReport: ...
    async def begin_weight_update(self) -> None:
        """Open the engine's update session (where its protocol has one)."""
        ...
    async def load_weights(self, load: ChunkLoad) -> None: ...
    async def end_weight_update(self, version: str | None = None) -> None:
        """End the update session; ``version`` (a commit's) then becomes the served weight version."""
        ...
    async def weight_digests(self, names: Sequence[str]) -> EngineDigests:
        """Digests of the named tensors as the engine holds (or received) them, for a verified commit."""
        ...
    async def memory_report(self) -> MemoryReport | None:
        """What the engine reports each tag taking; None where it reports nothing."""
        ...

    async def load_lora_adapter(self, name: str, path: str) -> None:
        """Load the PEFT folder ``path`` as adapter ``name``; ``AdapterUnsupported`` where the engine serves none."""
        ...
    async def unload_lora_adapter(self, name: str) -> None:
        """Unload the adapter ``name``; one the engine does not hold counts as unloaded."""
        ...

    async def aclose(self) -> None: ...
