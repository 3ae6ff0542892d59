"""GPU memory truth under faults, on one GPU: a leak watch, then a daemon SIGKILLed mid-push and started again.

    python3 -m benchmarks.faults_gpu --model qwen3-8b --kv-gib 40 --steps 20 --out benchmarks/results/faults-h200.json

Three processes, as a colocated node runs them: this one is the trainer (the checkpoint's shapes in bf16 on
cuda:0, pushed with ``WeightPusher()`` defaults), a real ``colocd serve`` on a journal, and the reference
engine it launches itself (``launch:`` of ``benchmarks.sink_engine``, with a KV block on cuda:0).

1. Leak watch: ``--steps`` full steps (train, sync, push, rollout), each push verified against the engine's
   own checksums; after each, the trainer's ``memory_allocated``/``memory_reserved``, every process's
   device memory (``nvidia-smi``), the device's used memory, ``/dev/shm`` segments and the open fds of the
   trainer, the daemon and the engine. Flat means: from the first step to the last, no growth beyond
   ``--slack-mib`` of memory, no new segment, at most ``--fd-slack`` fds.
2. Daemon SIGKILL mid-push: train, sync, half the tensors streamed, SIGKILL the daemon; start it again on
   its journal. Asserted: it adopted the running engine (status ``launched.adopted``, same pid), exactly
   one engine process holds memory on the GPU, the next push commits and verifies, and the device's used
   memory is back to what one engine plus this trainer used in the leak watch (within ``--slack-mib``).

Prints one JSON record (and writes it to ``--out``); exits 1 if any check failed. Needs PyTorch with CUDA,
``nvidia-smi``, and colocd's daemon requirements (fastapi, uvicorn, pydantic) in this Python.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from colocd.api.client import AsyncColocdClient
from colocd.api.procs import DaemonProcess
from colocd.trainer.push import WeightPusher

from .sink import device_checksum, hf_shapes
from .sink_engine import sink_launch

GIB = 1 << 30
MIB = 1 << 20


def gpu_processes(cuda: bool = True) -> dict[int, int]:
    """pid -> bytes of device memory, for every compute process nvidia-smi lists (none on CPU)."""
    if not cuda:
        return {}
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    found = {}
    for line in out.strip().splitlines():
        pid, used = (x.strip() for x in line.split(","))
        if pid.isdigit() and used.isdigit():
            found[int(pid)] = int(used) * MIB
    return found


def device_used(cuda: bool = True, index: int = 0) -> int | None:
    if not cuda:
        return None
    out = subprocess.run(["nvidia-smi", f"--id={index}", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip().splitlines()[0]) * MIB


def fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def shm() -> tuple[int, int]:
    names = [n for n in os.listdir("/dev/shm") if not n.startswith(".")]
    size = 0
    for n in names:
        try:
            size += os.stat(os.path.join("/dev/shm", n)).st_size
        except OSError:
            pass
    return len(names), size


def reference_engines(marker: str) -> list[int]:
    """Pids of the reference engine processes of this run (``COLOCD_FAULTS_RUN=<marker>`` in their environment)."""
    found = []
    want = f"COLOCD_FAULTS_RUN={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
                environ = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"colocd.engines.reference\0" in cmdline and want in environ:
                found.append(int(entry))
    return sorted(found)


def perturb(named: list[tuple[str, torch.Tensor]], step: int) -> list[list[int]]:
    """A new version: the first tensor's first row set to ``step``; returns the checksums the engine must hold."""
    named[0][1].view(-1)[:4096].fill_(float(step))
    return device_checksum(t for _, t in named)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class Node:
    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.workdir = workdir
        engine = {"kind": "reference", "name": "ref0", "device": "cuda:0" if args.cuda else "cpu", "seed": 0,
                  "launch": sink_launch(args.model, args.kv_gib, ready_timeout_s=900, stop_grace_s=30,
                                        backoff_initial_s=1, log_file=str(workdir / "engine.log"),
                                        env={"COLOCD_FAULTS_RUN": str(workdir)})}
        self.config = {"engines": [engine], "journal": str(workdir / "journal.jsonl")}
        self.runs = 0

    def daemon(self) -> DaemonProcess:
        self.runs += 1
        run = self.workdir / f"daemon-{self.runs}"
        run.mkdir()
        return DaemonProcess(self.config, workdir=str(run), ready_timeout_s=900, log_level="info")


