"""A reference engine whose weight loads land in a benchmark sink (``benchmarks/sink.py``) instead of its tiny model.

The benches move what a real engine of a checkpoint's shape would: every pushed byte is copied into bf16 tensors of
that checkpoint (e.g. Qwen3-8B), released and resumed with the engine's ``weights`` tag, with an optional KV block in
its ``kv_cache`` tag; ``GET /colocd/sink`` answers their device checksums. It is the reference engine's server with
this app: ``python -m benchmarks.sink_engine`` takes the reference engine's flags. ``sink_launch`` is a reference
engine config's ``launch`` that has the product's launcher (or a daemon's) run it, through ``benchmarks/sink_python``
as the engine's interpreter.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from fastapi import FastAPI

from colocd.engines.base import MemoryTag
from colocd.engines.reference.__main__ import main
from colocd.engines.reference.engine import EngineRefusal, ReferenceEngine
from colocd.engines.reference.payloads import _b64decode, _bucket_parts, open_payload
from colocd.engines.reference.safe_unpickle import safe_loads
from colocd.engines.reference.server import create_app
from colocd.engines.reference.settings import ReferenceServerSettings

from .sink import WeightSink

__all__ = ["SINK_ENV", "SinkEngine", "create_sink_app", "sink_launch"]

SINK_ENV = ("COLOCD_SINK_SHAPES", "COLOCD_SINK_KV_GIB")
_GIB = 1 << 30


def sink_launch(shapes: str, kv_gib: float = 0.0, **launch: Any) -> dict[str, Any]:
    """A reference engine config's ``launch`` that runs this engine holding ``shapes`` (and ``kv_gib`` of KV)."""
    env = {SINK_ENV[0]: shapes, SINK_ENV[1]: f"{kv_gib:.6f}", "COLOCD_SINK_PYTHON": sys.executable,
           "COLOCD_REFERENCE_PYTHON": str(Path(__file__).with_name("sink_python")), **launch.pop("env", {})}
    return {"env": env, **launch}


class SinkEngine(ReferenceEngine):
    """The reference engine with one ``WeightSink`` per TP rank; generation keeps running on the tiny model."""

    def __init__(self, settings: ReferenceServerSettings, shapes: str, kv_bytes: int = 0) -> None:
        super().__init__(settings)
        self.shapes, self.kv_bytes = shapes, kv_bytes
        self.sinks: list[WeightSink] = []
        self._stash: list[dict[str, torch.Tensor]] = []  # the tiny model's weights, kept across a release

    def _build(self) -> None:
        super()._build()
        self.sinks = [WeightSink(self.shapes, r.device, kv_bytes=self.kv_bytes) for r in self._ranks]

    def _move_every_rank(self, tags: tuple[MemoryTag, ...], resume: bool) -> None:
        # Pushes land in the sink, so nothing would restore the tiny model after a resume: keep it on the host.
        if not resume and MemoryTag.WEIGHTS in tags:
            self._stash = [{n: p.detach().to("cpu", copy=True) for n, p in r.model.named_parameters()}
                           for r in self._ranks]
        super()._move_every_rank(tags, resume)
        for sink in self.sinks:
            if MemoryTag.WEIGHTS in tags:
                (sink.resume_weights if resume else sink.release_weights)()
            if MemoryTag.KV_CACHE in tags:
                (sink.resume_kv if resume else sink.release_kv)()
        if resume and MemoryTag.WEIGHTS in tags and self._stash:
            with torch.no_grad():
                for rank, kept in zip(self._ranks, self._stash, strict=True):
                    for n, p in rank.model.named_parameters():
                        p.copy_(kept[n])
            self._stash = []

    def tag_bytes(self, rank: int) -> dict[MemoryTag, int]:
        held = super().tag_bytes(rank)
        held[MemoryTag.WEIGHTS] += self.sinks[rank].nbytes
        held[MemoryTag.KV_CACHE] += self.sinks[rank].kv_bytes
        return held

    def _load_entries(self, entries: Sequence[str], load_format: str | None) -> list[str]:
        names: list[str] = []
        for rank, sink, entry in zip(self._ranks, self.sinks, entries, strict=True):
            if load_format == "flattened_bucket":
                # Copied by the chunk shape's plan (benchmarks/load_plan.py) rather than through a list of views.
                flat, metadata = _bucket_parts(safe_loads(_b64decode(entry)))  # unpickling opens the IPC handle
                names = sink.load_bucket(flat, metadata)
                del flat  # the IPC mapping closes before the reply: the trainer may reuse the memory then
            else:
                with open_payload(entry, load_format, tp_rank=rank.index, device=rank.device) as named:
                    names = sink.load_weights(named)
            if rank.device.type == "cuda":
                torch.cuda.synchronize(rank.device)
        return names

    async def sink_checksums(self) -> dict[str, Any]:
        """Device checksums of every TP rank's sink tensors (rank 0's at the top level)."""
        self._running()
        async with self._control_lock:
            per_rank = await self._on_model_thread(lambda: [s.checksums() for s in self.sinks])
        if not per_rank:
            raise EngineRefusal(503, "the server is still starting")
        return {"model": self.shapes, "nbytes": self.sinks[0].nbytes, "checksums": per_rank[0],
                "ranks": [{"tp_rank": r.index, "device": str(r.device), "checksums": c}
                          for r, c in zip(self._ranks, per_rank, strict=True)]}


def create_sink_app(settings: ReferenceServerSettings) -> FastAPI:
    """The reference engine's app over a ``SinkEngine`` of the shapes ``COLOCD_SINK_SHAPES`` names."""
    shapes = os.environ.get(SINK_ENV[0]) or "tiny"
    kv_bytes = int(float(os.environ.get(SINK_ENV[1]) or 0) * _GIB)
    engine = SinkEngine(settings, shapes, kv_bytes)
    app = create_app(settings, engine)

    @app.get("/colocd/sink")
    async def colocd_sink() -> dict[str, Any]:
        return await engine.sink_checksums()

    return app



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], app_factory=create_sink_app))
