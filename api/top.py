"""``colocd top``: a live view of one daemon (node, engines, the last steps' breakdown, GPU memory).

Reads only public routes (``/v1/status``, ``/v1/steps``, ``/metrics``), so it works against any
daemon it can reach and changes nothing. ``--once`` prints a single frame (scripts, tests).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Snapshot", "add_top_command", "fetch_snapshot", "render"]

_PARTS = ("sleep", "load_weights_memory", "update", "wake", "cleanup", "groups")
_PART_SHORT = {"sleep": "sleep", "load_weights_memory": "w-mem", "update": "update", "wake": "wake",
               "cleanup": "cleanup", "groups": "groups"}


@dataclass
class Snapshot:
    """What one frame shows; ``gpus`` maps a GPU to its NVML kinds (used/free/total), empty without NVML."""

    url: str
    status: dict[str, Any]
    steps: list[dict[str, Any]]
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)
    nvml: bool = False
    restarts: dict[str, float] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.time)


_GPU_MEMORY = {f"colocd_gpu_memory_{kind}_bytes": kind for kind in ("used", "free", "total")}


def _parse_metrics(text: str) -> tuple[dict[str, dict[str, float]], bool, dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    gpus: dict[str, dict[str, float]] = {}
    nvml = False
    restarts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (kind := _GPU_MEMORY.get(sample.name)) is not None:
                gpus.setdefault(sample.labels["gpu"], {})[kind] = sample.value
            elif sample.name == "colocd_nvml_available":
                nvml = sample.value == 1
            elif sample.name == "colocd_engine_restarts_total":
                restarts[sample.labels.get("engine", "?")] = sample.value
    return gpus, nvml, restarts


def fetch_snapshot(client: Any, url: str, limit: int = 8) -> Snapshot:
    """One read of the daemon through a sync ``ColocdClient``."""
    status = client.status()
    steps = client.steps(limit)
    gpus, nvml, restarts = _parse_metrics(client.metrics())
    return Snapshot(url=url, status=status, steps=steps, gpus=gpus, nvml=nvml, restarts=restarts)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else (f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s")


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n else "-"


def render(snap: Snapshot) -> Any:
    """A rich renderable of one frame."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    st = snap.status
    node = st.get("node", {})
    policy = st.get("policy") or {}
    busy = st.get("busy_with")
    head = Text.assemble(
        ("colocd ", "bold"), (snap.url, "cyan"), "  ",
        ("phase ", "dim"), (str(node.get("phase")), "bold magenta"),
        ("  step ", "dim"), (str(node.get("step")), "bold"),
        ("  daemon ", "dim"), (str(st.get("lifecycle")), "green" if st.get("lifecycle") == "running" else "red"),
        ("  busy ", "dim"), (busy or "idle", "yellow" if busy else "dim"),
        ("  policy ", "dim"), (f"{policy.get('process_groups', '?')}/{policy.get('pipeline', '?')}/"
                               f"{policy.get('cleanup', '?')} v{policy.get('version', '?')}", ""),
        ("  ", ""), (time.strftime("%H:%M:%S", time.localtime(snap.taken_at)), "dim"),
    )

    engines = Table(title="engines", title_justify="left", expand=True, show_edge=False)
    for col in ("engine", "healthy", "generation", "memory tags", "weights", "version", "protocol", "restarts",
                "last error"):
        engines.add_column(col, overflow="fold")
    for name, e in sorted((st.get("engines") or {}).items()):
        tags = " ".join(f"{t}:{'R' if v == 'resident' else '-'}" for t, v in sorted((e.get("tags") or {}).items()))
        healthy = e.get("healthy")
        engines.add_row(name, Text("yes" if healthy else "NO", style="green" if healthy else "bold red"),
                        str(e.get("generation")), tags, str(e.get("weights")), str(e.get("weight_version")),
                        str(e.get("protocol")), f"{snap.restarts.get(name, 0):.0f}",
                        Text(str(e.get("last_error") or ""), style="red"))

    steps = Table(title="last steps (switch breakdown; w-mem = weights memory back at sync)", title_justify="left",
                  expand=True, show_edge=False)
    for col in ("step", "result", *(_PART_SHORT[p] for p in _PARTS), "switch", "bytes", "chunks"):
        steps.add_column(col, justify="right" if col not in ("result",) else "left")
    for s in snap.steps:
        b = s.get("breakdown") or {}
        result = s.get("result", "?")
        style = {"ok": "green", "failed": "bold red"}.get(result, "yellow")
        steps.add_row(str(s.get("step")), Text(result, style=style),
                      *(_ms(b.get(p)) for p in _PARTS), Text(_ms(s.get("switch_s")), style="bold"),
                      _mib(s.get("bytes", 0)), str(s.get("chunks", 0)))
    if not snap.steps:
        steps.add_row("-", "no steps yet", *([""] * (len(_PARTS) + 3)))

    if snap.gpus:
        gpus = Table(title="GPU memory (NVML)", title_justify="left", expand=True, show_edge=False)
        for col in ("gpu", "used", "free", "total", ""):
            gpus.add_column(col)
        for gpu, kinds in sorted(snap.gpus.items()):
            used, total = kinds.get("used", 0.0), kinds.get("total", 0.0)
            width = 30
            filled = int(width * used / total) if total else 0
            gpus.add_row(gpu, _gib(used), _gib(kinds.get("free", 0.0)), _gib(total),
                         Text("█" * filled + "░" * (width - filled), style="magenta"))
        memory: Any = gpus
    else:
        memory = Text("GPU memory: NVML not available on this node (no GPU readings; nothing is estimated)",
                      style="dim")
    return Panel(Group(head, Text(""), engines, Text(""), steps, Text(""), memory), title="colocd top",
                 border_style="blue")


def _top_command(args: argparse.Namespace) -> int:
    import httpx
    from rich.console import Console
    from rich.live import Live

    from .client import ColocdClient, ColocdHTTPError

    console = Console(width=args.width) if args.width else Console()
    try:
        with ColocdClient(args.url, token=args.token, timeout_s=10) as client:
            if args.once:
                console.print(render(fetch_snapshot(client, args.url, args.steps)))
                return 0
            with Live(render(fetch_snapshot(client, args.url, args.steps)), console=console,
                      refresh_per_second=4, screen=False) as live:
                while True:
                    time.sleep(args.interval)  # the refresh cadence of a foreground view
                    live.update(render(fetch_snapshot(client, args.url, args.steps)))
    except KeyboardInterrupt:
        return 0
    except ColocdHTTPError as exc:
        print(f"colocd: {exc}", file=sys.stderr)
        return 1
    except (OSError, httpx.TransportError) as exc:
        print(f"colocd: cannot reach the daemon at {args.url}: {exc}", file=sys.stderr)
        return 1


def add_top_command(sub: Any) -> None:
    """``colocd top [--once]`` on the CLI's subparsers."""
    p = sub.add_parser("top", help="live view: node, engines, last steps' breakdown, GPU memory")
    p.add_argument("--url", default="http://127.0.0.1:7000", help="http://host:port or unix:/path")
    p.add_argument("--token", default=None)
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--steps", type=int, default=8, help="how many recent steps to show")
    p.add_argument("--width", type=int, default=None, help="console width (default: the terminal's)")
    p.set_defaults(func=_top_command)
