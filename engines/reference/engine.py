"""The reference engine's behaviour behind SGLang's routes: generation, pause, memory tags, weight updates.

One ``ReferenceEngine`` per server owns the model, its memory, the scheduler and the single model thread every
tensor operation runs on (so control routes stay responsive while a step runs, and no two model operations overlap).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import torch

from ..base import MemoryTag, PauseMode
from ..sglang.wire import UpdateWeightsFromDistributedReqInput, UpdateWeightsFromTensorReqInput
from .memory import MemoryRegions, MemoryTagError, TagState, normalize_tags
from .model import QwenLikeForCausalLM, build_model
from .payloads import disagreement, open_payload
from .runner import ModelRunner, SamplingConfig
from .scheduler import Req, Scheduler, SchedulerMode, StopRule
from .settings import MODEL_PATH, ReferenceServerSettings
from .tokenizer import CharTokenizer
from .wire import GenerateBody, SamplingParamsBody

__all__ = ["EngineRefusal", "ReferenceEngine", "RunState"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")
UpdateBody = UpdateWeightsFromTensorReqInput | UpdateWeightsFromDistributedReqInput
_GB = 1 << 30  # SGLang's "GB"
_HEALTH_TIMEOUT_S = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT's default


class RunState(StrEnum):
    """Lifecycle of the server process (not of generation or memory, which have their own state)."""

    STARTING, RUNNING, FAILED, STOPPING = "starting", "running", "failed", "stopping"


class EngineRefusal(Exception):
    """A request the engine answers with an HTTP error status and a message (never a traceback)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


@dataclass(slots=True)
class TPRank:
    """One TP rank: a full copy of the model on its own device, and its memory tags. SGLang runs one scheduler
    process per TP rank, each loading its own ``serialized_named_tensors`` entry and sharding it; this engine keeps
    its ranks in one process, unsharded, and refuses a chunk whose entries disagree before any rank applies it, so
    the ranks always hold the same weights and generation runs on rank 0's alone."""

    index: int
    device: torch.device
    model: QwenLikeForCausalLM
    memory: MemoryRegions


