"""Continuous batching over the KV pool: admit requests into free slots, step them together, finish them.

The model step is a callable it awaits; whether it may step is decided by its mode, by ``hold()`` (control
operations that must not overlap a forward pass) and by ``memory_ready``. Pause gating of new requests is the engine's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch

from .runner import ForwardInput, ForwardOutput, SamplingConfig
from .tokenizer import CharTokenizer

__all__ = ["Req", "Scheduler", "SchedulerMode", "StopRule"]

logger = logging.getLogger(__name__)


class SchedulerMode(StrEnum):
    """Whether the loop steps: SGLang's retract and in_place pauses stop it; abort pauses do not."""

    RUNNING = "running"
    RETRACT = "retract"  # running requests go back to the queue and lose their KV
    IN_PLACE = "in_place"  # running requests keep their slots; no forward passes


@dataclass(frozen=True, slots=True)
class StopRule:
    """When a request ends besides its length: stop tokens and strings, as SGLang applies them."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    stop_strs: tuple[str, ...] = ()
    no_stop_trim: bool = False
    skip_special_tokens: bool = True


@dataclass(eq=False)
class Req:
    """One generation request; its ``future`` resolves to itself once finished (``text``, ``weight_versions`` set)."""

    rid: str
    prompt_ids: list[int]
    stop: StopRule
    sampling: SamplingConfig
    generator: torch.Generator | None
    return_logprob: bool
    future: asyncio.Future[Req] = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    slot: int | None = None
    cached_len: int = 0  # tokens of prompt+output already written to the pool
    num_retractions: int = 0
    finish: dict[str, Any] | None = None  # SGLang's finish_reason (schedule_batch.py FINISH_*.to_json)
    # (old version, output tokens produced under it so far), one per version change while it was alive.
    version_events: list[tuple[str, int]] = field(default_factory=list)
    text: str = ""  # the output, decoded (and stop-trimmed) at finish
    # SGLang's spans [{version, start, end}] of the output tokens, one per version, oldest first; set at finish.
    weight_versions: tuple[dict[str, Any], ...] = ()

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids


ForwardFn = Callable[[Sequence[ForwardInput]], Awaitable[list[ForwardOutput]]]


class Scheduler:
    """Queues, slots and the step loop of one engine; run ``run()`` as a task."""

    def __init__(self, step: ForwardFn, *, max_batch: int, max_seq: int, tokenizer: CharTokenizer,
                 memory_ready: Callable[[], bool], weight_version: str = "default") -> None:
        self._step, self._weight_version, self._tokenizer = step, weight_version, tokenizer
        self._max_batch, self._max_seq, self._memory_ready = max_batch, max_seq, memory_ready
        self._free_slots = list(range(max_batch - 1, -1, -1))
        self._waiting: deque[Req] = deque()
        self._running: list[Req] = []
        self._mode, self._holds, self._stepping = SchedulerMode.RUNNING, 0, False
        self._changed = asyncio.Condition()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def mode(self) -> SchedulerMode:
        return self._mode

    def is_fully_idle(self, *, ignore_waiting: bool = False) -> bool:
        """SGLang's ``is_fully_idle``: nothing running (or mid-step) and, unless ignored, nothing queued."""
        return not self._stepping and not self._running and (ignore_waiting or not self._waiting)

    async def submit(self, req: Req) -> None:
        async with self._changed:
            self._waiting.append(req)
            self._changed.notify_all()

    async def abort_all(self, message: str = "Aborted", *, req: Req | None = None) -> int:
        """Finish every queued and running request (or just ``req``) as aborted; returns how many."""
        async with self._changed:
            victims = [r for r in (*self._waiting, *self._running) if r.finish is None and req in (None, r)]
            for r in victims:
                self._finish(r, _abort(message))
            self._reap()
            self._changed.notify_all()
            return len(victims)

    def record_version_change(self, new_version: str) -> None:
        """The weights changed version: every live request with output so far notes how many tokens the old
        version produced (SGLang's record_weight_version_events; the request's spans are built at finish)."""
        old, self._weight_version = self._weight_version, new_version
        if old == new_version:
            return
        for req in (*self._waiting, *self._running):
            if req.finish is None and req.output_ids:
                req.version_events.append((old, len(req.output_ids)))

    async def set_mode(self, mode: SchedulerMode) -> None:
        """Change the mode and wait for any step in flight; a retract applies once it has ended."""
        async with self._changed:
            self._mode = mode
            await self._changed.wait_for(lambda: not self._stepping)
            if mode is SchedulerMode.RETRACT:
                self._retract_running()
            self._changed.notify_all()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[None]:
        """No step starts while held, and entering waits for the step in flight to end."""
        async with self._changed:
            self._holds += 1
            await self._changed.wait_for(lambda: not self._stepping)
        try:
            yield
        finally:
            async with self._changed:
                self._holds -= 1
                self._changed.notify_all()

    async def wait_idle(self, *, ignore_waiting: bool = False) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.is_fully_idle(ignore_waiting=ignore_waiting))

    async def notify(self) -> None:
        """Re-check the loop's run conditions (memory came back, say)."""
        async with self._changed:
            self._changed.notify_all()

    def flush(self) -> None:
        """Return every slot to the free list; only valid when nothing is running (the caller checks)."""
        if self._running:
            raise RuntimeError("flush with requests running")
        self._free_slots = list(range(self._max_batch - 1, -1, -1))

    async def run(self) -> None:
        while True:
            async with self._changed:
                await self._changed.wait_for(self._can_step)
                batch = self._admit()
                rows = [self._row(r) for r in batch]
                self._stepping = True
            results: list[ForwardOutput] | None = None
            error: Exception | None = None
            try:
                results = await self._step(rows)
            except asyncio.CancelledError:
                self._stepping = False
                raise
            except Exception as exc:  # a failed step fails its requests, never the loop
                logger.exception("model step failed")
                error = exc
            # One critical section from "step over" to "results applied": nobody waiting on the
            # step (hold, set_mode, wait_idle) may observe the batch half-updated.
            async with self._changed:
                self._stepping = False
                self._apply(batch, results, error)
                if self._mode is SchedulerMode.RETRACT:
                    self._retract_running()
                self._changed.notify_all()

    def _can_step(self) -> bool:
        return (self._holds == 0 and self._mode is SchedulerMode.RUNNING and bool(self._waiting or self._running)
                and self._memory_ready())

    def _admit(self) -> list[Req]:
        while self._waiting and self._free_slots:
            req = self._waiting.popleft()
            req.slot = self._free_slots.pop()
            req.cached_len = 0
            self._running.append(req)
        return list(self._running)

    @staticmethod
    def _row(req: Req) -> ForwardInput:
        return ForwardInput(slot=req.slot if req.slot is not None else -1, tokens=req.tokens[req.cached_len:],
                            start=req.cached_len, sampling=req.sampling, generator=req.generator,
                            prompt_logprobs=req.return_logprob and req.input_logprobs is None)

    def _apply(self, batch: list[Req], results: list[ForwardOutput] | None, error: BaseException | None) -> None:
        for i, req in enumerate(batch):
            if req.finish is not None:
                continue  # aborted while the step ran; its result is dropped
            if results is None:
                self._finish(req, _abort(f"model step failed: {error}", 500))
                continue
            res = results[i]
            req.cached_len = len(req.prompt_ids) + len(req.output_ids)
            if req.return_logprob and req.input_logprobs is None:
                req.input_logprobs = [None, *(res.prompt_logprobs or [])]
            if req.stop.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                continue
            req.output_ids.append(res.token)
            req.output_logprobs.append(res.logprob)
            self._check_stop(req)
        self._reap()

    def _check_stop(self, req: Req) -> None:
        token = req.output_ids[-1]
        if token in req.stop.stop_token_ids:
            self._finish(req, {"type": "stop", "matched": token})
        elif req.stop.stop_strs and (matched := self._matched_stop_str(req)) is not None:
            self._finish(req, {"type": "stop", "matched": matched})
        elif len(req.output_ids) >= req.stop.max_new_tokens:
            self._finish(req, {"type": "length", "length": req.stop.max_new_tokens})
        elif len(req.prompt_ids) + len(req.output_ids) >= self._max_seq:
            # The pool slot is full: SGLang ends such a request with a length reason too.
            self._finish(req, {"type": "length", "length": len(req.output_ids)})

    def _matched_stop_str(self, req: Req) -> str | None:
        text = self._tokenizer.decode(req.output_ids, skip_special_tokens=req.stop.skip_special_tokens)
        return next((s for s in req.stop.stop_strs if s and text.endswith(s)), None)

    def _finish(self, req: Req, reason: dict[str, Any]) -> None:
        req.finish = reason
        if req.future.done():
            return
        req.text = self._tokenizer.decode(req.output_ids, skip_special_tokens=req.stop.skip_special_tokens)
        if reason["type"] == "stop" and isinstance(matched := reason["matched"], str) and not req.stop.no_stop_trim:
            req.text = req.text[: len(req.text) - len(matched)]
        req.weight_versions = _version_spans(req.version_events, self._weight_version, len(req.output_ids))
        req.future.set_result(req)

    def _reap(self) -> None:
        """Drop finished requests and return their slots, except while a step may still write them."""
        self._waiting = deque(r for r in self._waiting if r.finish is None)
        if not self._stepping:
            for r in self._running:
                if r.finish is not None:
                    self._free(r)
            self._running = [r for r in self._running if r.finish is None]

    def _retract_running(self) -> None:
        for r in reversed(self._running):
            self._free(r)
            if r.finish is None:
                r.cached_len, r.num_retractions = 0, r.num_retractions + 1
                self._waiting.appendleft(r)
        self._running = []

    def _free(self, req: Req) -> None:
        if req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None


def _abort(message: str, status_code: int | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code, "err_type": None}


def _version_spans(events: list[tuple[str, int]], current: str, num_output: int) -> tuple[dict[str, Any], ...]:
    """SGLang 0.5.23's compute_weight_version_spans then add_weight_versions_to_meta_info: consecutive spans
    of output tokens per version, the current one last; a span starting past the output is dropped unless it
    starts at 0 (a request that produced nothing still names the version it ran under)."""
    spans: list[dict[str, Any]] = []
    for version, end in (*events, (current, num_output)):
        end = min(end, num_output)
        if spans and end <= spans[-1]["end"]:
            continue
        if spans and version == spans[-1]["version"]:
            spans[-1]["end"] = end
            continue
        spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
    return tuple(s for s in spans if s["start"] < num_output or s["start"] == 0)