async def ready(client: AsyncColocdClient, timeout_s: float = 900) -> None:
    await client.wait_ready(timeout_s)


async def engine_holds(url: str, names: list[str], expected: list[list[int]]) -> bool:
    async with httpx.AsyncClient(trust_env=False, timeout=120) as http:
        sink = (await http.get(f"{url}/colocd/sink")).raise_for_status().json()
    return [sink["checksums"].get(n) for n in names] == expected


async def full_step(client: AsyncColocdClient, step: int, named: list[tuple[str, torch.Tensor]]) -> float:
    """One step; ``named`` is perturbed for it first (``perturb``)."""
    await client.phase("train", step)
    await client.phase("sync", step)
    t0 = time.perf_counter()
    await WeightPusher(client).push(named, version=f"v{step}", step=step)
    push_s = time.perf_counter() - t0
    await client.phase("rollout", step)
    return push_s


def sample(engine_pid: int, daemon_pid: int | None, cuda: bool) -> dict[str, Any]:
    procs = gpu_processes(cuda)
    count, size = shm()
    return {"trainer_allocated": torch.cuda.memory_allocated() if cuda else None,
            "trainer_reserved": torch.cuda.memory_reserved() if cuda else None,
            "trainer_device": procs.get(os.getpid()), "engine_device": procs.get(engine_pid),
            "device_used": device_used(cuda), "shm_segments": count, "shm_bytes": size,
            "trainer_fds": fds(os.getpid()), "engine_fds": fds(engine_pid),
            "daemon_fds": fds(daemon_pid) if daemon_pid else None}


