"""``python3 -m benchmarks.control``: what reads cost the daemon, and what readers cost the trainer's transitions.

    python3 -m benchmarks.control --out benchmarks/results/control-cpu.json           # the recorded run
    python3 -m benchmarks.control --cycles 2 --samples 20 --readers 4            # a smoke run (seconds)

Three processes on one machine, all real: a reference engine, a ``colocd serve`` daemon, and this
one (the trainer), plus a fourth for the readers so their client-side work never delays this
process's clock. Measured in one run:

1. **Read cost**: ``/healthz``, ``/v1/status`` and ``/metrics`` requested one after another,
   interleaved (so machine noise falls on all three alike), on an idle daemon that has already run
   ``--warmup-cycles`` train → sync → rollout cycles (so ``/metrics`` carries its histograms).
   Targets: ``/v1/status`` at most 1.5x and ``/metrics`` at most 3x the median of ``/healthz``.
2. **Transitions under readers**: ``--cycles`` cycles timed with no readers and as many with
   ``--readers`` concurrent clients reading ``/v1/status`` and ``/metrics`` back to back, in
   ``--blocks`` alternating blocks (the readers are held idle, not disconnected, between). Target:
   transition p99 with readers at most 2x without.

The policy releases only ``kv_cache`` on train, so rollout needs no weight push and a cycle times
the control path alone (pause, flush, release, resume, continue).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from colocd.api.procs import DaemonProcess
from colocd.engines.config import ReferenceEngineConfig
from colocd.engines.reference.launcher import ReferenceEngineProcess

from . import CHECKOUT, ShowDefaults
from .records import write_record

__all__ = ["ControlBenchSettings", "main", "run_control_bench"]

READ_PATHS = ("/healthz", "/v1/status", "/metrics")
TARGETS = {"status_x_healthz": 1.5, "metrics_x_healthz": 3.0, "transition_p99_x_idle": 2.0}
_POLICY = "apiVersion: colocd/v1\nengines:\n  release_tags: [kv_cache]\n"


@dataclass(frozen=True, slots=True)
class ControlBenchSettings:
    """How much to measure; the defaults are the recorded run, a smoke run shrinks every count."""

    samples: int = 500  # sequential requests per read path
    warmup_cycles: int = 5  # train → sync → rollout cycles before anything is timed
    cycles: int = 40  # timed cycles per condition (3 transitions each)
    readers: int = 100  # concurrent reading clients in the second condition
    blocks: int = 4  # the cycles of each condition are run in this many alternating blocks
    out: str | None = None


def _pct(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; values in seconds, returned in milliseconds."""
    ordered = sorted(values)
    return 1e3 * ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def _summary(values: list[float]) -> dict[str, float | int]:
    return {"n": len(values), "p50_ms": _pct(values, 0.5), "p90_ms": _pct(values, 0.9),
            "p99_ms": _pct(values, 0.99), "mean_ms": 1e3 * statistics.fmean(values)}


