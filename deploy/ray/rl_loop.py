"""A small RL loop in the shape of a Ray-based framework (verl, OpenRLHF, NeMo-RL): trainer actors per node,
colocd per node, the driver stepping the cluster. Runs on CPU, on this machine, with one command:

    python deploy/ray/rl_loop.py                    # a local 3-node Ray cluster, 3 steps
    python deploy/ray/rl_loop.py --nodes 2 --steps 5
    python deploy/ray/rl_loop.py --address auto     # an existing cluster (`ray start --head` ...)

Every step: the engines generate (rollout), a reward scores each completion, ``train`` releases the
engines' memory on every node, each trainer rank takes a policy-gradient step, ``sync`` streams each
rank's new weights into its own node's engines, ``rollout`` resumes them all at the new version.

The ranks are data-parallel replicas: each starts from the engine's weights (same seed) and applies
the same update (every rank sees the whole batch), so all nodes serve one version, as they would
after a framework's gradient all-reduce. The model is the reference engine's tiny char-level LM.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # a local cluster stays on loopback

import httpx
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from colocd.cluster import ClusterClient
from colocd.cluster.registry import NodeDaemons, NodeSpec, daemon_urls

PROMPTS = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [10, 11, 12]]
NEW_TOKENS = 6
TARGET = 17  # the reward: how often a completion says token 17

SPEC = NodeSpec(
    engines=[{"kind": "reference", "name": "ref0", "launch": {}}],  # launched (and relaunched) by the node's daemon
    daemon={"timeouts": {"health_interval_s": 1.0, "default_s": 30}},
    listen_host="127.0.0.1",  # one machine; on a real cluster leave it unset (the node's IP) and set a token
)


@ray.remote(num_cpus=0)
class TrainerRank:
    """One data-parallel trainer rank, on one node; it pushes to that node's daemon only."""

    def __init__(self, lr: float = 0.05) -> None:
        import torch

        from colocd.engines.reference.model import QwenLikeConfig, build_model

        self.torch = torch
        self.model = build_model(QwenLikeConfig(), seed=0)  # the engines' launch weights (seed 0)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=lr)

    def train(self, samples: list[dict[str, Any]]) -> float:
        """REINFORCE with a mean baseline: raise the log-probability of completions that scored well."""
        torch = self.torch
        rewards = torch.tensor([s["reward"] for s in samples])
        advantages = rewards - rewards.mean()
        loss = torch.zeros(())
        for sample, advantage in zip(samples, advantages, strict=True):
            ids = torch.tensor([sample["prompt"] + sample["completion"]])
            logits = self.model(ids[:, :-1])
            logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[0, :, 0]
            loss = loss - advantage * logp[len(sample["prompt"]) - 1:].sum()
        self.optim.zero_grad()
        (loss / len(samples)).backward()
        self.optim.step()
        return float(loss)

    async def push(self, step: int) -> dict[str, Any]:
        from colocd.cluster.registry import push_to_this_node

        return await push_to_this_node(self.model.named_parameters(), version=f"v{step}", step=step,
                                       bucket_mb=0.1)

    def node_id(self) -> str:
        return str(ray.get_runtime_context().get_node_id())


async def generate(engine_url: str, prompt: list[int], seed: int) -> dict[str, Any]:
    async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
        r = await http.post(f"{engine_url}/generate", json={
            "input_ids": prompt, "sampling_params": {"max_new_tokens": NEW_TOKENS, "temperature": 1.0,
                                                     "ignore_eos": True, "sampling_seed": seed}})
        r.raise_for_status()
        body = r.json()
    completion = list(body["output_ids"])
    return {"prompt": prompt, "completion": completion, "reward": completion.count(TARGET) / NEW_TOKENS,
            "version": body["meta_info"]["weight_version"]}


async def rollout_batch(engines: dict[str, str], step: int) -> list[dict[str, Any]]:
    """Every node's engine answers every prompt: the batch is spread over the cluster's engines."""
    jobs = [generate(url, p, seed=step * 1000 + i) for url in engines.values() for i, p in enumerate(PROMPTS)]
    return list(await asyncio.gather(*jobs))


async def run(steps: int) -> list[dict[str, Any]]:
    """The loop on the connected Ray cluster; continues from the cluster's current step. Returns per-step rows."""
    daemons = NodeDaemons(SPEC)  # job-scoped: they go when this driver disconnects
    infos = daemons.ensure()
    trainers = {node: TrainerRank.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote() for node in infos}
    rows = []
    async with ClusterClient(daemon_urls()) as cluster:
        status = await cluster.status()
        # Where each node's daemon launched its engine (the URL stays the same across relaunches).
        engines = {node: r.body["engines"]["ref0"]["launched"]["url"] for node, r in status.nodes.items()}
        start = max(r.body["node"]["step"] for r in status.nodes.values()) + 1
        for step in range(start, start + steps):
            t0 = time.perf_counter()
            samples = await rollout_batch(engines, step)
            reward = sum(s["reward"] for s in samples) / len(samples)
            train = await cluster.phase("train", step)
            losses = await asyncio.gather(*(t.train.remote(samples) for t in trainers.values()))
            sync = await cluster.sync(step, f"v{step}", lambda node, step=step: trainers[node].push.remote(step))
            resumed = await cluster.rollout(step)
            row = {"step": step, "nodes": len(trainers), "reward": round(reward, 4), "loss": round(losses[0], 4),
                   "versions_seen": sorted({s["version"] for s in samples}),
                   "train_s": round(train.seconds, 3), "sync_s": round(sync.seconds, 3),
                   "rollout_s": round(resumed.seconds, 3), "step_s": round(time.perf_counter() - t0, 3)}
            rows.append(row)
            print(f"step {step}: reward {row['reward']:.3f} loss {row['loss']:+.3f} on {row['nodes']} nodes; "
                  f"train {row['train_s']:.2f}s sync {row['sync_s']:.2f}s rollout {row['rollout_s']:.2f}s "
                  f"(served {','.join(row['versions_seen'])})", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="local Ray nodes to start (ignored with --address)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--address", default=None, help="join this Ray cluster instead of starting a local one")
    args = parser.parse_args(argv)
    if args.address:
        ray.init(address=args.address, include_dashboard=False)
        asyncio.run(run(args.steps))
        return 0
    from local_cluster import local_cluster  # beside this file

    with local_cluster(nodes=args.nodes):
        asyncio.run(run(args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
