"""Unit tests of the reference engine's parts that need no server: model, memory, sampling,
scheduler, payload decoding and the allow-list unpickler."""

from __future__ import annotations

import asyncio
import base64
import io
import os
import pickle
import sys
import types
from multiprocessing.reduction import ForkingPickler

import pytest
import torch
from reference_runner import StaticBuffers, generate_greedy
from support import weights_checksum

from colocd.engines.base import MemoryTag
from colocd.engines.reference.memory import MemoryRegions, MemoryTagError, TagState, normalize_tags
from colocd.engines.reference.model import QwenLikeConfig, QwenLikeForCausalLM, build_model
from colocd.engines.reference.payloads import PayloadError, open_payload
from colocd.engines.reference.runner import ForwardInput, ForwardOutput, ModelRunner, SamplingConfig, choose_token
from colocd.engines.reference.safe_unpickle import UnsafePickleError, safe_loads
from colocd.engines.reference.scheduler import Req, Scheduler, SchedulerMode, StopRule
from colocd.engines.reference.tokenizer import EOS_ID, CharTokenizer

CFG = QwenLikeConfig()

HF_NAMES = {
    "model.embed_tokens.weight",
    "model.norm.weight",
    "lm_head.weight",
    *(
        f"model.layers.{i}.{suffix}"
        for i in range(CFG.num_layers)
        for suffix in (
            "self_attn.q_proj.weight",
            "self_attn.k_proj.weight",
            "self_attn.v_proj.weight",
            "self_attn.o_proj.weight",
            "mlp.gate_proj.weight",
            "mlp.up_proj.weight",
            "mlp.down_proj.weight",
            "input_layernorm.weight",
            "post_attention_layernorm.weight",
        )
    ),
}


def params(model: QwenLikeForCausalLM) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


# --- model -------------------------------------------------------------------------------------


def test_parameters_carry_hugging_face_names_and_shapes() -> None:
    model = build_model(CFG, seed=0)
    named = dict(model.named_parameters())
    assert set(named) == HF_NAMES
    assert named["model.layers.0.self_attn.k_proj.weight"].shape == (
        CFG.num_kv_heads * CFG.head_dim,
        CFG.hidden_size,
    )
    assert named["lm_head.weight"].shape == (CFG.vocab_size, CFG.hidden_size)


def test_same_seed_gives_identical_weights_and_another_seed_changes_every_tensor() -> None:
    a, b, c = build_model(CFG, 0), build_model(CFG, 0), build_model(CFG, 1)
    assert weights_checksum(params(a)) == weights_checksum(params(b))
    for (name, pa), (_, pc) in zip(params(a), params(c), strict=True):
        assert not torch.equal(pa, pc), name


def test_config_overrides_reject_unknown_keys_by_name() -> None:
    assert QwenLikeConfig.from_overrides({"num_layers": 1}).num_layers == 1
    with pytest.raises(ValueError, match="bogus"):
        QwenLikeConfig.from_overrides({"bogus": 1})
    with pytest.raises(ValueError, match="num_kv_heads"):
        QwenLikeConfig(num_heads=4, num_kv_heads=3)


def test_incremental_decoding_through_the_pool_matches_the_full_forward() -> None:
    model = build_model(CFG, 0)
    seq = torch.tensor([[1, 5, 9, 3, 17, 22, 4, 8]])
    with torch.no_grad():
        full = model(seq)
    runner = ModelRunner(model, StaticBuffers.allocate(model, max_batch=2, max_seq=CFG.max_position))
    # Prefill 5 tokens into slot 1, then decode the remaining 3 one by one.
    with torch.no_grad():
        from colocd.engines.reference.model import KVCacheView

        pool = runner.buffers.kv_pool
        view = KVCacheView(pool, torch.tensor([1]), torch.ones((1, 5), dtype=torch.bool))
        pre = model(seq[:, :5], torch.arange(5)[None], view)
        steps = [
            model(
                seq[:, t : t + 1],
                torch.tensor([[t]]),
                KVCacheView(pool, torch.tensor([1]), torch.ones((1, 1), dtype=torch.bool)),
            )
            for t in range(5, 8)
        ]
    torch.testing.assert_close(pre, full[:, :5], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 5:], rtol=1e-5, atol=1e-5)


def test_a_padded_batch_step_gives_each_row_its_own_logits() -> None:
    model = build_model(CFG, 3)
    prompts = [[1, 4, 5, 6, 7, 8], [1, 9], [1, 10, 11, 12]]
    solo = [generate_greedy(ModelRunner(model, StaticBuffers.allocate(model, 1, 64)), p, 6) for p in prompts]
    runner = ModelRunner(model, StaticBuffers.allocate(model, 4, 64))
    pending = [list(p) for p in prompts]
    starts = [0, 0, 0]
    outs: list[list[int]] = [[], [], []]
    for _ in range(6):
        results = runner.step([ForwardInput(slot=i + 1, tokens=pending[i], start=starts[i]) for i in range(3)])
        for i, r in enumerate(results):
            outs[i].append(r.token)
            starts[i] += len(pending[i])
            pending[i] = [r.token]
    assert outs == solo


