"""The daemon's states and the rules of their moves: the daemon's lifecycle, node phases, each engine's record
and attachment, and each weight session's ending.

Everything that decides whether a transition is legal lives here (after h11), pure: an illegal request raises
``TransitionRejected`` (an ended weight session: ``SessionGone``) naming the current state and what is allowed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

from ..engines.base import ALL_TAGS, MemoryTag, TagState
from ..errors import EngineUnreachable, SessionGone, TransitionRejected

__all__ = [
    "NEXT_PHASE", "UNKNOWN", "DaemonState", "EngineRecord", "Generation", "NodePhase", "NodeState",
    "ResumeNeed", "SessionState", "TagState", "WeightsState", "check_attached", "check_can_open_session",
    "check_can_start", "check_no_open_session", "check_partial_allowed", "check_phase_request", "check_reconciled",
    "check_resume_headroom", "check_rollout_staleness", "check_rollout_weights", "check_session_abortable",
    "check_session_end", "needed_per_gpu", "require_session_open", "unready_reason"
]


class DaemonState(StrEnum):
    """The daemon's own lifecycle: it takes work only while running."""

    UNOPENED = "unopened"
    RUNNING = "running"
    CLOSED = "closed"


class NodePhase(StrEnum):
    """Who holds the node's GPUs: the engines generate (rollout), the trainer trains, or weights sync."""

    ROLLOUT = "rollout"
    TRAIN = "train"
    SYNC = "sync"


# The only legal phase moves: the phase the trainer asks for → the phase it is entered from.
NEXT_PHASE = {NodePhase.TRAIN: NodePhase.ROLLOUT, NodePhase.SYNC: NodePhase.TRAIN, NodePhase.ROLLOUT: NodePhase.SYNC}


class Generation(StrEnum):
    SERVING = "serving"
    PAUSED = "paused"


class WeightsState(StrEnum):
    """Whether the engine's weight contents are the committed version."""

    CLEAN = "clean"  # the committed version, byte for byte
    UPDATING = "updating"  # a weight session is open; contents are mixed
    STALE = "stale"  # released and resumed without a full update, an update was abandoned, or the engine restarted


# What status shows for a field of an engine that does not answer: the daemon cannot tell (EngineRecord.status).
UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class EngineRecord:
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
    # Why the tags' residency is unknown (a memory call's answer was lost after it was sent; None: known): no
    # memory call until the engine reports its residency or restarts.
    memory_unknown: str | None = None

    def describe(self) -> str:
        released = [t.value for t in self.owned_tags if self.tags[t] is TagState.RELEASED]
        return (f"engine {self.name!r} is {self.generation.value}, weights {self.weights.value} "
                f"at version {self.weight_version!r}, released tags {released or 'none'}"
                + (f" (unknown: {self.memory_unknown})" if self.memory_unknown else ""))

    def resident(self, tag: MemoryTag) -> bool:
        return self.tags[tag] is TagState.RESIDENT

    def check_tags(self, verb: str, requested: tuple[MemoryTag, ...] | None) -> None:
        """``verb`` (release, resume) may move ``requested`` (None: every owned tag): owned ones, none of them
        already where it would move them (SGLang dies on a double release)."""
        wanted = self.owned_tags if requested is None else requested
        if not_owned := [t.value for t in wanted if t not in self.owned_tags]:
            raise TransitionRejected(
                f"engine {self.name!r} does not own tags {not_owned} (owned: {[t.value for t in self.owned_tags]})",
                state=self.snapshot())
        resident = verb == "release"
        if already := [t.value for t in wanted if self.resident(t) is not resident]:
            raise TransitionRejected(f"cannot {verb} {already}: already {'released' if resident else 'resident'}; "
                                     f"{self.describe()}", state=self.snapshot())

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

    def with_tags(self, tags: tuple[MemoryTag, ...], state: TagState) -> EngineRecord:
        new = dict(self.tags)
        for t in tags:
            new[t] = state
        weights = self.weights
        if MemoryTag.WEIGHTS in tags and state is TagState.RELEASED:
            weights = WeightsState.STALE  # released weights come back as garbage (no CPU backup)
        return replace(self, tags=new, weights=weights)

    def with_(self, **changes: object) -> EngineRecord:
        return replace(self, **changes)  # type: ignore[arg-type]

    def snapshot(self) -> dict[str, object]:
        return {"name": self.name, "generation": self.generation.value, "weights": self.weights.value,
                "weight_version": self.weight_version, "tags": {t.value: self.tags[t].value for t in self.owned_tags},
                "healthy": self.healthy, "last_error": self.last_error, "incarnation": self.incarnation,
                "memory_unknown": self.memory_unknown}

    def status(self) -> dict[str, object]:
        """``snapshot()`` as ``/v1/status`` shows it: while the engine does not answer, what it serves and holds
        is ``unknown`` (it may have died, or restarted empty), as are its tags while ``memory_unknown``; ``last_known``
        keeps what the record said."""
        snapshot = self.snapshot()
        if self.healthy and self.memory_unknown is None:
            return snapshot
        known = ("generation", "weights", "weight_version", "tags") if not self.healthy else ("tags",)
        unknown = {"generation": UNKNOWN, "weights": UNKNOWN, "weight_version": None} if not self.healthy else {}
        return {**snapshot, **unknown, "tags": {t.value: UNKNOWN for t in self.owned_tags},
                "last_known": {k: snapshot[k] for k in known}}


