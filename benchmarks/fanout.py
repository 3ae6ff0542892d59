"""``python3 -m benchmarks.fanout``: what one cluster step costs the cluster client, per daemon, and a model
of it at 64 / 256 / 1,024 nodes.

    python3 -m benchmarks.fanout --out benchmarks/results/fanout-cpu.json      # the recorded run
    python3 -m benchmarks.fanout --nodes 1 2 --rounds 3                   # a smoke run

Measured here, all real processes on loopback: ``max(--nodes)`` reference engines, each behind its own
``colocd serve``; this process is the ``ClusterClient``. For each N in ``--nodes`` and each round, one
full step over the first N daemons: ``train``, ``sync`` (the phase, then one weight push per node,
concurrent, timed per node with its commit call separately), ``rollout`` (its status check, then the
phase). Recorded per N: each fan-out's wall time, every node's own latency for it, and the client's CPU
time per request (``time.process_time`` of this process over the fan-outs; weights are pushed by
trainers on their own nodes in a real cluster, so the pushes' CPU is measured apart and left out).

The model (``simulate``): on a real cluster each daemon has its own node, so one node's latency is drawn
from the N=1 samples (here, N daemons share two cores and their latencies grow with N for that reason
alone). A fan-out to N nodes is one event loop dispatching N requests back to back and handling N
replies: ``wall = max_i(i * c_send + L_i) + c_recv * (replies still queued)``, with ``c`` the measured CPU
per request and ``L_i`` drawn from a lognormal fitted to the N=1 samples (its tail, not just the few
samples we have). Reported per N: p50/p99 of the simulated wall per phase and per step, the client's
CPU per step, and the open connections it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import random
import resource
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from colocd.api.client import AsyncColocdClient
from colocd.api.procs import DaemonProcess
from colocd.cluster.client import ClusterClient, StepResult
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess

from .records import write_record

__all__ = ["measure", "simulate"]

PHASES = ("train", "sync_phase", "push", "commit", "status_check", "rollout")
SIMULATED_NODES = (64, 256, 1024)
REQUESTS_PER_STEP = 5  # train, sync, status (which nodes to skip), status (rollout's check), rollout


def _percentile(xs: list[float], q: float) -> float:
    ordered = sorted(xs)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[k]


def _summary(xs: list[float]) -> dict[str, float]:
    return {"n": len(xs), "p50_ms": round(1e3 * statistics.median(xs), 3),
            "p99_ms": round(1e3 * _percentile(xs, 99), 3),
            "max_ms": round(1e3 * max(xs), 3), "mean_ms": round(1e3 * statistics.fmean(xs), 3)}


async def _push(url: str, step: int, model: Any) -> tuple[float, float]:
    """One node's complete push from this process (its trainer, here); returns (stream+commit s, commit s)."""
    from colocd.trainer.push import WeightPusher, manifest_of

    named = list(model.named_parameters())
    t0 = time.perf_counter()
    async with AsyncColocdClient(url) as client, WeightPusher(client, bucket_mb=1) as pusher:
        session = await client.open_session(f"v{step}", step=step, ranks=1, manifest=manifest_of(named))
        chunks, _ = await pusher.stream(session["session_id"], named)
        t1 = time.perf_counter()
        await client.commit(session["session_id"], chunks)
    t2 = time.perf_counter()
    return t2 - t0, t2 - t1


async def client_cost(url: str, requests: int = 200) -> dict[str, float]:
    """CPU per ``GET /v1/status`` on one keep-alive connection: through ``AsyncColocdClient`` (on
    aiohttp), and through a bare HTTP/1.1 exchange on asyncio streams (the floor under any client)."""
    async with AsyncColocdClient(url) as client:
        await client.status()
        c0 = time.process_time()
        for _ in range(requests):
            await client.status()
        client_ms = 1e3 * (time.process_time() - c0) / requests
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    request = f"GET /v1/status HTTP/1.1\r\nHost: {parts.netloc}\r\n\r\n".encode()

    async def bare() -> None:
        writer.write(request)
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        json.loads(await reader.readexactly(length))  # parsed, as the client does

    try:
        await bare()
        c0 = time.process_time()
        for _ in range(requests):
            await bare()
        bare_ms = 1e3 * (time.process_time() - c0) / requests
    finally:
        writer.close()
        await writer.wait_closed()
    return {"client_ms": round(client_ms, 4), "bare_http11_ms": round(bare_ms, 4), "requests": requests}


async def _timed_cpu(kind: str, fan_out: Callable[[], Awaitable[StepResult]],
                     cpu: dict[str, list[float]]) -> StepResult:
    c0 = time.process_time()
    result = await fan_out()
    cpu.setdefault(kind, []).append(time.process_time() - c0)
    return result