def _cpu_s(pid: int) -> float:
    """CPU seconds the process has run so far, all its threads (the /metrics render thread included).

    Per-thread schedstat has nanosecond resolution; /proc/<pid>/stat's clock ticks are the fallback.
    """
    try:
        total = 0
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
        return total / 1e9
    except (OSError, ValueError, IndexError):
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _read_costs(http: httpx.AsyncClient, pid: int, samples: int, block: int = 50) -> dict[str, Any]:
    """Latency of each read path and the daemon's own CPU per request, in rotating blocks of ``block``.

    CPU per request is the cost the target is about: on a shared machine a round trip mostly measures
    how long the daemon waited for a core, which falls on every path alike.
    """
    times: dict[str, list[float]] = {p: [] for p in READ_PATHS}
    cpu: dict[str, float] = dict.fromkeys(READ_PATHS, 0.0)
    sizes: dict[str, int] = {}
    for path in READ_PATHS:  # warm connections and caches
        for _ in range(10):
            sizes[path] = len((await http.get(path)).raise_for_status().content)
    rounds = max(1, samples // block)
    for _ in range(rounds):
        for path in READ_PATHS:
            c0 = _cpu_s(pid)
            for _ in range(block):
                t0 = time.perf_counter()
                response = await http.get(path)
                times[path].append(time.perf_counter() - t0)
                response.raise_for_status()
            cpu[path] += _cpu_s(pid) - c0
    n = rounds * block
    return {p: {**_summary(times[p]), "bytes": sizes[p], "daemon_cpu_us": 1e6 * cpu[p] / n} for p in READ_PATHS}


async def _cycles(http: httpx.AsyncClient, first_step: int, cycles: int) -> tuple[list[float], list[float]]:
    """Client-observed and daemon-reported seconds of each transition."""
    observed, reported = [], []
    for step in range(first_step, first_step + cycles):
        for phase in ("train", "sync", "rollout"):
            t0 = time.perf_counter()
            response = await http.post("/v1/phase", json={"phase": phase, "step": step})
            observed.append(time.perf_counter() - t0)
            if response.status_code != 200:
                raise RuntimeError(f"{phase}@{step}: HTTP {response.status_code}: {response.text[:300]}")
            reported.append(float(response.json()["duration_s"]))
    return observed, reported


class _Readers:
    """A child process with ``count`` concurrent readers, switched on and off between blocks (stdin lines)."""

    def __init__(self, url: str, count: int) -> None:
        self.url, self.count = url, count
        self._proc: asyncio.subprocess.Process | None = None

    async def __aenter__(self) -> _Readers:
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "benchmarks.control", "--readers-child", self.url, str(self.count),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, cwd=CHECKOUT)
        await self._expect("held")  # every reader connected and answered once, now idle
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.kill()
            await self._proc.wait()

    async def _expect(self, word: str) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        line = await asyncio.wait_for(self._proc.stdout.readline(), 300)
        if line.strip() != word.encode():
            raise RuntimeError(f"reader process: expected {word!r}, got {line!r}")

    async def _say(self, word: str, ack: str) -> None:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.write(f"{word}\n".encode())
        await self._proc.stdin.drain()
        await self._expect(ack)

    async def go(self) -> None:
        await self._say("go", "going")

    async def hold(self) -> None:
        """Returns once no read is in flight: the next block runs on an idle daemon."""
        await self._say("hold", "held")

    def cpu_s(self) -> float:
        assert self._proc is not None
        return _cpu_s(self._proc.pid)

    async def stop(self) -> dict[str, Any]:
        assert self._proc is not None and self._proc.stdin is not None
        self._proc.stdin.close()
        out, _ = await asyncio.wait_for(self._proc.communicate(), 120)
        return json.loads(out.decode().strip().splitlines()[-1])  # type: ignore[no-any-return]


async def _reader_child(url: str, count: int) -> None:
    """Runs in the reader process: ``count`` clients, half on /v1/status, half on /metrics, back to back
    while switched on ("go"), idle after "hold" (acknowledged once no read is in flight), done at EOF."""
    going, stopped, idle = asyncio.Event(), False, asyncio.Event()
    times: dict[str, list[float]] = {"/v1/status": [], "/metrics": []}
    errors, in_flight, answered = 0, 0, 0
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=count)
    async with httpx.AsyncClient(base_url=url, trust_env=False, limits=limits, timeout=300) as http:

        async def reader(path: str) -> None:
            nonlocal errors, in_flight, answered
            first = True
            while True:
                await going.wait()
                if stopped:
                    return
                in_flight += 1
                idle.clear()
                t0 = time.perf_counter()
                try:
                    (await http.get(path)).raise_for_status()
                    if not first:  # the first read of each connection includes connecting
                        times[path].append(time.perf_counter() - t0)
                    answered += first
                    first = False
                except httpx.HTTPError:
                    errors += 1
                finally:
                    in_flight -= 1
                    if in_flight == 0:
                        idle.set()

        async def hold() -> None:
            going.clear()
            if in_flight:
                await idle.wait()
            print("held", flush=True)

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(reader("/v1/status" if i % 2 == 0 else "/metrics")) for i in range(count)]
        going.set()
        while answered < count:  # noqa: ASYNC110 - until every reader got its first answer
            await asyncio.sleep(0.01)
        await hold()
        on_s, since = 0.0, 0.0
        while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
            if line == "go":
                since = time.perf_counter()
                going.set()
                print("going", flush=True)
            elif line == "hold":
                await hold()
                on_s += time.perf_counter() - since
        stopped = True
        going.set()
        await asyncio.gather(*tasks)
    report = {p: _summary(v) for p, v in times.items() if v}
    reads = sum(len(v) for v in times.values())
    print(json.dumps({"readers": count, "reading_s": on_s, "reads_per_s": reads / on_s if on_s else None,
                      "errors": errors, "paths": report}), flush=True)


