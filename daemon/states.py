"""The daemon's state machines as data: node phases and per-engine memory/generation/weights state.

Rule 1 (after h11): everything that decides whether a transition is legal lives in this file.
It is pure: no asyncio, no I/O. An illegal request raises ``TransitionRejected`` naming the
current state and what would be allowed; a legal one returns the plan of what must change.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum

from ..engines.base import ALL_TAGS, MemoryTag
from .errors import TransitionRejected

__all__ = [
    "NEXT_PHASE",
    "EngineState",
    "Generation",
    "NodePhase",
    "NodeState",
    "TagState",
    "WeightsState",
    "check_phase_request",
]


class NodePhase(StrEnum):
    """Who holds the node's GPUs: the engines generate (rollout), the trainer trains, or weights sync."""

    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"


# The only legal phase moves; each is keyed by the phase the trainer asks for.
NEXT_PHASE: dict[NodePhase, NodePhase] = {
    NodePhase.TRAIN: NodePhase.ROLLOUT,  # train is entered from rollout
    NodePhase.SYNC: NodePhase.TRAIN,  # sync from train
    NodePhase.ROLLOUT: NodePhase.SYNC,  # rollout from sync
}


class TagState(StrEnum):
    RESIDENT = "resident"
    RELEASED = "released"


class Generation(StrEnum):
    SERVING = "serving"
    PAUSED = "paused"


class WeightsState(StrEnum):
    """Whether the engine's weight contents are the committed version."""

    CLEAN = "clean"  # the committed version, byte for byte
    UPDATING = "updating"  # a weight session is open; contents are mixed
    STALE = "stale"  # released and resumed without a full update, an update was abandoned, or the engine restarted


@dataclass(frozen=True, slots=True)
class EngineState:
    """What the daemon knows about one engine; engines cannot be asked reliably, so this is the record."""

    name: str
    owned_tags: tuple[MemoryTag, ...] = ALL_TAGS
    tags: dict[MemoryTag, TagState] = field(default_factory=lambda: {t: TagState.RESIDENT for t in ALL_TAGS})
    generation: Generation = Generation.SERVING
    weights: WeightsState = WeightsState.CLEAN
    weight_version: str | None = None
    healthy: bool = True
    last_error: str | None = None
    # The engine process's identity as last observed (Observation.incarnation); None: never seen or
    # the engine cannot tell. Journaled, so a restarted daemon can tell a restarted engine.
    incarnation: str | None = None

    def describe(self) -> str:
        released = [t.value for t in self.owned_tags if self.tags[t] is TagState.RELEASED]
        return (f"engine {self.name!r} is {self.generation.value}, weights {self.weights.value} "
                f"at version {self.weight_version!r}, released tags {released or 'none'}")

    @property
    def needs_complete_push(self) -> bool:
        """Weights are not the committed version (released, abandoned update, restarted engine):
        only an update that covers every parameter may make them clean again."""
        return self.weights is WeightsState.STALE

    def resident(self, tag: MemoryTag) -> bool:
        return self.tags[tag] is TagState.RESIDENT

    # -- checks: return the tags to act on, or raise TransitionRejected ----------------------
    def tags_to_release(self, requested: tuple[MemoryTag, ...] | None, *, strict: bool) -> tuple[MemoryTag, ...]:
        """Owned tags from ``requested`` that are resident. ``strict``: a released one is an error
        (SGLang dies on a double release), otherwise it is skipped (the phase machine's own plan)."""
        wanted = self._owned(requested)
        already = [t for t in wanted if not self.resident(t)]
        if already and strict:
            raise TransitionRejected(
                f"cannot release {[t.value for t in already]}: already released; {self.describe()}",
                state=self.snapshot())
        return tuple(t for t in wanted if self.resident(t))

    def tags_to_resume(self, requested: tuple[MemoryTag, ...] | None, *, strict: bool) -> tuple[MemoryTag, ...]:
        wanted = self._owned(requested)
        already = [t for t in wanted if self.resident(t)]
        if already and strict:
            raise TransitionRejected(
                f"cannot resume {[t.value for t in already]}: already resident; {self.describe()}",
                state=self.snapshot())
        return tuple(t for t in wanted if not self.resident(t))

    def check_can_serve(self) -> None:
        """Generation may continue only on fully resident memory and clean weights."""
        released = [t.value for t in self.owned_tags if not self.resident(t)]
        if released:
            raise TransitionRejected(f"cannot serve: tags {released} are released; {self.describe()}",
                                     state=self.snapshot())
        if self.weights is not WeightsState.CLEAN:
            raise TransitionRejected(
                f"cannot serve: weights are {self.weights.value} (no complete update committed); "
                f"{self.describe()}", state=self.snapshot())

    def _owned(self, requested: tuple[MemoryTag, ...] | None) -> tuple[MemoryTag, ...]:
        if requested is None:
            return self.owned_tags
        not_owned = [t.value for t in requested if t not in self.owned_tags]
        if not_owned:
            raise TransitionRejected(
                f"engine {self.name!r} does not own tags {not_owned} (owned: {[t.value for t in self.owned_tags]})",
                state=self.snapshot())
        return tuple(t for t in ALL_TAGS if t in requested)

    # -- pure updates -------------------------------------------------------------------------
    def with_tags(self, tags: tuple[MemoryTag, ...], state: TagState) -> EngineState:
        new = dict(self.tags)
        for t in tags:
            new[t] = state
        weights = self.weights
        if MemoryTag.WEIGHTS in tags and state is TagState.RELEASED:
            weights = WeightsState.STALE  # released weights come back as garbage (no CPU backup)
        return replace(self, tags=new, weights=weights)

    def with_(self, **changes: object) -> EngineState:
        return replace(self, **changes)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, object]:
        return {
            "name": self.name,
            "generation": self.generation.value,
            "weights": self.weights.value,
            "weight_version": self.weight_version,
            "tags": {t.value: self.tags[t].value for t in self.owned_tags},
            "healthy": self.healthy,
            "last_error": self.last_error,
            "incarnation": self.incarnation,
        }


@dataclass(frozen=True, slots=True)
class NodeState:
    """The node's phase and the step it belongs to."""

    phase: NodePhase = NodePhase.ROLLOUT
    step: int = 0

    def snapshot(self) -> dict[str, object]:
        return {"phase": self.phase.value, "step": self.step}


def check_phase_request(node: NodeState, phase: NodePhase, step: int) -> None:
    """Raise TransitionRejected unless ``phase`` at ``step`` is the legal next move.

    train(step) follows rollout and needs a step beyond the current one; sync and rollout
    follow within the same step. Repeats of a finished (step, phase) are handled by the caller.
    """
    required = NEXT_PHASE[phase]
    if node.phase is not required:
        raise TransitionRejected(
            f"cannot enter {phase.value!r} at step {step}: node is in {node.phase.value!r} at step {node.step}; "
            f"{phase.value!r} follows {required.value!r}", state=node.snapshot())
    if phase is NodePhase.TRAIN and step <= node.step:
        raise TransitionRejected(
            f"cannot enter 'train' at step {step}: step must be greater than the current step {node.step}",
            state=node.snapshot())
    if phase is not NodePhase.TRAIN and step != node.step:
        raise TransitionRejected(
            f"cannot enter {phase.value!r} at step {step}: node is at step {node.step}", state=node.snapshot())