def test_training_forward_has_gradients_for_every_parameter() -> None:
    model = build_model(CFG, 0)
    ids = torch.randint(0, CFG.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    logits = model(ids[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, CFG.vocab_size), ids[:, 1:].reshape(-1))
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_load_weights_applies_by_name_and_returns_the_names() -> None:
    target, source = build_model(CFG, 0), build_model(CFG, 1)
    applied = target.load_weights(params(source))
    assert set(applied) == HF_NAMES
    assert weights_checksum(params(target)) == weights_checksum(params(source))


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (
            ("model.layers.9.mlp.up_proj.weight", torch.zeros(CFG.intermediate_size, CFG.hidden_size)),
            "model.layers.9",
        ),
        (("model.norm.weight", torch.zeros(CFG.hidden_size + 1)), "model.norm.weight.*shape"),
        (
            ("model.norm.weight", torch.zeros(CFG.hidden_size, dtype=torch.float64)),
            "model.norm.weight.*dtype",
        ),
    ],
)
def test_load_weights_with_one_bad_tensor_applies_nothing(bad: tuple[str, torch.Tensor], match: str) -> None:
    target, source = build_model(CFG, 0), build_model(CFG, 1)
    before = weights_checksum(params(target))
    with pytest.raises(ValueError, match=match):
        target.load_weights([*params(source), bad])
    assert weights_checksum(params(target)) == before


# --- tokenizer and sampling --------------------------------------------------------------------


def test_tokenizer_round_trips_and_names_unknown_characters() -> None:
    tok = CharTokenizer()
    ids = tok.encode("Hello, world.")
    assert ids[0] == tok.bos_token_id and max(ids) < 32
    assert tok.decode(ids) == "hello, world."
    with pytest.raises(ValueError, match="'!'"):
        tok.encode("hi!")


def test_greedy_picks_the_argmax_and_seeded_sampling_repeats() -> None:
    logits = torch.tensor([0.1, 2.0, -1.0, 1.9])
    assert choose_token(logits, SamplingConfig(temperature=0.0), None)[0] == 1
    assert choose_token(logits, SamplingConfig(temperature=1.0, top_k=1), None)[0] == 1
    cfg = SamplingConfig(temperature=1.0)
    draw = [choose_token(logits, cfg, torch.Generator().manual_seed(5))[0] for _ in range(2)]
    assert draw[0] == draw[1]
    many = {choose_token(logits, cfg, torch.Generator().manual_seed(s))[0] for s in range(40)}
    assert len(many) > 1
    assert choose_token(torch.full((4,), float("nan")), cfg, None)[0] in range(4)  # never crashes


# --- memory ------------------------------------------------------------------------------------


def test_release_frees_storage_and_resume_reallocates_with_the_same_shapes() -> None:
    model = build_model(CFG, 0)
    mem = MemoryRegions(model, max_batch=2, max_seq=16, device=torch.device("cpu"))
    shapes = {n: p.shape for n, p in model.named_parameters()}
    sizes = {t: mem.resident_nbytes(t) for t in MemoryTag}
    mem.release(normalize_tags(None))
    assert all(n > 0 for n in sizes.values()) and {t: mem.resident_nbytes(t) for t in MemoryTag} == sizes
    assert all(p.numel() == 0 for p in model.parameters())
    assert all(mem.state(t) is TagState.RELEASED for t in MemoryTag)
    with pytest.raises(RuntimeError, match="kv_cache"):
        _ = mem.kv_pool
    with pytest.raises(RuntimeError, match="cuda_graph"):
        _ = mem.workspace
    mem.resume([MemoryTag.WEIGHTS])
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert model.model.rotary_emb.inv_freq.numel() == CFG.head_dim // 2  # buffers restored intact


def test_double_release_and_resume_of_a_resident_tag_name_the_tag_and_change_nothing() -> None:
    mem = MemoryRegions(build_model(CFG, 0), max_batch=1, max_seq=8, device=torch.device("cpu"))
    mem.release([MemoryTag.KV_CACHE])
    with pytest.raises(MemoryTagError, match=r"'kv_cache'.*already released"):
        mem.release([MemoryTag.WEIGHTS, MemoryTag.KV_CACHE])
    assert mem.state(MemoryTag.WEIGHTS) is TagState.RESIDENT  # checked before anything moved
    with pytest.raises(MemoryTagError, match=r"'weights'.*already resident"):
        mem.resume([MemoryTag.KV_CACHE, MemoryTag.WEIGHTS])
    assert mem.state(MemoryTag.KV_CACHE) is TagState.RELEASED
    with pytest.raises(ValueError, match="'bogus'"):
        normalize_tags(["bogus"])


