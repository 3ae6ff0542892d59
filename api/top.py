"""``colocd top``'s frame: node, engines, the last steps' breakdown, GPU memory, from the public read routes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..timeline import fmt_bytes
from .client import ColocdClient

if TYPE_CHECKING:
    from ..cli import DaemonCall

__all__ = ["Snapshot", "fetch_snapshot"]

_PARTS = ("sleep", "load_weights_memory", "update", "wake", "cleanup", "groups")
_PART_SHORT = {"load_weights_memory": "w-mem"}


@dataclass
class Snapshot:
    """What one frame shows; ``gpus`` maps a GPU to its NVML kinds (used/free/total), empty without NVML."""

    url: str
    status: dict[str, Any]
    steps: list[dict[str, Any]]
    gpus: dict[str, dict[str, float]] = field(default_factory=dict)
    restarts: dict[str, float] = field(default_factory=dict)
    taken_at: float = field(default_factory=time.time)

    def __rich_console__(self, console: Any, options: Any) -> Any:
        """A rich renderable: it lays itself out for the console's width when printed."""
        yield _layout(self, options.max_width)


_GPU_MEMORY = {f"colocd_gpu_memory_{kind}_bytes": kind for kind in ("used", "free", "total")}


def _parse_metrics(text: str) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    from prometheus_client.parser import text_string_to_metric_families

    gpus: dict[str, dict[str, float]] = {}
    restarts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (kind := _GPU_MEMORY.get(sample.name)) is not None:
                gpus.setdefault(sample.labels["gpu"], {})[kind] = sample.value
            elif sample.name == "colocd_engine_restarts_total":
                restarts[sample.labels.get("engine", "?")] = sample.value
    return gpus, restarts


