"""The replies of the reference engine's routes beyond SGLang's protocol (``/colocd/*``), parsed into the seam's types.

The adapter negotiates these at attach (``Capability``); real SGLang has none of the routes.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, StrictInt, StrictStr

from ..base import MemoryReport, MemoryTag, ParameterSpec, TagMemory

__all__ = ["DigestsReply", "MemoryReply", "ParametersReply"]


class _Reply(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)


class _Parameter(_Reply):
    name: StrictStr
    dtype: StrictStr
    shape: list[StrictInt]


class ParametersReply(_Reply):
    """``GET /colocd/parameters``: the full parameter set; null where the engine cannot tell (benchmark mode)."""

    parameters: list[_Parameter] | None

    def specs(self) -> tuple[ParameterSpec, ...] | None:
        if self.parameters is None:
            return None
        return tuple(ParameterSpec(p.name, p.dtype, tuple(p.shape)) for p in self.parameters)


class _TagEntry(_Reply):
    resident: bool = False
    nbytes: int = 0
    resident_nbytes: int = 0


class MemoryReply(_Reply):
    """``GET /colocd/memory``: per-tag residency and bytes (RSS, CUDA counters and per-rank detail are not read)."""

    tags: dict[str, _TagEntry] = {}

    def report(self) -> MemoryReport:
        known = {t.value for t in MemoryTag}
        return MemoryReport({MemoryTag(t): TagMemory(e.resident, e.nbytes, e.resident_nbytes)
                             for t, e in self.tags.items() if t in known})


class DigestsReply(_Reply):
    """``POST /colocd/digests``: one ``{name: digest}`` per TP rank."""

    ranks: list[dict[StrictStr, StrictStr]]