async def measure(node_counts: list[int], rounds: int) -> dict[str, Any]:
    """Start max(node_counts) engine+daemon pairs and time ``rounds`` steps for each N; returns the raw record."""
    from colocd.engines.reference.model import QwenLikeConfig, build_model

    biggest = max(node_counts)
    engines = [ReferenceEngineProcess(ReferenceEngineConfig(name="ref0", url="http://127.0.0.1:0", seed=0))
               for _ in range(biggest)]
    daemons: list[DaemonProcess] = []
    try:
        # Two at a time: a small box starting eight torch processes at once thrashes past any deadline.
        starting = asyncio.Semaphore(2)

        async def bounded(start: Awaitable[Any]) -> Any:
            async with starting:
                return await start

        await asyncio.gather(*(bounded(e.astart()) for e in engines))
        daemons = [DaemonProcess({"engines": [{"kind": "reference", "name": "ref0", "url": e.url}],
                                  "timeouts": {"health_interval_s": 5.0}}, ready_timeout_s=300) for e in engines]
        await asyncio.gather(*(bounded(d.__aenter__()) for d in daemons))
        model = build_model(QwenLikeConfig(), seed=7)
        step = 0
        per_n: dict[str, Any] = {}
        for n in node_counts:
            urls = {f"node{i}": daemons[i].url for i in range(n)}
            samples: dict[str, list[float]] = {p: [] for p in PHASES}
            walls: dict[str, list[float]] = {p: [] for p in ("train", "sync", "rollout", "step")}
            cpu: dict[str, list[float]] = {}
            async with ClusterClient(urls) as cluster:
                await cluster.status()  # connections opened before anything is timed
                for _ in range(rounds):
                    step += 1
                    t0 = time.perf_counter()
                    train = await _timed_cpu("train", functools.partial(cluster.phase, "train", step), cpu)
                    sync = await _timed_cpu("sync", functools.partial(cluster.phase, "sync", step), cpu)
                    pushes = await asyncio.gather(*(_push(u, step, model) for u in urls.values()))
                    check = await _timed_cpu("status", cluster.status, cpu)
                    t_roll = time.perf_counter()
                    # rollout(): a status fan-out (its cluster-wide check), then the phase: two requests per node
                    rollout = await _timed_cpu(
                        "rollout", functools.partial(cluster.rollout, step, version=f"v{step}"), cpu)
                    walls["train"].append(train.seconds)
                    walls["sync"].append(sync.seconds + max(p[0] for p in pushes))
                    walls["rollout"].append(time.perf_counter() - t_roll)
                    walls["step"].append(time.perf_counter() - t0)
                    samples["train"] += [r.seconds for r in train.nodes.values()]
                    samples["sync_phase"] += [r.seconds for r in sync.nodes.values()]
                    samples["push"] += [p[0] for p in pushes]
                    samples["commit"] += [p[1] for p in pushes]
                    samples["status_check"] += [r.seconds for r in check.nodes.values()]
                    samples["rollout"] += [r.seconds for r in rollout.nodes.values()]
            # Fan-outs timed for CPU: train, sync, status, rollout (its own status check + phase) = 5 requests per node.
            requests = rounds * n * REQUESTS_PER_STEP
            total_cpu = sum(sum(v) for v in cpu.values())
            per_kind = {k: round(1e3 * sum(v) / (rounds * n * (2 if k == "rollout" else 1)), 4) for k, v in cpu.items()}
            per_n[str(n)] = {
                "per_node_latency": {p: _summary(v) for p, v in samples.items()},
                "per_node_samples_s": {p: [round(x, 6) for x in v] for p, v in samples.items()},
                "fan_out_wall": {p: _summary(v) for p, v in walls.items()},
                "client_cpu_per_request_ms": round(1e3 * total_cpu / requests, 4),
                "client_cpu_per_request_ms_by_fan_out": per_kind,
                "client_cpu_per_step_ms": round(1e3 * total_cpu / rounds, 3),
            }
            print(f"N={n}: step p50 {per_n[str(n)]['fan_out_wall']['step']['p50_ms']:.1f} ms, "
                  f"client CPU {per_n[str(n)]['client_cpu_per_request_ms']:.3f} ms/request", flush=True)
        per_n["client_cost"] = await client_cost(daemons[0].url)
        print(f"client CPU per status request: {per_n['client_cost']}", flush=True)
        return per_n
    finally:
        await asyncio.gather(*(d.stop() for d in daemons), return_exceptions=True)
        await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)


def _lognormal(samples: list[float]) -> tuple[float, float]:
    logs = [math.log(max(x, 1e-6)) for x in samples]
    return statistics.fmean(logs), statistics.pstdev(logs) or 1e-3