@dataclass(frozen=True, slots=True)
class NodeState:
    """The node's phase and the step it belongs to."""

    phase: NodePhase = NodePhase.ROLLOUT
    step: int = 0

    def snapshot(self) -> dict[str, object]:
        return {"phase": self.phase.value, "step": self.step}


def unready_reason(name: str, attached: bool, state: EngineRecord) -> str | None:
    """Why an engine cannot take a mutating call now (None: it can): never attached (answered ``attach``), its
    last observation failed, or its memory state is unknown."""
    if attached and state.healthy and state.memory_unknown is None:
        return None
    return state.memory_unknown or state.last_error or f"engine {name!r} unhealthy"


def check_attached(name: str, attached: bool, state: EngineRecord) -> None:
    """Every engine must have answered the observation that just ran; else 502/503 naming it."""
    if not attached or not state.healthy:
        message = (state.last_error or "not attached").removeprefix(f"engine {name!r}: ")
        raise EngineUnreachable(name, message)


# -- the daemon: one mutating operation at a time, only while running, only once reconciled ---------
def check_can_start(what: str, *, lifecycle: DaemonState, busy_with: str | None, node: NodeState) -> None:
    """``busy_with``: the operation that holds the node now (None: free, or a background reconcile that the new
    one waits for)."""
    if lifecycle is not DaemonState.RUNNING:
        raise TransitionRejected(f"daemon is {lifecycle.value}")
    if busy_with is not None:
        raise TransitionRejected(f"cannot start {what}: {busy_with} is in progress", state=node.snapshot())


def check_reconciled(what: str, unreconciled: Mapping[str, str | None], node: NodeState) -> None:
    """A restarted daemon acts on no engine whose journal record it has not checked against the engine.
    ``unreconciled``: engine name → its last error (None: not observed)."""
    if unreconciled:
        names = sorted(unreconciled)
        raise TransitionRejected(
            f"cannot start {what}: the daemon restarted and has not yet reconciled engines "
            f"{names} with its journal: " + "; ".join(unreconciled[n] or "not observed" for n in names),
            state=node.snapshot())


# -- phases that need the weight session closed, and clean weights -------------------------------
def check_no_open_session(open_session: str | None, *, advice: str = "") -> None:
    """Train and rollout never run under an open weight session (``advice`` is appended to the refusal)."""
    if open_session is not None:
        raise TransitionRejected(f"weight session {open_session} is still open{advice}")


def check_rollout_weights(engines: Iterable[EngineRecord], node: NodeState) -> None:
    """Every engine's weights are the committed version before any resumes."""
    _refuse_engines("cannot enter 'rollout': weights not updated since release: ",
                    [e for e in engines if e.weights is not WeightsState.CLEAN], node)


