"""The verified commit: before a session commits, each engine's digests of what it holds are compared with the
digests the trainer computed at export (engines/digest.py) and sent beside each chunk. The policy's ``sync.verify``
says which names are checked: ``full`` all, ``sample`` a deterministic subset, ``off`` none.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..engines.base import EngineDigests
from ..errors import WeightsMismatch
from ..policies import VerifyMode
from .worker import EngineHandle

__all__ = [
    "SAMPLE_FRACTION", "EngineVerdict", "ExpectedDigests", "Verification", "sample_names", "verdict_of",
    "verify_engines"
]

# ``sample`` checks this share of the tensors (at least one); the subset changes with the version, so
# successive commits cover different tensors.
SAMPLE_FRACTION = 1 / 8


@dataclass
class ExpectedDigests:
    """The digests the trainer ranks sent with their chunks, by tensor name, and where ranks disagree."""

    by_name: dict[str, str] = field(default_factory=dict)
    conflicts: dict[str, set[str]] = field(default_factory=dict)  # name -> every digest some rank sent
    undigested: set[str] = field(default_factory=set)  # tensors some rank's chunk carried without a digest

    def record(self, digests: Mapping[str, str] | None, names: Iterable[str] = ()) -> None:
        for name, digest in (digests or {}).items():
            first = self.by_name.setdefault(name, digest)
            if first != digest:
                self.conflicts.setdefault(name, {first}).add(digest)
        self.undigested.update(n for n in names if n not in (digests or {}))


def sample_names(names: Iterable[str], version: str, fraction: float = SAMPLE_FRACTION) -> list[str]:
    """A deterministic subset of ``names``: the ``ceil(fraction * n)`` whose sha256 with the version is smallest."""
    pool = sorted(set(names))
    if not pool:
        return []
    k = max(1, math.ceil(fraction * len(pool)))
    ranked = sorted(pool, key=lambda n: hashlib.sha256(f"{version}\0{n}".encode()).digest())
    return sorted(ranked[:k])


@dataclass(frozen=True, slots=True)
class EngineVerdict:
    """``verified``, ``mismatch`` (``tensor`` names the first), ``unsupported`` (the engine cannot report),
    ``unverified`` (the trainer sent no digests) or ``skipped``."""

    engine: str
    status: str
    checked: int = 0
    tensor: str | None = None
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"status": self.status, "checked": self.checked, "tensor": self.tensor, "reason": self.reason}
        return {k: v for k, v in out.items() if v is not None}


@dataclass(frozen=True, slots=True)
class Verification:

    mode: VerifyMode
    engines: tuple[EngineVerdict, ...] = ()
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode, "seconds": round(self.seconds, 6),
                "engines": {v.engine: v.to_json() for v in self.engines}}

    def error(self) -> WeightsMismatch | None:
        bad = next((v for v in self.engines if v.status == "mismatch"), None)
        if bad is None or bad.tensor is None:
            return None
        return WeightsMismatch(f"engine {bad.engine!r} does not hold what the trainer pushed: {bad.reason}; the "
                               "session failed and the engine stays paused (push again)",
                               engine=bad.engine, tensor=bad.tensor)


def verdict_of(engine: str, expected: ExpectedDigests, names: Sequence[str], report: EngineDigests) -> EngineVerdict:
    """Compare one engine's report with the trainer's digests of ``names``; every TP rank must match."""
    for name in names:
        if name in expected.conflicts:
            return EngineVerdict(engine, "mismatch", len(names), name,
                                 f"trainer ranks sent different digests for tensor {name!r} "
                                 f"({sorted(expected.conflicts[name])}); every rank must send the same tensor")
    if report.ranks is None:
        return EngineVerdict(engine, "unsupported", 0, None, report.unsupported or "the engine reports no digests")
    for tp_rank, held in enumerate(report.ranks):
        for name in names:
            got = held.get(name)
            if got != expected.by_name[name]:
                where = f" on TP rank {tp_rank}" if len(report.ranks) > 1 else ""
                what = "reports no digest" if got is None else f"reports digest {got}"
                return EngineVerdict(engine, "mismatch", len(names), name,
                                     f"tensor {name!r}{where}: the trainer sent digest {expected.by_name[name]}, "
                                     f"the engine {what}")
    return EngineVerdict(engine, "verified", len(names))


async def verify_engines(engines: Sequence[EngineHandle], expected: ExpectedDigests, mode: VerifyMode, version: str,
                         ask: Callable[[EngineHandle, list[str]], Awaitable[EngineDigests]]
                         ) -> tuple[EngineVerdict, ...]:
    """Every engine's verdict, asked concurrently through ``ask(engine, names)``."""
    if mode == "off":
        return tuple(EngineVerdict(e.name, "skipped") for e in engines)
    names = sorted(expected.by_name) if mode == "full" else sample_names(expected.by_name, version)
    if not names:
        return tuple(EngineVerdict(e.name, "unverified", 0, None, "the trainer sent no digests with its chunks")
                     for e in engines)

    async def one(engine: EngineHandle) -> EngineVerdict:
        report = await ask(engine, names)
        verdict = verdict_of(engine.name, expected, names, report)
        if verdict.status == "verified" and expected.undigested:
            # What was checked matches, but not everything loaded was checkable: no claim of "verified".
            missing = sorted(expected.undigested)
            return EngineVerdict(engine.name, "unverified", verdict.checked, None,
                                 f"the trainer sent no digests for {len(missing)} of the tensors it loaded "
                                 f"(first: {missing[0]!r}); the {verdict.checked} it sent digests for match")
        return verdict

    return tuple(await asyncio.gather(*(one(e) for e in engines)))