def _fan_out_wall(n: int, mu: float, sigma: float, c_send: float, c_recv: float, rng: random.Random) -> float:
    """One fan-out on one event loop: requests leave every c_send, replies are handled one at a time."""
    arrivals = sorted(i * c_send + rng.lognormvariate(mu, sigma) for i in range(n))
    busy_until = n * c_send  # the loop is dispatching until then
    for t in arrivals:
        busy_until = max(busy_until, t) + c_recv
    return busy_until


def simulate(measured: dict[str, Any], nodes: tuple[int, ...] = SIMULATED_NODES, trials: int = 200,
             seed: int = 0) -> dict[str, Any]:
    """The cluster step at ``nodes`` from the N=1 per-node latencies and the client's CPU per request."""
    counts = [k for k in measured if k.isdigit()]
    base = measured["1"] if "1" in measured else measured[min(counts, key=int)]
    # CPU per request: the largest measured N (per-request costs amortise best there); or the bare
    # HTTP/1.1 floor's, scaled from the one measured beside the client.
    largest = measured[max(counts, key=int)]
    c_client = largest["client_cpu_per_request_ms"] / 1e3
    cost = measured.get("client_cost")
    lean = c_client * cost["bare_http11_ms"] / cost["client_ms"] if cost else None
    clients = {"client": c_client, **({"bare_http11": lean} if lean else {})}
    return {name: _simulate(base, c, nodes, trials, seed) for name, c in clients.items()}


def _simulate(base: dict[str, Any], c: float, nodes: tuple[int, ...], trials: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    c_send = c_recv = c / 2
    fits = {p: _lognormal(base["per_node_samples_s"][p]) for p in ("train", "sync_phase", "status_check", "rollout",
                                                                    "push")}
    soft_fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    out: dict[str, Any] = {}
    for n in nodes:
        steps: list[float] = []
        phases: dict[str, list[float]] = {p: [] for p in fits}
        for _ in range(trials):
            train = _fan_out_wall(n, *fits["train"], c_send, c_recv, rng)
            sync_phase = _fan_out_wall(n, *fits["sync_phase"], c_send, c_recv, rng)
            status = _fan_out_wall(n, *fits["status_check"], c_send, c_recv, rng)
            # Pushes run on every node at once, trainer to its own daemon: the slowest one counts.
            push = max(rng.lognormvariate(*fits["push"]) for _ in range(n))
            rollout = _fan_out_wall(n, *fits["status_check"], c_send, c_recv, rng) + \
                _fan_out_wall(n, *fits["rollout"], c_send, c_recv, rng)
            for p, v in (("train", train), ("sync_phase", sync_phase), ("status_check", status), ("push", push),
                         ("rollout", rollout)):
                phases[p].append(v)
            steps.append(train + sync_phase + status + push + rollout)
        out[str(n)] = {
            "step": _summary(steps),
            "phases": {p: _summary(v) for p, v in phases.items()},
            "client_cpu_per_step_ms": round(1e3 * c * n * REQUESTS_PER_STEP, 1),
            "client_dispatch_per_fan_out_ms": round(1e3 * c * n, 2),
            "connections": n,
            "fd_soft_limit_here": soft_fds,
            "fits_fd_limit": n + 64 < soft_fds,
        }
    return {"assumptions": {"per_request_cpu_ms": round(1e3 * c, 4), "latency_model": "lognormal fitted to N=1",
                            "requests_per_node_per_step": REQUESTS_PER_STEP, "trials": trials},
            "nodes": out}


async def _main(args: argparse.Namespace) -> int:
    measured = await measure(sorted(set(args.nodes)), args.rounds)
    record: dict[str, Any] = {
        "bench": "fanout",
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                    "load_avg_at_end": os.getloadavg()},
        "settings": {"nodes": sorted(set(args.nodes)), "rounds": args.rounds},
        "measured": measured,
        "simulated": simulate(measured),
    }
    for client, sim in record["simulated"].items():
        for n, row in sim["nodes"].items():
            print(f"simulated ({client}) N={n}: step p50 {row['step']['p50_ms']:.0f} ms p99 {row['step']['p99_ms']:.0f}"
                  f" ms; client CPU {row['client_cpu_per_step_ms']:.0f} ms/step; {row['connections']} connections",
                  flush=True)
    if args.out:
        write_record(Path(args.out), record)
        print(f"wrote {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.fanout", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4, 8], help="daemon counts to measure")
    parser.add_argument("--rounds", type=int, default=15, help="steps per daemon count")
    parser.add_argument("--out", default=None, help="write the JSON record here")
    return asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