# --- scheduler (with a step function the test controls) -----------------------------------------


class GatedStep:
    """A fake model step: next token = (last token + 1) % 32, released one step at a time."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.entered = asyncio.Event()
        self.calls: list[list[ForwardInput]] = []

    async def __call__(self, rows: list[ForwardInput]) -> list[ForwardOutput]:
        self.calls.append(list(rows))
        self.entered.set()
        await self.gate.wait()
        self.gate.clear()
        self.entered.clear()
        return [ForwardOutput(token=(r.tokens[-1] + 1) % 32 or 3, logprob=-1.0) for r in rows]


def make_req(prompt: list[int], max_new: int) -> Req:
    return Req(
        rid="r",
        prompt_ids=prompt,
        stop=StopRule(max_new_tokens=max_new),
        sampling=SamplingConfig(0.0),
        generator=None,
        return_logprob=False,
        future=asyncio.get_running_loop().create_future(),
    )


async def run_steps(step: GatedStep, n: int) -> None:
    for _ in range(n):
        await step.entered.wait()
        step.gate.set()
        await asyncio.sleep(0)  # let the loop apply the result (a yield, not a timed wait)


async def test_scheduler_retract_requeues_running_requests_and_they_resume_from_their_tokens() -> None:
    step = GatedStep()
    sched = Scheduler(step, max_batch=2, max_seq=64, tokenizer=CharTokenizer(), memory_ready=lambda: True)
    loop = asyncio.create_task(sched.run())
    try:
        req = make_req([1, 5], max_new=4)
        await sched.submit(req)
        await run_steps(step, 1)
        await step.entered.wait()  # second step in flight
        retract = asyncio.create_task(sched.set_mode(SchedulerMode.RETRACT))
        step.gate.set()
        await retract
        assert sched.num_running == 0 and sched.num_waiting == 1 and req.num_retractions == 1
        assert sched.is_fully_idle(ignore_waiting=True) and not sched.is_fully_idle()
        await sched.set_mode(SchedulerMode.RUNNING)
        await run_steps(step, 2)
        out = await req.future
        assert out.output_ids == [6, 7, 8, 9] and out.num_retractions == 1
        # After the retract the request was prefilled again from its prompt plus its output so far.
        assert [list(r.tokens) for r in step.calls[2]] == [[1, 5, 6, 7]]
    finally:
        loop.cancel()


async def test_scheduler_in_place_pause_keeps_slots_and_abort_all_finishes_with_abort() -> None:
    step = GatedStep()
    sched = Scheduler(step, max_batch=2, max_seq=64, tokenizer=CharTokenizer(), memory_ready=lambda: True)
    loop = asyncio.create_task(sched.run())
    try:
        req = make_req([1, 5], max_new=10)
        await sched.submit(req)
        await run_steps(step, 1)
        await step.entered.wait()
        pause = asyncio.create_task(sched.set_mode(SchedulerMode.IN_PLACE))
        step.gate.set()
        await pause
        assert sched.num_running == 1 and not sched.is_fully_idle(ignore_waiting=True)
        assert await sched.abort_all("stop") == 1
        out = await req.future
        assert out.finish is not None and out.finish == {
            "type": "abort",
            "message": "stop",
            "status_code": None,
            "err_type": None,
        }
        assert out.output_ids == [6, 7] and sched.is_fully_idle()
    finally:
        loop.cancel()


async def test_scheduler_does_not_step_while_memory_is_not_ready() -> None:
    ready = False
    step = GatedStep()
    sched = Scheduler(step, max_batch=1, max_seq=64, tokenizer=CharTokenizer(), memory_ready=lambda: ready)
    loop = asyncio.create_task(sched.run())
    try:
        req = make_req([1], max_new=1)
        await sched.submit(req)
        for _ in range(5):
            await asyncio.sleep(0)
        assert step.calls == [] and sched.num_waiting == 1
        ready = True
        await sched.notify()
        await run_steps(step, 1)
        assert (finish := (await req.future).finish) is not None and finish["type"] == "length"
    finally:
        loop.cancel()


# --- payloads and the unpickler ------------------------------------------------------------------


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_plain_pickles_of_named_cpu_tensors_load() -> None:
    named = params(build_model(CFG, 2))[:3]
    with open_payload(b64(pickle.dumps(named)), None) as got:
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named, strict=True))


def test_flattened_bucket_with_simple_namespace_metadata_loads() -> None:
    named = params(build_model(CFG, 2))[:3]
    flat = torch.cat([t.reshape(-1).view(torch.uint8) for _, t in named])
    meta, start = [], 0
    for name, t in named:
        meta.append(
            types.SimpleNamespace(
                name=name,
                shape=t.shape,
                dtype=t.dtype,
                start_idx=start,
                end_idx=start + t.nbytes,
                numel=t.nbytes,
            )
        )
        start += t.nbytes
    entry = b64(pickle.dumps({"flattened_tensor": flat, "metadata": meta}))
    with open_payload(entry, "flattened_bucket") as got:
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, named, strict=True))


def test_sglang_metadata_class_is_mapped_without_importing_sglang() -> None:
    # Pickle an object whose class claims SGLang's module path, as an SGLang producer would.
    names = ["sglang", "sglang.srt", "sglang.srt.weight_sync", "sglang.srt.weight_sync.tensor_bucket"]
    assert not any(n in sys.modules for n in names)
    fakes = {n: types.ModuleType(n) for n in names}

    class FlattenedTensorMetadata:
        pass

    FlattenedTensorMetadata.__module__ = names[-1]
    FlattenedTensorMetadata.__qualname__ = "FlattenedTensorMetadata"
    fakes[names[-1]].FlattenedTensorMetadata = FlattenedTensorMetadata  # type: ignore[attr-defined]
    sys.modules.update(fakes)
    try:
        meta = FlattenedTensorMetadata()
        meta.__dict__.update(
            name="model.norm.weight",
            shape=torch.Size([2]),
            dtype=torch.float32,
            start_idx=0,
            end_idx=8,
            numel=8,
        )
        data = pickle.dumps({"flattened_tensor": torch.ones(2).view(torch.uint8), "metadata": [meta]})
    finally:
        for n in names:
            del sys.modules[n]
    with open_payload(b64(data), "flattened_bucket") as got:
        assert got[0][0] == "model.norm.weight" and torch.equal(got[0][1], torch.ones(2))


class _Evil:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("echo pwned",))


def test_unpickler_refuses_a_code_execution_global_and_names_it() -> None:
    with pytest.raises(UnsafePickleError, match=r"posix\.system|os\.system"):
        safe_loads(pickle.dumps([("x", _Evil())]))


def test_forking_pickler_cpu_tensors_are_refused_with_an_explanation() -> None:
    import torch.multiprocessing

    buf = io.BytesIO()
    ForkingPickler(buf).dump([("w", torch.ones(2))])
    with pytest.raises(UnsafePickleError, match="data inline"):
        safe_loads(buf.getvalue())


def test_unknown_load_format_and_bad_base64_are_payload_errors() -> None:
    with pytest.raises(PayloadError, match="unknown load_format"), open_payload(b64(b"x"), "nope"):
        pass
    with pytest.raises(PayloadError, match="base64"), open_payload("%%%", None):
        pass


def test_greedy_helper_stops_at_eos() -> None:
    class EosModel(torch.nn.Module):
        config = CFG

        def __init__(self) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, ids, positions, view):  # type: ignore[no-untyped-def]
            logits = torch.zeros(ids.shape[0], ids.shape[1], CFG.vocab_size)
            logits[..., EOS_ID] = 1.0
            return logits

    model = EosModel()
    runner = ModelRunner(model, StaticBuffers(torch.zeros(1), torch.zeros(1, CFG.vocab_size)))  # type: ignore[arg-type]
    assert generate_greedy(runner, [1, 4], 5, eos_id=EOS_ID) == [EOS_ID]


async def test_scheduler_reports_a_weight_version_span_per_version_that_produced_output_tokens() -> None:
    """SGLang 0.5.23's meta_info.weight_versions: a request alive across a version change gets one span per
    version, over its output tokens; one that started after the change names only the new version."""
    step = GatedStep()
    sched = Scheduler(step, max_batch=2, max_seq=64, tokenizer=CharTokenizer(), memory_ready=lambda: True,
                      weight_version="v1")
    loop = asyncio.create_task(sched.run())
    try:
        across = make_req([1, 5], max_new=4)
        await sched.submit(across)
        await run_steps(step, 2)  # two tokens under v1
        await step.entered.wait()  # the third step is in flight; the change waits for no step
        sched.record_version_change("v2")
        after = make_req([1, 5], max_new=2)
        await sched.submit(after)
        await run_steps(step, 3)  # the step in flight, then two more: `after` joins the batch at the next
        spans = (await across.future).weight_versions
        assert spans == ({"version": "v1", "start": 0, "end": 2}, {"version": "v2", "start": 2, "end": 4})
        assert (await after.future).weight_versions == ({"version": "v2", "start": 0, "end": 2},)
    finally:
        loop.cancel()
