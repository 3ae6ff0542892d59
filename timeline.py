"""Draw one step's switch so a person sees where the time went (``colocd trace -o``, ``colocd demo --timeline``):
phases, trainer and engine lanes, memory readings; idle stretches squeezed to a labelled band (``colocd[viz]``)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .errors import MatplotlibMissing

__all__ = ["fmt_bytes", "render_timeline"]

_PHASE_ORDER = ("train", "sync", "weights", "rollout", "sleep", "resume", "weight_group")
_PHASE_COLOR = {"train": "#4C72B0", "sync": "#8172B3", "weights": "#DD8452", "rollout": "#55A868",
                "sleep": "#4C72B0", "resume": "#55A868", "weight_group": "#937860"}
_PART_COLOR = {"sleep": "#4C72B0", "load_weights_memory": "#8172B3", "update": "#DD8452", "wake": "#55A868",
               "cleanup": "#C44E52", "groups": "#DA8BC3"}
_SPAN_COLOR = {"pause_generation": "#64B5CD", "flush_cache": "#8C8C8C", "release_memory": "#4C72B0",
               "confirm_memory_freed": "#A1C9F4", "resume_memory": "#55A868", "continue_generation": "#8DE5A1",
               "begin_weight_update": "#FFB482", "end_weight_update": "#FFB482", "set_weight_version": "#D0BBFF",
               "trainer.process_groups": "#DA8BC3"}
_PHASE_PART = {"train": "sleep", "sync": "load_weights_memory", "weights": "update", "rollout": "wake"}


def _fmt_s(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def fmt_bytes(n: float) -> str:
    """Bytes in the largest unit that keeps 1-4 digits: ``15.3 GiB``, not ``15625.0 MiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"


def _duration(trace: Mapping[str, Any]) -> float:
    if trace.get("duration_s") is not None:
        return float(trace["duration_s"])
    return max((s["start_s"] + s["duration_s"] for s in trace.get("spans", [])), default=0.0)


