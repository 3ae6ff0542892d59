"""``colocd demo``: a tiny but real colocated RL loop through the daemon, on any engine colocd drives.

Three processes: this one (the trainer), ``colocd serve`` (the daemon) and the engine, which the daemon launches
from the node config (``launch:``). Each step: sample rollouts from the engine's own generate API → train (the
engine releases its memory) → one REINFORCE update → sync (weights memory back, weights streamed through the
daemon) → rollout (KV back, generation continues at the new version) → verify the engine's weights are the
trainer's. What differs per engine (the model, the toy task, the generate API, the check) is a ``Task``: the
reference engine's is here, vLLM's and SGLang's in ``demo/live.py``.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import httpx
import torch

from ..api.client import AsyncColocdClient
from ..api.procs import DaemonProcess
from ..engines.reference.model import QwenLikeConfig, build_model
from ..engines.reference.tokenizer import BOS_ID
from ..errors import EngineMissing, MatplotlibMissing
from ..timeline import render_timeline
from ..trainer.agent import TrainerAgent
from ..trainer.push import PushReport, WeightPusher

__all__ = ["DemoSettings", "EngineKind", "Task", "run_demo", "sglang_digest"]

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


class Task(Protocol):
    """One engine's side of the demo: the trainer's model, the toy task, the generate API, the check."""

    name: str  # the engine's name in the node config
    steps: int  # default number of steps
    engine: dict[str, Any]  # its node config entry (with ``launch``)
    ready_timeout_s: float
    pusher: dict[str, Any]  # WeightPusher's settings

    def weights(self) -> list[tuple[str, torch.Tensor]]: ...
    async def rollouts(self, http: httpx.AsyncClient, url: str, batch: int, seed: int) -> list[list[int]]: ...
    def reward(self, sample: list[int]) -> float: ...
    def train(self, samples: list[list[int]]) -> None: ...
    async def check(self, http: httpx.AsyncClient, url: str, push: PushReport) -> str | None:
        """What verified the engine's weights (``verified: ...``), or None when they are not the trainer's."""


# --- the reference engine's task: emit "abcdabcd" after <bos> ----------------------------------------------------

# Token ids 3..6. Reward = the matching prefix's share of the pattern: a per-position score would let the policy
# collapse onto "dddddddd" (2 of 8 right).
TARGET = [3, 4, 5, 6, 3, 4, 5, 6]


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
                "sampling_params": [{"max_new_tokens": len(TARGET), "temperature": 1.0, "ignore_eos": True,
                                     "sampling_seed": seed + i} for i in range(batch)]}
        response = await http.post(f"{url}/generate", json=body)
        response.raise_for_status()
        return [item["output_ids"][: len(TARGET)] for item in response.json()]

    def reward(self, sample: list[int]) -> float:
        matched = 0
        for got, want in zip(sample, TARGET, strict=False):
            if got != want:
                break
            matched += 1
        return matched / len(TARGET)

    def train(self, samples: list[list[int]]) -> None:
        """One REINFORCE step: each token is credited with whether the prefix up to it is right, against the
        batch's mean as baseline."""
        ids = torch.tensor([[BOS_ID, *s] for s in samples])
        logits = self.model(ids[:, :-1])
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        prefix_right = (ids[:, 1:] == torch.tensor(TARGET)).float().cumprod(dim=1)
        loss = -((prefix_right - prefix_right.mean()) * logp).sum(dim=1).mean()
        self.optimizer.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
        self.optimizer.step()

    async def check(self, http: httpx.AsyncClient, url: str, push: PushReport) -> str | None:
        """Every parameter's ``/weights_checker`` checksum is the trainer's (the engine's parameters are unfused)."""
        response = await http.post(f"{url}/weights_checker", json={"action": "checksum"})
        response.raise_for_status()
        want = {name: sglang_digest(t) for name, t in self.weights()}
        ranks = response.json()["ranks"]
        same = bool(ranks) and all(rank["checksums"] == want for rank in ranks)
        return "verified: checksum" if same else None


def sglang_digest(t: torch.Tensor) -> str:
    """SGLang's ``/weights_checker`` checksum of one tensor: the first 8 bytes of the sha256 of its bytes
    (srt/utils/weight_checker.py ``_hash_tensor``, managers/mm_utils.py ``tensor_hash``)."""
    data = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(data.tobytes()).digest()[:8].hex()


# --- the loop ----------------------------------------------------------------------------------------------------


def _task(settings: DemoSettings, workdir: str) -> Task:
    if settings.engine == "reference":
        return ReferenceTask(settings, workdir)
    from .live import LiveTask

    return LiveTask(settings, workdir)


async def run_demo(settings: DemoSettings) -> int:
    torch.manual_seed(settings.seed)
    workdir = tempfile.mkdtemp(prefix=f"colocd-demo-{settings.engine}-")
    try:
        task = _task(settings, workdir)
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
                await _append_scrape(settings.metrics_out, step, await client.metrics())
        if settings.timeline_out and records:
            await _draw_last_step(client, records[-1]["step"], settings.timeline_out)
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


async def _append_scrape(path: str, step: int, exposition: str) -> None:
    line = json.dumps({"step": step, "time": time.time(), "metrics": exposition}) + "\n"

    def write() -> None:
        with open(path, "a") as f:
            f.write(line)

    await asyncio.to_thread(write)


async def _draw_last_step(client: AsyncColocdClient, step: int, out: str) -> None:
    traces = await client.trace(step)
    try:
        await asyncio.to_thread(render_timeline, traces, out, step=step)
    except MatplotlibMissing as exc:
        print(f"timeline not drawn: {exc}", flush=True)
        return
    print(f"timeline of step {step}: {out}", flush=True)


def main() -> None:  # pragma: no cover - convenience for `python -m colocd.demo.loop`
    raise SystemExit(asyncio.run(run_demo(DemoSettings())))