def check_rollout_staleness(served: Mapping[str, str | None], staleness: Mapping[str, int], latest: str | None,
                            bound: int, node: NodeState,
                            newer: Mapping[str, Sequence[tuple[str, str]]] | None = None) -> None:
    """No engine starts a rollout serving weights more than ``bound`` versions behind the trainer's latest
    counted version (``sync.max_staleness_versions``): the push that would close the gap must land first.
    ``served``: engine → the version it reports; ``staleness``: engine → counted versions newer than that;
    ``newer``: engine → those versions with why each counts (``VersionBook.newer``), named in the refusal."""
    stale = sorted(name for name, lag in staleness.items() if lag > bound)
    if not stale:
        return
    behind = []
    whys: dict[str, str] = {}
    for name in stale:
        ahead = list((newer or {}).get(name, ()))
        whys.update(ahead)
        listed = ", ".join(f"{v!r} ({why})" for v, why in ahead[-4:])
        behind.append(f"engine {name!r} serves version {served.get(name)!r}, {staleness[name]} version(s) behind "
                      f"the latest started version {latest!r}" + (f"; newer: {listed}" if listed else ""))
    advice = []
    if any(why.startswith("session ") for why in whys.values()):
        advice.append("commit the open session (join its push), or abort it, which withdraws its version")
    if any(why.startswith("reported") for why in whys.values()):
        advice.append("push the version the trainer reported, or re-push a committed version to roll back to it")
    if any(why == "committed" for why in whys.values()) or not advice:
        advice.append("push the latest committed version again (these engines do not serve it)")
    raise TransitionRejected(
        "cannot enter 'rollout': " + "; ".join(behind) + f"; the bound is {bound} "
        "(sync.max_staleness_versions): " + "; or ".join(advice),
        state={**node.snapshot(), "stale": {n: {"serves": served.get(n), "behind": staleness[n]} for n in stale},
               "latest_version": latest, "max_staleness_versions": bound,
               "newer_versions": [{"version": v, "why": why} for v, why in whys.items()]})


@dataclass(frozen=True, slots=True)
class ResumeNeed:
    """What one engine's resume will take on one of its GPUs (its share, for a TP engine), and from what
    evidence."""

    engine: str
    gpu: str
    nbytes: int
    tags: tuple[str, ...]
    source: str


def needed_per_gpu(needs: Iterable[ResumeNeed]) -> dict[str, int]:
    """Bytes the resumes take on each GPU, all engines on it together."""
    out: dict[str, int] = {}
    for need in needs:
        out[need.gpu] = out.get(need.gpu, 0) + need.nbytes
    return out


def check_resume_headroom(what: str, needs: Sequence[ResumeNeed], free: Mapping[str, int], headroom: int,
                          node: NodeState) -> None:
    """Every GPU has the memory its engines' resumes will take, plus ``headroom``, free now: else the resume is
    refused before any engine call (an engine that OOMs halfway through its wake is the failure this prevents).
    GPUs not in ``free`` (no reading) are not checked."""
    per_gpu: dict[str, list[ResumeNeed]] = {}
    for need in needs:
        if need.gpu in free:
            per_gpu.setdefault(need.gpu, []).append(need)
    needed = needed_per_gpu(needs)
    short = {gpu: items for gpu, items in sorted(per_gpu.items()) if free[gpu] < needed[gpu] + headroom}
    if not short:
        return
    gib = 1 << 30

    def needs_of(items: list[ResumeNeed]) -> str:
        return ", ".join(f"engine {n.engine!r}: {'+'.join(n.tags)} {n.nbytes / gib:.2f} GiB from {n.source}"
                         for n in items)

    said = "; ".join(
        f"GPU {gpu} has {free[gpu] / gib:.2f} GiB free, resuming needs {needed[gpu] / gib:.2f} GiB"
        + (f" + {headroom / gib:.2f} GiB headroom" if headroom else "") + f" ({needs_of(items)})"
        for gpu, items in short.items())
    state = {gpu: {"free_bytes": free[gpu], "needed_bytes": needed[gpu], "headroom_bytes": headroom,
                   "engines": {n.engine: {"nbytes": n.nbytes, "tags": list(n.tags), "from": n.source} for n in items}}
             for gpu, items in short.items()}
    raise TransitionRejected(
        f"cannot {what}: {said}; free the trainer's GPU memory (offload, empty_cache) and retry; no engine "
        "was touched (engines.resume_headroom_mb sets the headroom, null turns the check off)",
        state={**node.snapshot(), "headroom": state})