def _table(record: dict[str, Any]) -> str:
    reads, trans, ratios, lat = record["reads"], record["transitions"], record["ratios"], record["latency_ratios"]
    lines = [f"{'read (sequential, rotating blocks)':<36}{'p50 ms':>8}{'p90 ms':>8}{'bytes':>7}{'CPU us':>8}"
             f"{'x healthz':>10}{'target':>8}{'p50 x':>7}"]
    for path, key, lkey in (("/healthz", None, None), ("/v1/status", "status_x_healthz", "status_p50_x_healthz"),
                            ("/metrics", "metrics_x_healthz", "metrics_p50_x_healthz")):
        r = reads[path]
        ratio = f"{ratios[key]:.2f}" if key else "1.00"
        target = f"<= {TARGETS[key]:g}" if key else ""
        lratio = f"{lat[lkey]:.2f}" if lkey else "1.00"
        lines.append(f"{path:<36}{r['p50_ms']:>8.2f}{r['p90_ms']:>8.2f}{r['bytes']:>7}{r['daemon_cpu_us']:>8.0f}"
                     f"{ratio:>10}{target:>8}{lratio:>7}")
    cpu = trans["daemon_cpu_ms_per_transition"]
    lines.append(f"{'transitions (train/sync/rollout)':<36}{'p50 ms':>8}{'p99 ms':>8}{'n':>7}{'CPU ms':>8}"
                 f"{'x idle':>10}{'target':>8}")
    idle, loaded = trans["idle"], trans["with_readers"]
    lines.append(f"{'no readers':<36}{idle['p50_ms']:>8.1f}{idle['p99_ms']:>8.1f}{idle['n']:>7}{cpu['idle']:>8.1f}"
                 f"{'1.00':>10}")
    label = f"{record['settings']['readers']} concurrent readers"
    lines.append(f"{label:<36}{loaded['p50_ms']:>8.1f}{loaded['p99_ms']:>8.1f}{loaded['n']:>7}"
                 f"{cpu['with_readers']:>8.1f}{ratios['transition_p99_x_idle']:>10.2f}{'<= 2':>8}")
    rd = record["readers"]
    per_path = ", ".join(f"{p} p50 {s['p50_ms']:.1f} / p99 {s['p99_ms']:.1f} ms" for p, s in rd["paths"].items())
    lines.append(f"readers meanwhile: {rd['reads_per_s'] or 0:.0f} reads/s, {per_path}, {rd['errors']} errors")
    cores = trans["cores_used_with_readers"]
    lines.append(f"cores busy while readers ran: daemon {cores['daemon']:.2f}, "
                 f"reader process {cores['reader_process']:.2f} (of {record['machine']['cpus']})")
    lines.append("CPU us / CPU ms: the daemon process's own CPU per request / per transition (all threads); "
                 "'x healthz' compares CPU, 'p50 x' round trips")
    return "\n".join(lines)


