"""``colocd demo``: a tiny but real colocated RL loop through the daemon, on the reference engine.

Three processes: this one (the trainer), ``colocd serve`` (the daemon) and the reference engine.
Each step: sample rollouts from the engine's /generate → train (engine releases its memory) →
one REINFORCE update → sync (weights memory back, weights streamed through the daemon) →
rollout (KV back, generation continues at the new version) → verify engine weights == trainer's.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch

from ..api.client import AsyncColocdClient
from ..api.procs import DaemonProcess
from ..engines.chunks import tensor_checksum
from ..engines.config import ReferenceEngineConfig
from ..engines.reference.launcher import ReferenceEngineProcess
from ..engines.reference.model import QwenLikeConfig, build_model
from ..engines.reference.tokenizer import BOS_ID
from ..errors import MatplotlibMissing
from ..timeline import render_timeline
from ..trainer.agent import TrainerAgent
from ..trainer.push import WeightPusher

__all__ = ["DemoSettings", "run_demo"]

# The toy task: after <bos>, emit "abcdabcd" (token ids 3..6). Reward = the matching prefix's share
# of the pattern: a per-position score would let the policy collapse onto "dddddddd" (2 of 8 right).
TARGET = [3, 4, 5, 6, 3, 4, 5, 6]


@dataclass(frozen=True, slots=True)
class DemoSettings:
    steps: int = 60
    batch: int = 32
    device: str = "cpu"
    seed: int = 0
    lr: float = 0.002
    json_out: str | None = None
    timeline_out: str | None = None  # draw the last step's timeline here (needs matplotlib)
    metrics_out: str | None = None  # append the daemon's /metrics after each step, as JSON lines


def _reward(output_ids: list[int]) -> float:
    matched = 0
    for got, want in zip(output_ids, TARGET, strict=False):
        if got != want:
            break
        matched += 1
    return matched / len(TARGET)


async def _rollouts(http: httpx.AsyncClient, url: str, batch: int, seed: int) -> list[list[int]]:
    body = {
        "input_ids": [[BOS_ID] for _ in range(batch)],
        "sampling_params": [{"max_new_tokens": len(TARGET), "temperature": 1.0, "ignore_eos": True,
                             "sampling_seed": seed + i}
                            for i in range(batch)],
    }
    response = await http.post(f"{url}/generate", json=body)
    response.raise_for_status()
    return [item["output_ids"][: len(TARGET)] for item in response.json()]


def _reinforce_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: list[list[int]]) -> None:
    """One REINFORCE step: each token is credited with whether the prefix up to it is right,
    against the batch's mean as baseline."""
    ids = torch.tensor([[BOS_ID, *s] for s in samples])
    logits = model(ids[:, :-1])
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    prefix_right = (ids[:, 1:] == torch.tensor(TARGET)).float().cumprod(dim=1)
    advantage = prefix_right - prefix_right.mean()
    loss = -(advantage * logp).sum(dim=1).mean()
    optimizer.zero_grad()
    loss.backward()  # type: ignore[no-untyped-call]  # torch's backward is untyped
    optimizer.step()


async def _engine_checksum(http: httpx.AsyncClient, url: str) -> str:
    response = await http.post(f"{url}/weights_checker", json={"action": "checksum"})
    response.raise_for_status()
    data = response.json()
    return str(data.get("colocd_checksum"))


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


async def run_demo(settings: DemoSettings) -> int:
    torch.manual_seed(settings.seed)
    workdir = tempfile.mkdtemp(prefix="colocd-demo-")
    engine_cfg = ReferenceEngineConfig(name="ref0", url="http://127.0.0.1:0", device=settings.device,
                                       seed=settings.seed)
    model = build_model(QwenLikeConfig(), seed=settings.seed, device="cpu")
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    records: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    print(f"colocd demo: trainer (this process) + daemon + reference engine on {settings.device}; "
          f"{settings.steps} steps, {settings.batch} rollouts/step; target pattern {TARGET}", flush=True)
    async with ReferenceEngineProcess(engine_cfg) as engine:
        daemon_cfg = {"engines": [{"kind": "reference", "name": "ref0", "url": engine.url}],
                      "journal": f"{workdir}/journal.jsonl"}
        engine_url = engine.url
        assert engine_url is not None  # set once the engine is ready
        async with DaemonProcess(daemon_cfg, workdir=workdir) as daemon, \
                AsyncColocdClient(daemon.url) as client, \
                httpx.AsyncClient(timeout=120, trust_env=False) as http:
            await client.wait_ready(30)
            if await _engine_checksum(http, engine_url) != tensor_checksum(model.named_parameters()):
                print("engine and trainer start from different weights", flush=True)
                return 1
            pusher = WeightPusher(client, transport="inline", bucket_mb=0.1, depth=2)
            agent = TrainerAgent(client)
            print(f"{'step':>4} {'reward':>7} {'sleep_s':>8} {'update_s':>9} {'wake_s':>7} {'bytes':>9} "
                  f"{'version':>7}  weights", flush=True)
            for step in range(1, settings.steps + 1):
                samples = await _rollouts(http, engine_url, settings.batch, seed=step * 1000)
                rewards = [_reward(s) for s in samples]
                mean_reward = sum(rewards) / len(rewards)

                train = await agent.train(step)
                _reinforce_step(model, optimizer, samples)
                await agent.sync(step)  # runs the policy's trainer-side cleanup and reports it
                push = await pusher.push(model.named_parameters(), version=str(step), step=step)
                rollout = await agent.rollout(step)

                trainer_sum = tensor_checksum(model.named_parameters())
                engine_sum = await _engine_checksum(http, engine_url)
                status = (await client.status())["engines"]["ref0"]
                ok = engine_sum == trainer_sum and status["weight_version"] == str(step)
                record = {"step": step, "reward": mean_reward, "sleep_s": train["duration_s"],
                          "update_s": push.seconds, "wake_s": rollout["duration_s"], "bytes": push.nbytes,
                          "chunks": push.chunks, "version": status["weight_version"], "weights_match": ok,
                          "freed_bytes": train["freed_bytes"]}
                records.append(record)
                print(f"{step:>4} {mean_reward:>7.3f} {record['sleep_s']:>8.3f} {record['update_s']:>9.3f} "
                      f"{record['wake_s']:>7.3f} {push.nbytes:>9} {record['version']:>7}  "
                      f"{'match' if ok else 'MISMATCH'}", flush=True)
                if not ok:
                    print(f"engine weights differ from the trainer's after step {step}", flush=True)
                    return 1
                if settings.metrics_out:
                    await _append_scrape(settings.metrics_out, step, await client.metrics())
            if settings.timeline_out and records:
                await _draw_last_step(client, records[-1]["step"], settings.timeline_out)
    first = sum(r["reward"] for r in records[:3]) / max(len(records[:3]), 1)
    last = sum(r["reward"] for r in records[-3:]) / max(len(records[-3:]), 1)
    elapsed = time.perf_counter() - t_start
    print(f"reward {first:.3f} → {last:.3f} (mean of first/last 3 steps); every sync verified by checksum; "
          f"{elapsed:.1f}s", flush=True)
    if settings.json_out:
        await asyncio.to_thread(Path(settings.json_out).write_text, json.dumps(
            {"records": records, "first_reward": first, "last_reward": last, "seconds": elapsed}, indent=2))
    if last <= first:
        print("reward did not improve", flush=True)
        return 1
    return 0


def main() -> None:  # pragma: no cover - convenience for `python -m colocd.demo.loop`
    raise SystemExit(asyncio.run(run_demo(DemoSettings())))