def check_can_open_session(open_session: str | None, engines: Iterable[EngineRecord], node: NodeState, *,
                           idle_for: float = 0.0, idle_s: float | None = None) -> None:
    """One weight session at a time, on engines that are paused with their weights memory known to be resident."""
    if open_session is not None:
        raise TransitionRejected(
            f"weight session {open_session} is already open (idle {idle_for:.1f}s; it expires after "
            f"{idle_s}s without a chunk, or abort it)", state=node.snapshot())
    _refuse_engines("cannot open a weight session: every engine must be paused with weights resident (enter "
                    "'sync' first): ", [e for e in engines if e.generation is not Generation.PAUSED
                                        or not e.resident(MemoryTag.WEIGHTS) or e.memory_unknown is not None], node)


def check_partial_allowed(engines: Iterable[EngineRecord], node: NodeState) -> None:
    """A partial update goes on top of intact weights only."""
    _refuse_engines("a partial update needs intact weights, but weights were discarded (released, or an update was "
                    "abandoned): push every tensor (partial: false): ", [e for e in engines
                                                                        if e.weights is not WeightsState.CLEAN], node)


def _refuse_engines(why: str, bad: Sequence[EngineRecord], node: NodeState) -> None:
    """409 naming each engine in ``bad`` (its record described) after ``why``; nothing when none is."""
    if bad:
        raise TransitionRejected(why + "; ".join(e.describe() for e in bad), state=node.snapshot())


# -- one weight session's lifecycle ------------------------------------------------------------
class SessionState(StrEnum):
    """What a weight session is, as its callers see it (status, 410 bodies, metrics labels)."""

    OPEN = "open"
    COMMITTED = "committed"
    ABORTED = "aborted"
    FAILED = "failed"
    EXPIRED = "expired"  # no chunk within the idle time: the trainer is presumed gone


def check_session_end(session_id: str, state: SessionState, closed: bool, target: SessionState | None) -> bool:
    """A weight session ends once (commit, abort, failure, expiry), then is closed once: its engines' updates end
    (a committed one closed them as it committed). ``target`` None asks to close; False: closed already."""
    if target is None and state is SessionState.OPEN:
        raise TransitionRejected(f"weight session {session_id} is open: it is ended (committed, aborted, "
                                 "failed or expired) before the engines' updates are closed")
    if target is not None and state is not SessionState.OPEN:
        raise TransitionRejected(f"weight session {session_id} is {state.value}: it cannot become {target.value}")
    return target is not None or not closed


def require_session_open(session_id: str, state: SessionState, *, error: str | None = None,
                         advise_new: bool = False) -> None:
    """Work for a session that ended is 410 naming how it ended (and ``error``, why it failed)."""
    if state is not SessionState.OPEN:
        raise SessionGone(
            f"weight session {session_id} is {state.value}" + (f": {error}" if error else "")
            + ("; open a new session" if advise_new and state is not SessionState.COMMITTED else ""),
            session_id=session_id, state=state.value)


def check_session_abortable(session_id: str, state: SessionState, version: str, node: NodeState) -> None:
    """A committed session's version is what the engines serve: it cannot be taken back by an abort."""
    if state is SessionState.COMMITTED:
        raise TransitionRejected(f"weight session {session_id} is committed (version {version!r}); "
                                 "it cannot be aborted", state=node.snapshot())


def check_phase_request(node: NodeState, phase: NodePhase, step: int) -> None:
    """train(step) follows rollout at a later step; sync and rollout follow within the step (a repeat of a
    finished (step, phase) is the caller's)."""
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