def fetch_snapshot(call: DaemonCall, limit: int = 8) -> Snapshot:
    """One read of the daemon (three GETs); a failure raises ``CliFailure`` with the CLI's one line."""
    status = call("GET /v1/status", ColocdClient.status)
    steps = call("GET /v1/steps", lambda c: c.steps(limit))
    gpus, restarts = _parse_metrics(call("GET /metrics", ColocdClient.metrics))
    return Snapshot(url=call.url, status=status, steps=steps, gpus=gpus, restarts=restarts)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else (f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s")


@dataclass(frozen=True)
class _Column:
    """One table column: ``keep`` ranks it (lower stays longer when the frame is narrow); ``wrap`` lets its
    text wrap at spaces (prose such as memory tags); every other column keeps its values whole."""

    name: str
    keep: int
    justify: str = "left"
    wrap: bool = False


def _fit_table(title: str, columns: list[_Column], rows: list[list[Any]], width: int) -> Any:
    """A table no wider than ``width``: whole columns are left out (named in the title), lowest ``keep`` last,
    never a value cut."""
    from rich.table import Table

    def need(col: int) -> int:  # the column's narrowest whole width, plus its padding (1 each side)
        texts = [str(getattr(r[col], "plain", r[col])) for r in rows]
        pieces = [w for t in texts for w in (t.split() if columns[col].wrap else t.splitlines())]
        widest = max((len(w) for w in pieces), default=1)
        return max(widest, len(columns[col].name)) + 2

    shown = list(range(len(columns)))
    while len(shown) > 1 and sum(need(c) for c in shown) + len(shown) - 1 > width:
        shown.remove(max(shown, key=lambda c: (columns[c].keep, c)))
    dropped = [columns[c].name for c in range(len(columns)) if c not in shown]
    if dropped:
        title += f" (too narrow for: {', '.join(dropped)})"
    table = Table(title=title, title_justify="left", expand=True, show_edge=False)
    for c in shown:
        col = columns[c]
        table.add_column(col.name, justify=col.justify,  # type: ignore[arg-type]  # the four rich accepts
                         no_wrap=not col.wrap, min_width=None if col.wrap else need(c) - 2)
    for r in rows:
        table.add_row(*(r[c] for c in shown))
    return table


def _header(items: list[Any], width: int) -> Any:
    """The header's items (a label with its value) packed into lines of ``width``, broken only between items."""
    from rich.text import Text

    lines: list[Text] = []
    for item in items:
        if lines and lines[-1].cell_len + 2 + item.cell_len <= width:
            lines[-1].append("  ").append_text(item)
        else:
            lines.append(item.copy())
    return Text("\n").join(lines)


def _layout(snap: Snapshot, width: int) -> Any:
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text

    inner = max(width - 4, 20)  # the panel's border and padding
    st = snap.status
    node = st.get("node", {})
    policy = st.get("policy") or {}
    busy = st.get("busy_with")
    head = _header([
        Text.assemble(("colocd ", "bold"), (snap.url, "cyan")),
        Text.assemble(("phase ", "dim"), (str(node.get("phase")), "bold magenta")),
        Text.assemble(("step ", "dim"), (str(node.get("step")), "bold")),
        Text.assemble(("daemon ", "dim"),
                      (str(st.get("lifecycle")), "green" if st.get("lifecycle") == "running" else "red")),
        Text.assemble(("busy ", "dim"), (busy or "idle", "yellow" if busy else "dim")),
        Text.assemble(("policy ", "dim"), (f"{policy.get('process_groups', '?')}/{policy.get('pipeline', '?')}/"
                                           f"{policy.get('cleanup', '?')} v{policy.get('version', '?')}", "")),
        Text(time.strftime("%H:%M:%S", time.localtime(snap.taken_at)), "dim"),
    ], inner)

    engine_cols = [_Column("engine", 0), _Column("healthy", 0), _Column("generation", 1), _Column("weights", 2),
                   _Column("version", 1), _Column("restarts", 1, "right"), _Column("protocol", 4),
                   _Column("memory tags", 3, wrap=True)]
    engine_rows: list[list[Any]] = []
    errors: list[Any] = []
    for name, e in sorted((st.get("engines") or {}).items()):
        tags = " ".join(f"{t}:{'R' if v == 'resident' else '-'}" for t, v in sorted((e.get("tags") or {}).items()))
        healthy = e.get("healthy")
        engine_rows.append([name, Text("yes" if healthy else "NO", style="green" if healthy else "bold red"),
                            str(e.get("generation")), str(e.get("weights")), str(e.get("weight_version")),
                            f"{snap.restarts.get(name, 0):.0f}", str(e.get("protocol")), tags])
        if e.get("last_error"):  # prose, below the table: it wraps at any width without squeezing the columns
            errors.append(Text.assemble((f"{name} last error: ", "bold red"), (str(e["last_error"]), "red")))
    engines = _fit_table("engines", engine_cols, engine_rows, inner)

    step_cols = [_Column("step", 0, "right"), _Column("result", 0), _Column("switch", 0, "right"),
                 *(_Column(_PART_SHORT.get(p, p), k, "right") for p, k in zip(_PARTS, (2, 3, 1, 2, 4, 4), strict=True)),
                 _Column("bytes", 3, "right"), _Column("chunks", 5, "right")]
    step_rows: list[list[Any]] = []
    for s in snap.steps:
        b = s.get("breakdown") or {}
        result = s.get("result", "?")
        style = {"ok": "green", "failed": "bold red"}.get(result, "yellow")
        size = fmt_bytes(s["bytes"]) if s.get("bytes") else "-"
        step_rows.append([str(s.get("step")), Text(result, style=style), Text(_ms(s.get("switch_s")), style="bold"),
                          *(_ms(b.get(p)) for p in _PARTS), size, str(s.get("chunks", 0))])
    if not snap.steps:
        step_rows.append(["-", "no steps yet", *([""] * (len(step_cols) - 2))])
    steps = _fit_table("last steps (switch and its parts; w-mem = weights memory back at sync)", step_cols,
                       step_rows, inner)

    if snap.gpus:
        bar = max(0, min(30, inner - 44))  # the bar takes what the numbers leave, and goes below 8 columns
        gpus = Table(title="GPU memory (NVML)", title_justify="left", expand=True, show_edge=False)
        for col in ("gpu", "used", "free", "total"):
            gpus.add_column(col, no_wrap=True, justify="left" if col == "gpu" else "right")
        if bar >= 8:
            gpus.add_column("", no_wrap=True)
        for gpu, kinds in sorted(snap.gpus.items()):
            used, free, total = (kinds.get(k, 0.0) for k in ("used", "free", "total"))
            cells: list[Any] = [gpu, fmt_bytes(used), fmt_bytes(free), fmt_bytes(total)]
            if bar >= 8:
                filled = int(bar * used / total) if total else 0
                cells.append(Text("█" * filled + "░" * (bar - filled), style="magenta"))
            gpus.add_row(*cells)
        memory: Any = gpus
    else:
        memory = Text("GPU memory: NVML not available on this node (no GPU readings; nothing is estimated)",
                      style="dim")
    parts: list[Any] = [head, Text(""), engines, *errors, Text(""), steps, Text(""), memory]
    return Panel(Group(*parts), title="colocd top", border_style="blue")