async def run_control_bench(settings: ControlBenchSettings) -> dict[str, Any]:
    """Run both measurements; print the table; return (and write to ``settings.out``) the JSON record."""
    workdir = tempfile.mkdtemp(prefix="colocd-bench-control-")
    policy = Path(workdir) / "policies.yaml"
    policy.write_text(_POLICY)
    engine_cfg = ReferenceEngineConfig.model_validate({
        "name": "ref0", "url": "http://127.0.0.1:0",
        "launch": {"ready_timeout_s": 300, "log_file": f"{workdir}/engine.log"}})
    print(f"benchmarks.control: reference engine + daemon on {platform.node()} ({os.cpu_count()} CPUs)", flush=True)
    async with ReferenceEngineProcess(engine_cfg) as engine:
        assert engine.url is not None
        daemon_cfg = {"engines": [{"kind": "reference", "name": "ref0", "url": engine.url}],
                      "policy_file": str(policy), "timeouts": {"default_s": 120}}
        async with (DaemonProcess(daemon_cfg, workdir=workdir) as daemon,
                    httpx.AsyncClient(base_url=daemon.url, trust_env=False, timeout=120) as http):
            async with asyncio.timeout(120):
                while (await http.get("/readyz")).status_code != 200:  # noqa: ASYNC110 - readiness poll
                    await asyncio.sleep(0.05)
            await _cycles(http, 1, settings.warmup_cycles)
            step = 1 + settings.warmup_cycles
            assert daemon.pid is not None
            reads = await _read_costs(http, daemon.pid, settings.samples)
            print("  read costs measured", flush=True)
            # Blocks without and with readers alternate, so load from the rest of the machine that
            # drifts over the run falls on both conditions alike.
            idle_obs: list[float] = []
            idle_rep: list[float] = []
            loaded_obs: list[float] = []
            loaded_rep: list[float] = []
            per_block = max(1, settings.cycles // settings.blocks)
            daemon_cpu = {"idle": 0.0, "with_readers": 0.0}
            reader_cpu_s = loaded_wall_s = 0.0
            async with _Readers(daemon.url, settings.readers) as readers:
                for _ in range(settings.blocks):
                    c0 = _cpu_s(daemon.pid)
                    obs, rep = await _cycles(http, step, per_block)
                    c1 = _cpu_s(daemon.pid)
                    idle_obs += obs
                    idle_rep += rep
                    await readers.go()
                    c2, r2, w2 = _cpu_s(daemon.pid), readers.cpu_s(), time.perf_counter()
                    obs, rep = await _cycles(http, step + per_block, per_block)
                    c3, r3, w3 = _cpu_s(daemon.pid), readers.cpu_s(), time.perf_counter()
                    await readers.hold()
                    reader_cpu_s += r3 - r2
                    loaded_wall_s += w3 - w2
                    daemon_cpu["idle"] += c1 - c0
                    daemon_cpu["with_readers"] += c3 - c2
                    loaded_obs += obs
                    loaded_rep += rep
                    step += 2 * per_block
                reader_report = await readers.stop()
            print("  transitions without and with readers measured", flush=True)
    idle, loaded = _summary(idle_obs), _summary(loaded_obs)
    record: dict[str, Any] = {
        "command": " ".join(["python3 -m benchmarks.control", *sys.argv[1:]]),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "settings": asdict(settings),
        "reads": reads,
        "transitions": {"idle": idle, "with_readers": loaded,
                        "daemon_reported": {"idle": _summary(idle_rep), "with_readers": _summary(loaded_rep)},
                        # daemon CPU per transition, readers' requests included in the second
                        "daemon_cpu_ms_per_transition": {k: 1e3 * v / len(idle_obs) for k, v in daemon_cpu.items()},
                        # cores busy while readers ran: the daemon's share and the reader process's own
                        "cores_used_with_readers": {"daemon": daemon_cpu["with_readers"] / loaded_wall_s,
                                                    "reader_process": reader_cpu_s / loaded_wall_s}},
        "readers": reader_report,
        "ratios": {
            "status_x_healthz": reads["/v1/status"]["daemon_cpu_us"] / reads["/healthz"]["daemon_cpu_us"],
            "metrics_x_healthz": reads["/metrics"]["daemon_cpu_us"] / reads["/healthz"]["daemon_cpu_us"],
            "transition_p99_x_idle": loaded["p99_ms"] / idle["p99_ms"],
        },
        "targets": TARGETS,
        "date": time.strftime("%Y-%m-%d"),
    }
    record["met"] = {k: record["ratios"][k] <= v for k, v in TARGETS.items()}
    record["latency_ratios"] = {  # round trips, for reference: on a shared machine mostly waiting for a core
        "status_p50_x_healthz": reads["/v1/status"]["p50_ms"] / reads["/healthz"]["p50_ms"],
        "metrics_p50_x_healthz": reads["/metrics"]["p50_ms"] / reads["/healthz"]["p50_ms"],
        "transition_p50_x_idle": loaded["p50_ms"] / idle["p50_ms"],
    }
    print(_table(record), flush=True)
    if settings.out:
        write_record(Path(settings.out), record)
    return record



def main(argv: Sequence[str] | None = None) -> int:
    """``python3 -m benchmarks.control``: prints the tables and writes the record where ``--out`` says."""
    p = argparse.ArgumentParser(prog="python3 -m benchmarks.control", description=__doc__.split("\n")[0],
                                formatter_class=ShowDefaults)
    p.add_argument("--samples", type=int, default=500, help="sequential requests per read path")
    p.add_argument("--warmup-cycles", type=int, default=5, help="untimed train/sync/rollout cycles first")
    p.add_argument("--cycles", type=int, default=40, help="timed cycles per condition (3 transitions each)")
    p.add_argument("--readers", type=int, default=100, help="concurrent readers in the loaded condition")
    p.add_argument("--blocks", type=int, default=4, help="alternating blocks without / with readers")
    p.add_argument("--out", default=None, help="write the JSON record here (default: stdout only)")
    args = p.parse_args(argv)
    settings = ControlBenchSettings(samples=args.samples, warmup_cycles=args.warmup_cycles, cycles=args.cycles,
                                    readers=args.readers, blocks=args.blocks, out=args.out)
    asyncio.run(run_control_bench(settings))
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--readers-child"]:  # the readers' own process (``_Readers``)
        asyncio.run(_reader_child(sys.argv[2], int(sys.argv[3])))
    else:
        sys.exit(main())