def _breakdown(traces: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Where the switch went, from a ``/v1/traces/{step}`` answer (the same parts as ``GET /v1/steps``)."""
    parts = dict.fromkeys(_PART_COLOR, 0.0)
    for phase, trace in traces.items():
        if (part := _PHASE_PART.get(phase)) is not None:
            parts[part] += _duration(trace)
        for span in trace.get("spans", []):
            if span["name"].startswith("trainer.cleanup"):
                parts["cleanup"] += span["duration_s"]
            elif span["name"] == "trainer.process_groups":
                parts["groups"] += span["duration_s"]
    return parts


class _Squeeze:
    """Maps wall time to drawing x, piecewise linear: busy stretches and short gaps keep their scale,
    a gap longer than a quarter of the busy time becomes a narrow band."""

    def __init__(self, busy: list[tuple[float, float]]) -> None:
        merged: list[list[float]] = []
        for a, b in sorted(busy):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        active = sum(b - a for a, b in merged) or 1e-3
        self.band = 0.08 * active  # drawn width of a squeezed gap
        limit = max(0.25 * active, 1e-3)
        self.pieces: list[tuple[float, float, float, float]] = []  # (real a, real b, drawn a, drawn b)
        self.gaps: list[tuple[float, float, float]] = []  # (drawn a, drawn b, real seconds)
        x = 0.0
        for i, (a, b) in enumerate(merged):
            if i:
                prev = merged[i - 1][1]
                width = self.band if a - prev > limit else a - prev
                if a - prev > limit:
                    self.gaps.append((x, x + width, a - prev))
                self.pieces.append((prev, a, x, x + width))
                x += width
            self.pieces.append((a, b, x, x + b - a))
            x += b - a
        self.end = x

    def __call__(self, t: float) -> float:
        if not self.pieces:
            return t
        if t <= self.pieces[0][0]:
            return self.pieces[0][2] - (self.pieces[0][0] - t)
        for a, b, x0, x1 in self.pieces:
            if a <= t <= b:
                return x0 if b == a else x0 + (x1 - x0) * (t - a) / (b - a)
        a, b, x0, x1 = self.pieces[-1]
        return x1 + (t - b)

    def busy_pieces(self) -> list[tuple[float, float, float]]:
        gap_starts = {g[0] for g in self.gaps}
        return [(a, b, x0) for a, b, x0, _x1 in self.pieces if x0 not in gap_starts or b - a == 0]


def render_timeline(traces: Mapping[str, Mapping[str, Any]], out: str | Path, *, step: int) -> Path:
    """Draw the step's traces (a ``/v1/traces/{step}`` answer) to ``out`` (png, svg or pdf)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise MatplotlibMissing("drawing a timeline needs matplotlib: pip install 'colocd[viz]'") from exc

    ordered = sorted(traces.items(), key=lambda kv: (_PHASE_ORDER.index(kv[0]) if kv[0] in _PHASE_ORDER else 99,
                                                     kv[1]["started_at"]))
    if not ordered:
        raise ValueError("no traces to draw")
    t_origin = min(t["started_at"] + min([0.0, *(s["start_s"] for s in t.get("spans", []))]) for _, t in ordered)

    # Gather bars: (lane, real start, real end, label, colour, ok)
    bars: list[tuple[str, float, float, str, str, bool]] = []
    phase_bars: list[tuple[float, float, str, str]] = []
    chunk_lanes: dict[str, list[tuple[float, float, int]]] = {}
    memory: dict[str, list[tuple[float, int]]] = {}
    engines: list[str] = []
    for phase, trace in ordered:
        t0 = trace["started_at"] - t_origin
        dur = _duration(trace)
        outcome = trace.get("outcome") or "in progress"
        phase_bars.append((t0, t0 + dur, phase, outcome))
        for span in trace.get("spans", []):
            a = t0 + span["start_s"]
            b = a + span["duration_s"]
            lane = span.get("engine") or "node"
            if lane not in engines and lane not in ("trainer", "node"):
                engines.append(lane)
            if span["name"] == "load_chunk":
                chunk_lanes.setdefault(lane, []).append((a, b, int(span.get("attrs", {}).get("nbytes", 0))))
                continue
            colour = _SPAN_COLOR.get(span["name"], "#C44E52" if span["name"].startswith("trainer.cleanup")
                                     else "#B0B0B0")
            bars.append((lane, a, b, span["name"].removeprefix("trainer."), colour, bool(span.get("ok", True))))
        for m in trace.get("memory", []):
            memory.setdefault(m["source"], []).append((t0 + m["t_s"], int(m["value_bytes"])))
    train = next((p for p in phase_bars if p[2] == "train"), None)
    sync = next((p for p in phase_bars if p[2] == "sync"), None)
    training: tuple[float, float] | None = None
    if train and sync:
        trainer_work = [a for lane, a, _b, _n, _c, _ok in bars if lane == "trainer"]
        training = (train[1], min([sync[0], *trainer_work]))

    squeeze = _Squeeze([(a, b) for a, b, _p, _o in phase_bars]
                       + [(a, b) for lane, a, b, *_ in bars if lane == "trainer"])
    lanes = ["phases", *(["trainer"] if training or any(b[0] == "trainer" for b in bars) else []),
             *(["node"] if any(b[0] == "node" for b in bars) else [])]
    for engine in engines:
        lanes.append(engine)
        if engine in chunk_lanes:
            lanes.append(f"{engine} chunks")
    y_of = {lane: len(lanes) - 1 - i for i, lane in enumerate(lanes)}

    has_memory = bool(memory)
    fig_h = 2.2 + 0.55 * len(lanes) + (2.0 if has_memory else 0.6)
    fig = plt.figure(figsize=(13, fig_h), dpi=110)
    grid = fig.add_gridspec(3, 1, height_ratios=[0.9, 0.55 * len(lanes) + 0.6, 2.0 if has_memory else 0.45],
                            hspace=0.45)
    ax_break, ax, ax_mem = fig.add_subplot(grid[0]), fig.add_subplot(grid[1]), fig.add_subplot(grid[2])

    # 1. Where the switch went: one stacked bar, the headline.
    parts = _breakdown(traces)
    total = sum(parts.values())
    left = 0.0
    for part, seconds in parts.items():
        if seconds <= 0:
            continue
        ax_break.barh(0, seconds, left=left, color=_PART_COLOR[part], edgecolor="white")
        if total and seconds / total > 0.12:
            ax_break.text(left + seconds / 2, 0, f"{part}\n{_fmt_s(seconds)} ({100 * seconds / total:.0f}%)",
                          ha="center", va="center", fontsize=8, color="white", fontweight="bold")
        left += seconds
    ax_break.set_xlim(0, max(total, 1e-6))
    ax_break.set_yticks([])
    ax_break.set_xlabel("seconds of switch (training excluded)", fontsize=8)
    ax_break.tick_params(labelsize=8)
    ax_break.legend(handles=[Patch(color=_PART_COLOR[p], label=f"{p} {_fmt_s(s)}") for p, s in parts.items() if s > 0],
                    loc="upper center", bbox_to_anchor=(0.5, -0.55), ncol=6, fontsize=7, frameon=False)
    weights = traces.get("weights", {})
    nbytes = int(weights.get("attrs", {}).get("bytes", 0))
    outcomes = [t.get("outcome") for _, t in ordered]
    suffix = ("  [FAILED]" if any(o in ("failed", "aborted") for o in outcomes)
              else "  [in progress]" if None in outcomes else "")
    headline = (f"step {step}: switch {_fmt_s(total)}" + (f", {fmt_bytes(nbytes)} of weights" if nbytes else "")
                + suffix)
    ax_break.set_title(headline, fontsize=12, fontweight="bold", loc="left")

    # 2. The lanes.
    def draw(lane: str, a: float, b: float, colour: str, label: str, *, height: float = 0.7, ok: bool = True,
             hatch: str | None = None, text_colour: str = "black") -> None:
        x0, x1 = squeeze(a), squeeze(b)
        ax.barh(y_of[lane], max(x1 - x0, squeeze.end * 0.002), left=x0, height=height, color=colour,
                edgecolor="#C00000" if not ok else "white", linewidth=2 if not ok else 0.5, hatch=hatch)
        if label and (x1 - x0) > squeeze.end * 0.06:
            ax.text((x0 + x1) / 2, y_of[lane], label, ha="center", va="center", fontsize=7, color=text_colour,
                    clip_on=True)

    for a, b, phase, outcome in phase_bars:
        ok = outcome in ("ok", "committed", "in progress")
        draw("phases", a, b, _PHASE_COLOR.get(phase, "#999999"), f"{phase} {_fmt_s(b - a)}", ok=ok,
             text_colour="white")
    if training:
        draw("trainer", training[0], training[1], "#EEEEEE", f"training {_fmt_s(training[1] - training[0])}",
             hatch="//")
    for lane, a, b, name, colour, ok in bars:
        draw(lane, a, b, colour, f"{name.replace('_', ' ')} {_fmt_s(b - a)}" + ("" if ok else " ✗"), ok=ok)
    for engine, chunks in chunk_lanes.items():
        lane = f"{engine} chunks"
        for i, (a, b, _n) in enumerate(sorted(chunks)):
            draw(lane, a, b, "#DD8452" if i % 2 == 0 else "#F2B880", "", height=0.5)
        span_s = max(b for _a, b, _n in chunks) - min(a for a, _b, _n in chunks)
        moved = sum(n for *_x, n in chunks)
        rate = f", {fmt_bytes(moved / span_s)}/s" if span_s > 0 else ""
        ax.text(squeeze(min(a for a, _b, _n in chunks)), y_of[lane] + 0.42,
                f"{len(chunks)} chunks, {fmt_bytes(moved)}{rate}", fontsize=7, va="bottom")
    for g0, g1, real in squeeze.gaps:
        ax.axvspan(g0, g1, color="#F4F4F4", zorder=0)
        ax.text((g0 + g1) / 2, len(lanes) - 0.45, f"⋯ {_fmt_s(real)} ⋯", ha="center", va="bottom", fontsize=7,
                color="#666666")
    colours = {name: colour for _lane, _a, _b, name, colour, _ok in bars}  # each sub-step as its bars are drawn
    handles = [Patch(color=colour, label=name) for name, colour in colours.items()]
    if chunk_lanes:
        handles.append(Patch(color="#DD8452", label="load_chunk (alternating shades)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=7, frameon=False,
              title="sub-steps", title_fontsize=7)
    ax.set_yticks(list(y_of.values()), list(y_of.keys()), fontsize=8)
    ax.set_ylim(-0.6, len(lanes) - 0.1)
    ax.set_xlim(0, squeeze.end)
    ticks, labels = _ticks(squeeze)
    ax.set_xticks(ticks, labels, fontsize=7)
    ax.set_xlabel("seconds since the step began (shaded bands: idle time squeezed, real length above)", fontsize=8)
    ax.grid(axis="x", alpha=0.3)

    # 3. Memory where recorded.
    if has_memory:
        for source, samples in sorted(memory.items()):
            samples.sort()
            xs = [squeeze(t) for t, _v in samples]
            ax_mem.plot(xs, [v / 2**20 for _t, v in samples], drawstyle="steps-post", marker="o", markersize=3,
                        label=source)
        ax_mem.set_xlim(0, squeeze.end)
        ax_mem.set_xticks(ticks, labels, fontsize=7)
        ax_mem.set_ylabel("MiB", fontsize=8)
        ax_mem.tick_params(labelsize=7)
        ax_mem.legend(fontsize=7, loc="upper right")
        ax_mem.set_title("memory readings (gpu:N from NVML, engine:NAME from the engine's own accounting)",
                         fontsize=8, loc="left")
        ax_mem.grid(alpha=0.3)
    else:
        ax_mem.axis("off")
        ax_mem.text(0, 0.5, "no memory readings recorded in this step", fontsize=8, color="#666666")
    out = Path(out)
    fig.savefig(out, bbox_inches="tight")
    plt.close(fig)
    return out


def _ticks(squeeze: _Squeeze) -> tuple[list[float], list[str]]:
    """Round-number ticks of real time inside each busy stretch (none inside a squeezed band)."""
    import math

    active = sum(b - a for a, b, _x in squeeze.busy_pieces()) or 1e-3
    raw = active / 7
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 5, 10) if m * magnitude >= raw)
    ticks: list[float] = []
    labels: list[str] = []
    for a, b, _x in squeeze.busy_pieces():
        v = math.ceil(a / step) * step
        while v <= b + 1e-12:
            x = squeeze(v)
            if not ticks or x - ticks[-1] > squeeze.end * 0.045:
                ticks.append(x)
                labels.append(f"{v:.3f}".rstrip("0").rstrip(".") if step < 1 else f"{v:.0f}")
            v += step
    return ticks, labels