def growth(first: dict[str, Any], last: dict[str, Any], key: str) -> int | None:
    a, b = first.get(key), last.get(key)
    return None if a is None or b is None else int(b) - int(a)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="colocd-faults-gpu-"))
    node = Node(args, workdir)
    shapes = hf_shapes(args.model)
    device = "cuda" if args.cuda else "cpu"
    gen = torch.Generator(device=device).manual_seed(0)
    named = [(n, torch.randn(s, generator=gen, device=device, dtype=torch.bfloat16)) for n, s in shapes]
    names = [n for n, _ in named]
    record: dict[str, Any] = {"model": args.model, "kv_gib": args.kv_gib, "steps": args.steps,
                              "weight_bytes": sum(t.numel() * t.element_size() for _, t in named),
                              "gpu": torch.cuda.get_device_name(0) if args.cuda else "cpu",
                              "torch": torch.__version__, "checks": {}}
    checks: dict[str, bool] = record["checks"]

    # -- 1. leak watch -------------------------------------------------------------------------------------------
    first = node.daemon()
    await first.__aenter__()
    killed = False
    try:
        client = AsyncColocdClient(first.url)
        await ready(client)
        launched = (await client.status())["engines"]["ref0"]["launched"]
        engine_pid, engine_url = int(launched["pid"]), str(launched["url"])
        samples, pushes, verified = [], [], []
        for step in range(1, args.steps + 1):
            expected = perturb(named, step)
            pushes.append(await full_step(client, step, named))
            verified.append(await engine_holds(engine_url, names, expected))
            samples.append(sample(engine_pid, first.pid, args.cuda))
            print(json.dumps({"step": step, "push_s": round(pushes[-1], 3), **samples[-1]}), flush=True)
        base, last = samples[0], samples[-1]
        record["leak_watch"] = {"samples": samples, "push_s": pushes,
                                "growth": {k: growth(base, last, k) for k in base}}
        slack = args.slack_mib * MIB
        g = record["leak_watch"]["growth"]
        checks["leak_watch_verified"] = all(verified)
        checks["leak_watch_memory_flat"] = all((g[k] or 0) <= slack for k in (
            "trainer_allocated", "trainer_reserved", "trainer_device", "engine_device", "device_used"))
        checks["leak_watch_shm_flat"] = (g["shm_segments"] or 0) <= 0
        checks["leak_watch_fds_flat"] = all((g[k] or 0) <= args.fd_slack
                                            for k in ("trainer_fds", "engine_fds", "daemon_fds"))
        one_engine_used = last["device_used"]

        # -- 2. daemon SIGKILL mid-push ---------------------------------------------------------------------------
        step = args.steps + 1
        expected = perturb(named, step)
        await client.phase("train", step)
        await client.phase("sync", step)
        session = (await client.open_session(f"v{step}", step=step, ranks=1))["session_id"]
        await WeightPusher(client).stream(session, named[: len(named) // 2])
        before_kill = sample(engine_pid, first.pid, args.cuda)
        assert first.pid is not None and first.process is not None
        os.kill(first.pid, signal.SIGKILL)
        await first.process.wait_exit()
        killed = True
        await client.aclose()
        record["daemon_kill"] = {"engine_pid": engine_pid, "engine_alive_after_kill": alive(engine_pid),
                                 "before_kill": before_kill}
    finally:
        if not killed:
            await first.__aexit__(None, None, None)

    second = node.daemon()
    t0 = time.perf_counter()
    async with second:
        client = AsyncColocdClient(second.url)
        try:
            await ready(client)
            kill = record["daemon_kill"]
            kill["ready_after_restart_s"] = round(time.perf_counter() - t0, 3)
            status = await client.status()
            launched = status["engines"]["ref0"]["launched"]
            kill["status_after_restart"] = {"launched": launched,
                                            "startup": status["reconcile"]["startup"]["engines"]["ref0"],
                                            "weights": status["engines"]["ref0"]["weights"]}
            listed = gpu_processes(args.cuda)
            on_gpu = sorted(set(listed) - {os.getpid()})
            kill["engines_on_gpu_after_restart"] = on_gpu if listed else "nvidia-smi lists no processes here"
            kill["reference_engine_processes"] = reference_engines(str(node.workdir))
            checks["adopted_same_engine"] = bool(launched["adopted"]) and int(launched["pid"]) == engine_pid
            checks["one_engine_process"] = kill["reference_engine_processes"] == [engine_pid]
            if listed:  # in a container without the host's pid namespace nvidia-smi may list none
                checks["one_engine_on_gpu"] = on_gpu == [engine_pid]
            # The step the kill interrupted is finished on the restarted daemon: its push commits and verifies.
            t1 = time.perf_counter()
            await WeightPusher(client).push(named, version=f"v{step}", step=step)
            kill["push_after_restart_s"] = round(time.perf_counter() - t1, 3)
            await client.phase("rollout", step)
            checks["push_after_restart_verified"] = await engine_holds(engine_url, names, expected)
            expected = perturb(named, step + 1)
            await full_step(client, step + 1, named)
            checks["next_step_verified"] = await engine_holds(engine_url, names, expected)
            after = sample(engine_pid, second.pid, args.cuda)
            kill["after"] = after
            if args.cuda:
                kill["device_used_vs_leak_watch"] = after["device_used"] - one_engine_used
                checks["device_memory_one_engine"] = abs(after["device_used"] - one_engine_used) <= \
                    args.slack_mib * MIB
        finally:
            await client.aclose()
    record["ok"] = all(checks.values())
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.faults_gpu", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="qwen3-8b", help="checkpoint shapes (benchmarks/sink.py)")
    parser.add_argument("--kv-gib", type=float, default=40.0, help="the engine's KV block")
    parser.add_argument("--steps", type=int, default=20, help="leak-watch steps")
    parser.add_argument("--slack-mib", type=int, default=256, help="memory growth still counted as flat")
    parser.add_argument("--fd-slack", type=int, default=4, help="fd growth still counted as flat")
    parser.add_argument("--out", default=None, help="write the JSON record here too")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a smoke run of the same sequence (no device memory to read)")
    args = parser.parse_args(argv)
    args.cuda = args.device == "cuda"
    if args.cuda and not torch.cuda.is_available():
        print("faults_gpu: --device cuda needs CUDA", file=sys.stderr)
        return 2
    record = asyncio.run(run(args))
    summary = {k: v for k, v in record.items() if k != "leak_watch"}
    summary["leak_watch_growth"] = record.get("leak_watch", {}).get("growth")
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2))
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