class ReferenceEngine:
    """A tiny causal LM served with SGLang's semantics; ``start()`` then ``aclose()``."""

    def __init__(self, settings: ReferenceServerSettings) -> None:
        self.settings = settings
        self.tokenizer = CharTokenizer()
        self.state = RunState.STARTING
        self._weight_version = "default"  # SGLang's --weight-version default
        # CPU seconds to get here, to the nanosecond: the one startup duration measured, other for every process.
        self.startup_cpu_s = time.process_time()
        self.tp_size = settings.tp_size
        self._ranks: list[TPRank] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="colocd-ref-model")
        self._scheduler: Scheduler | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self._failed = asyncio.Event()
        # Generation gate: while a pause or an unpaused weight update is in force, new requests wait here (SGLang's
        # is_pause_cond and the writer side of its model_update_lock).
        self._pause_mode: PauseMode | None = None
        self._updates = 0
        self._pause_cond = asyncio.Condition()
        self._blocked = 0
        # Memory, weight and flush operations run one at a time, as SGLang's scheduler runs them.
        self._control_lock = asyncio.Lock()
        self._session_selector: str | None = None

    # --- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Build the model on the model thread and start scheduling; failures mark the engine FAILED."""
        try:
            await self._on_model_thread(self._build)
        except Exception:
            logger.exception("reference engine failed to start")
            self.state = RunState.FAILED
            self._failed.set()
            return
        memory = self._ranks[0].memory
        step = functools.partial(self._on_model_thread, ModelRunner(self._ranks[0].model, memory).step)
        self._scheduler = Scheduler(step,
                                    max_batch=self.settings.max_batch, max_seq=self.settings.max_seq,
                                    tokenizer=self.tokenizer, memory_ready=lambda: memory.all_resident)
        self._loop_task = asyncio.create_task(self._scheduler.run(), name="colocd-ref-scheduler")
        self._loop_task.add_done_callback(self._on_loop_exit)
        self.state = RunState.RUNNING
        logger.info("reference engine ready: %s, tp_size %d on %s, protocol %s", MODEL_PATH,
                    self.tp_size, ", ".join(str(r.device) for r in self._ranks), self.settings.protocol)

    def _on_loop_exit(self, task: asyncio.Task[None]) -> None:
        # The loop ends only by cancellation at shutdown; anything else would leave requests hanging: fail loudly.
        if not task.cancelled() and task.exception() is not None:
            logger.error("scheduler loop died", exc_info=task.exception())
            self.state = RunState.FAILED
            self._failed.set()

    async def wait_failed(self) -> None:
        """Returns once the engine has failed (startup or scheduler loop), for the CLI to exit non-zero."""
        await self._failed.wait()

    async def aclose(self) -> None:
        self.state = RunState.STOPPING
        if self._scheduler is not None:
            await self._scheduler.abort_all("server is shutting down")
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)  # a death was logged already
        self._executor.shutdown(wait=True, cancel_futures=True)

    def _build(self) -> None:
        # TP rank r runs on the CPU, on visible GPU r with ``cuda``, or on GPU N with ``cuda:N`` (one rank only).
        settings, devices = self.settings, [torch.device(self.settings.device)] * self.settings.tp_size
        if settings.device.startswith("cuda") and settings.tp_size > 1:
            if (visible := torch.cuda.device_count()) < settings.tp_size:
                raise ValueError(f"tp_size {settings.tp_size} needs one GPU per TP rank; this process sees {visible}")
            devices = [torch.device("cuda", r) for r in range(settings.tp_size)]
        for index, device in enumerate(devices):
            # Same seed on every rank: all start with the same weights, as SGLang's ranks load one checkpoint.
            model = build_model(settings.model, settings.seed, device).eval()
            model.requires_grad_(False)
            memory = MemoryRegions(model, max_batch=settings.max_batch, max_seq=settings.max_seq, device=device)
            self._ranks.append(TPRank(index, device, model, memory))

    async def _on_model_thread(self, fn: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def _running(self) -> tuple[Scheduler, MemoryRegions, QwenLikeForCausalLM]:
        if self.state is not RunState.RUNNING:
            raise EngineRefusal(503, f"the server is {self.state.value}")
        assert self._scheduler is not None
        return self._scheduler, self._ranks[0].memory, self._ranks[0].model

    @property
    def device(self) -> torch.device:
        """Rank 0's device, where generation runs (known once the model is built)."""
        return self._ranks[0].device

    # --- state for the info routes ---------------------------------------------------------------

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    def internal_state(self) -> dict[str, Any]:
        s = self._scheduler
        return {
            "num_running_reqs": s.num_running if s else 0,
            "num_waiting_reqs": s.num_waiting if s else 0,
            "num_blocked_reqs": self._blocked,  # waiting at the pause gate
            "paused": self._pause_mode.value if self._pause_mode else None,
            "weight_update_session": self._session_selector,
            "engine_state": self.state.value,
            "memory_usage": self.memory_usage(),
            # Which tags hold memory now, which SGLang does not report: the specs read what the daemon did.
            "memory_resident": {t.value: self._ranks[0].memory.state(t) is TagState.RESIDENT for t in MemoryTag}
            if self._ranks else {},
        }

    def tag_bytes(self, rank: int) -> dict[MemoryTag, int]:
        """What each tag of TP rank ``rank`` holds when resident."""
        return {t: self._ranks[rank].memory.resident_nbytes(t) for t in MemoryTag}

    def memory_usage(self) -> dict[str, Any]:
        """SGLang's ``memory_usage`` (scheduler_components/memory_usage.py): GB each region took when TP rank 0
        allocated it, whatever it holds now; unrounded here, where the model is a few hundred kB."""
        held = self.tag_bytes(0) if self._ranks else dict.fromkeys(MemoryTag, 0)
        return {"weight": held[MemoryTag.WEIGHTS] / _GB, "kvcache": held[MemoryTag.KV_CACHE] / _GB,
                "token_capacity": self.settings.max_batch * self.settings.max_seq,
                "graph": {"decode": held[MemoryTag.CUDA_GRAPH] / _GB}}

    # --- generation ------------------------------------------------------------------------------

    async def generate(self, body: GenerateBody) -> dict[str, Any] | list[dict[str, Any]]:
        """Run one request or a batch; a cancelled caller (client gone) aborts its requests."""
        scheduler, _, _ = self._running()
        if body.stream:
            raise EngineRefusal(400, "stream=true is not supported by the colocd reference engine")
        prompts, is_batch = self._prompts(body)
        reqs = [self._make_req(body, i, len(prompts), ids) for i, ids in enumerate(prompts)]
        outputs = await self._run(scheduler, reqs)
        responses = [self._response(o) for o in outputs]
        return responses if is_batch else responses[0]

    async def health_generate(self) -> bool:
        """SGLang's probe: a 1-token greedy request; never run while paused or while memory is released."""
        scheduler = self._scheduler
        if self.state is not RunState.RUNNING or scheduler is None or self._pause_mode is not None:
            return False
        if not self._ranks[0].memory.all_resident:
            return False
        req = Req(f"HEALTH_CHECK_{uuid.uuid4().hex}", [0], StopRule(max_new_tokens=1), SamplingConfig(0.0), None, False)
        await scheduler.submit(req)
        try:
            await asyncio.wait_for(asyncio.shield(req.future), _HEALTH_TIMEOUT_S)
        except TimeoutError:
            await scheduler.abort_all("health check timed out", req=req)
            return False
        return True

    async def _run(self, scheduler: Scheduler, reqs: list[Req]) -> list[Req]:
        try:
            async with self._pause_cond:
                self._blocked += len(reqs)
                try:
                    await self._pause_cond.wait_for(lambda: self._pause_mode is None and not self._updates)
                finally:
                    self._blocked -= len(reqs)
                # Submitted while still holding the gate, so no pause or update can slip in between.
                for r in reqs:
                    await scheduler.submit(r)
            return list(await asyncio.gather(*(r.future for r in reqs)))
        except asyncio.CancelledError:
            for r in reqs:
                if r.finish is None:
                    await scheduler.abort_all("client disconnected", req=r)
            raise

    def _prompts(self, body: GenerateBody) -> tuple[list[list[int]], bool]:
        if body.text is not None and body.input_ids is not None:
            raise EngineRefusal(400, "Either text or input_ids should be provided, not both.")
        if body.text is not None:
            texts = body.text if isinstance(body.text, list) else [body.text]
            try:
                prompts = [self.tokenizer.encode(t) for t in texts]
            except ValueError as exc:
                raise EngineRefusal(400, str(exc)) from None
            is_batch = isinstance(body.text, list)
        elif body.input_ids is not None:
            ids = body.input_ids
            is_batch = bool(ids) and isinstance(ids[0], list)
            prompts = [list(p) for p in ids] if is_batch else [list(ids)]  # type: ignore[arg-type]
        else:
            raise EngineRefusal(400, "Either text or input_ids should be provided.")
        if not prompts:
            raise EngineRefusal(400, "empty batch")
        vocab = self.settings.model.vocab_size
        for i, p in enumerate(prompts):
            if not p:
                raise EngineRefusal(400, f"request {i}: the input is empty")
            if len(p) >= self.settings.max_seq:
                raise EngineRefusal(400, f"request {i}: the input ({len(p)} tokens) is longer than the model's "
                                         f"context length ({self.settings.max_seq} tokens).")
            if (bad := next((t for t in p if not 0 <= t < vocab), None)) is not None:
                raise EngineRefusal(400, f"request {i}: token id {bad} is outside the vocabulary (0..{vocab - 1})")
        return prompts, is_batch

    def _make_req(self, body: GenerateBody, i: int, n: int, prompt: list[int]) -> Req:
        def pick(value: Any, field: str) -> Any:
            if not isinstance(value, list):
                return value
            if len(value) != n:
                raise EngineRefusal(400, f"{field} has {len(value)} items for a batch of {n}")
            return value[i]

        try:
            params = SamplingParamsBody.model_validate(pick(body.sampling_params, "sampling_params") or {})
            params.verify()
        except ValueError as exc:
            raise EngineRefusal(400, str(exc)) from None
        rid = pick(body.rid, "rid")
        if rid is None or (n > 1 and not isinstance(body.rid, list)):
            rid = uuid.uuid4().hex
        lp = pick(body.return_logprob, "return_logprob")
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.add(self.tokenizer.eos_token_id)
        stop_strs = (params.stop,) if isinstance(params.stop, str) else tuple(params.stop)
        sampling = SamplingConfig(params.temperature, params.top_k, params.top_p, params.min_p)
        # Seeded requests draw from their own generator, so batch neighbours cannot change them.
        seed = params.sampling_seed if params.sampling_seed is not None else secrets.randbits(63)
        generator = None if sampling.greedy else torch.Generator(device="cpu").manual_seed(seed)
        stop = StopRule(params.max_new_tokens, frozenset(stop_ids), stop_strs, params.no_stop_trim,
                        params.skip_special_tokens)
        return Req(rid, prompt, stop, sampling, generator, return_logprob=bool(lp))

    @property
    def weight_version(self) -> str:
        """The version served now (``/model_info``, every response's ``meta_info``)."""
        return self._weight_version

    @weight_version.setter
    def weight_version(self, new: str) -> None:
        # SGLang's record_weight_version_change: requests alive across the change get a span per version.
        self._weight_version = new
        if self._scheduler is not None:
            self._scheduler.record_version_change(new)

    def _response(self, req: Req) -> dict[str, Any]:
        """SGLang's non-streaming answer (tokenizer_manager.py:2506-2669)."""
        assert req.finish is not None
        meta: dict[str, Any] = {
            "id": req.rid, "finish_reason": req.finish, "prompt_tokens": len(req.prompt_ids),
            "weight_version": self.weight_version, "num_retractions": req.num_retractions, "reasoning_tokens": 0,
            "completion_tokens": len(req.output_ids), "cached_tokens": 0,
        }
        if req.weight_versions:
            # SGLang 0.5.23's add_weight_versions_to_meta_info: weight_version becomes the last span's version.
            meta["weight_versions"] = [dict(span) for span in req.weight_versions]
            meta["weight_version"] = req.weight_versions[-1]["version"]
        if req.return_logprob:
            # SGLang's (logprob, token_id, text) triples; text is null unless return_text_in_logprobs.
            meta["input_token_logprobs"] = [[lp, t, None] for lp, t in
                                            zip(req.input_logprobs or [], req.prompt_ids, strict=False)]
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in
                                             zip(req.output_logprobs, req.output_ids, strict=True)]
        meta["response_sent_to_client_ts"] = time.time()
        return {"text": req.text, "output_ids": list(req.output_ids), "meta_info": meta}

    # --- generation control ----------------------------------------------------------------------

    async def pause_generation(self, mode: PauseMode) -> None:
        """SGLang's pause: new requests wait at the gate; in-flight ones abort, retract or freeze."""
        scheduler, _, _ = self._running()
        async with self._pause_cond:
            self._pause_mode = mode
        if mode is PauseMode.ABORT:
            await scheduler.abort_all("Aborted by pause_generation")
            await scheduler.set_mode(SchedulerMode.RUNNING)
            await scheduler.wait_idle()
        else:
            await scheduler.set_mode(SchedulerMode(mode.value))

    async def continue_generation(self, *, torch_empty_cache: bool) -> None:
        scheduler, _, _ = self._running()
        if torch_empty_cache:
            await self._on_model_thread(self._empty_caches)
        await scheduler.set_mode(SchedulerMode.RUNNING)
        async with self._pause_cond:
            self._pause_mode = None
            self._pause_cond.notify_all()

    async def flush_cache(self) -> bool:
        """Forget cached KV; refused unless idle (the queue is ignored while paused in retract/in_place)."""
        scheduler, _, _ = self._running()
        async with self._control_lock:
            return await self._flush_locked(scheduler, empty_cache=False)

    async def _flush_locked(self, scheduler: Scheduler, *, empty_cache: bool) -> bool:
        async with scheduler.hold():
            if not scheduler.is_fully_idle(ignore_waiting=scheduler.mode is not SchedulerMode.RUNNING):
                return False
            scheduler.flush()
            if empty_cache:
                await self._on_model_thread(self._empty_caches)
        return True

    # --- memory ----------------------------------------------------------------------------------

    async def move_memory(self, raw_tags: Sequence[str] | None, *, resume: bool) -> None:
        """SGLang's release or resume of memory tags on every TP rank; a refused call changes nothing anywhere."""
        scheduler, _, _ = self._running()
        try:
            tags = normalize_tags(raw_tags)
        except ValueError as exc:
            raise EngineRefusal(400, str(exc)) from None
        async with self._control_lock:
            try:
                for rank in self._ranks:
                    rank.memory.check(tags, resume=resume)
            except MemoryTagError as exc:
                raise EngineRefusal(400, str(exc)) from None
            async with scheduler.hold():
                # Only a release needs idleness; a resume is what lets queued requests run again.
                ignore_waiting = scheduler.mode is not SchedulerMode.RUNNING
                if not resume and not scheduler.is_fully_idle(ignore_waiting=ignore_waiting):
                    # SGLang asserts here and its scheduler dies; we refuse and stay up.
                    raise EngineRefusal(400, f"release_memory_occupation needs an idle engine: {scheduler.num_running} "
                                        f"running and {scheduler.num_waiting} queued requests; pause generation first")
                if not resume and MemoryTag.KV_CACHE in tags:
                    scheduler.flush()  # SGLang flushes before releasing the KV cache
                await self._on_model_thread(self._move_every_rank, tags, resume)
        await scheduler.notify()

    def _empty_caches(self) -> None:
        for rank in self._ranks:
            rank.memory.empty_cache()

    def _move_every_rank(self, tags: tuple[MemoryTag, ...], resume: bool) -> None:
        for rank in self._ranks:
            (rank.memory.resume if resume else rank.memory.release)(tags)

    # --- weights ---------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _model_update(self, scheduler: Scheduler) -> AsyncIterator[None]:
        """SGLang's model_update_lock (tokenizer_control_mixin.py:471-633): a paused engine updates at once;
        otherwise new requests wait at the gate while the update waits for the requests in flight."""
        if self._pause_mode is not None:
            yield
            return
        async with self._pause_cond:
            self._updates += 1
        try:
            await scheduler.wait_idle()
            yield
        finally:
            async with self._pause_cond:
                self._updates -= 1
                self._pause_cond.notify_all()

    async def weight_session(self, selector: str | None) -> tuple[bool, str]:
        """``/begin_weight_update`` (a ``selector``) or ``/end_weight_update`` (None)."""
        scheduler, _, _ = self._running()
        # Under the control lock: a load still running (of a session whose caller gave up) finishes first, and
        # once an end returns, no load of the ended session runs or can start.
        async with self._model_update(scheduler), self._control_lock:
            if selector is not None and self._session_selector is not None:
                return False, "a weight-update session is already open; call end_weight_update() first"
            if selector is None and self._session_selector is None:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self._session_selector = selector
            return True, "Success"

    def outside_session(self, route: str) -> str | None:
        """Why a load through ``route`` is refused now: 0.5.23 loads inside a session only (weight_updater.py:190)."""
        if self.settings.protocol != "legacy" and self._session_selector is None:
            return f"{route} must run between begin_weight_update() and end_weight_update()"
        return None

    async def apply_update(self, load: Callable[[], list[str]], body: UpdateBody) -> tuple[bool, str]:
        """Run ``load`` on the model thread with no step running, under SGLang's update rules, then set the version
        and flush the cache as ``body`` asks. ``load`` raises ``ValueError`` before it applies anything."""
        scheduler, memory, _ = self._running()
        if body.abort_all_requests:
            await scheduler.abort_all()
        async with self._model_update(scheduler), self._control_lock:
            if memory.state(MemoryTag.WEIGHTS) is TagState.RELEASED:
                return False, ("memory tag 'weights' is released; resume it (/resume_memory_occupation "
                               '{"tags": ["weights"]}) before loading weights')
            async with scheduler.hold():
                try:
                    names = await self._on_model_thread(load)
                except ValueError as exc:  # PayloadError, UnsafePickleError, load_weights' checks
                    return False, f"Failed to update weights, nothing applied: {exc}"
                except Exception as exc:
                    logger.exception("weight update failed")
                    return False, f"Failed to update weights: internal error {type(exc).__name__}: {exc}"
            logger.info("loaded %d tensors (load_format=%s)", len(names), body.load_format)
            if body.weight_version is not None:
                self.weight_version = body.weight_version
            if body.flush_cache and not await self._flush_locked(scheduler, empty_cache=body.torch_empty_cache):
                return False, ("Weights were updated, but the cache was not flushed because requests are still "
                               "running or queued. Retract or finish them, then call /flush_cache.")
        return True, "Success"

    async def update_weights_from_tensor(self, body: UpdateWeightsFromTensorReqInput) -> tuple[bool, str]:
        """Load one chunk, TP rank r from entry r; a bad chunk applies nothing on any rank and says why."""
        self._running()
        if (refusal := self.outside_session("update_weights_from_tensor")) is not None:
            return False, refusal
        entries = body.serialized_named_tensors
        if len(entries) != self.tp_size:
            return False, (f"serialized_named_tensors has {len(entries)} entries but this engine has tp_size "
                           f"{self.tp_size} (one entry per TP rank)")
        ok, message = await self.apply_update(functools.partial(self._load_entries, entries, body.load_format), body)
        if ok and self.settings.protocol == "legacy" and body.weight_version is not None:
            message += f" Weight version updated to {body.weight_version}."
        return ok, message

    def _load_entries(self, entries: Sequence[str], load_format: str | None) -> list[str]:
        with contextlib.ExitStack() as stack:
            opened = [stack.enter_context(open_payload(entry, load_format, tp_rank=rank.index, device=rank.device))
                      for rank, entry in zip(self._ranks, entries, strict=True)]
            if len(opened) > 1 and (why := disagreement(opened)) is not None:
                raise ValueError(why)  # before any rank applies anything: the ranks stay identical
            applied = [rank.model.load_weights(named) for rank, named in zip(self._ranks, opened, strict=True)]
        for rank in self._ranks:
            if rank.device.type == "cuda":
                # Reply after the copies land (SGLang does not; research/engine-apis.md §6.4 #6).
                torch.cuda.synchronize(rank.device)
        return applied[0]

    async def update_weight_version(self, new_version: str, *, abort_all_requests: bool) -> None:
        scheduler, _, _ = self._running()
        if abort_all_requests:
            await scheduler.abort_all()
        self.weight_version = new_version

    async def check_weights(self, action: str, skip: Sequence[str] | None) -> tuple[bool, str, dict[str, Any]]:
        """``/weights_checker``'s checksum, as SGLang's WeightChecker computes it (the one action colocd sends);
        (success, message, the reply's other fields)."""
        _, memory, _ = self._running()
        if action != "checksum":
            return False, f"Unsupported action={action!r}; the reference engine answers 'checksum' only", {}
        async with self._control_lock:
            if memory.state(MemoryTag.WEIGHTS) is TagState.RELEASED:
                return False, "memory tag 'weights' is released; resume it and push weights first", {}
            records = await self._on_model_thread(
                lambda: [rank_checksum(r, self.tp_size, tuple(skip or ())) for r in self._ranks])
        # SGLang's per-engine checksum digests every rank's per-GPU one, in rank order.
        engine = hashlib.sha256("".join(r["per_gpu_checksum"] for r in records).encode()).hexdigest()
        return True, "Success.", {"ranks": records, "per_engine_checksum": engine}


def rank_checksum(rank: TPRank, tp_size: int, skip: tuple[str, ...]) -> dict[str, Any]:
    """One rank's ``ranks`` entry of SGLang's ``/weights_checker`` checksum reply."""
    # Per tensor SGLang's hash: the first 8 bytes of the sha256 of its bytes.
    per_tensor = {n: hashlib.sha256(p.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
                  .hexdigest()[:16] for n, p in rank.model.named_parameters() if not any(s in n for s in skip)}
    overall = hashlib.sha256()
    for name in sorted(per_tensor):  # SGLang's overall_checksum (utils/weight_checker.py)
        overall.update(name.encode())
        overall.update(per_tensor[name].encode())
    parallelism = {"role": "target", "tp_rank": rank.index, "tp_size": tp_size, "dp_rank": 0, "dp_size": 1,
                   "pp_rank": 0, "pp_size": 1, "rank": rank.index, "size": tp_size}
    return {"checksums": per_tensor, "per_gpu_checksum": overall.hexdigest(), "parallelism_info": [parallelism]}
