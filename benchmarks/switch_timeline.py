"""Timeline picture (SVG, no plotting library) of one median step per preset from a ``benchmarks.switch`` JSON.

    python3 -m benchmarks.switch_timeline benchmarks/results/switch-qwen3-8b-h200.json \
        docs/img/switch-timeline-qwen3-8b.svg

One row per preset: the step whose switch time is the median of the timed steps, drawn as the
sequence the trainer waits through (resume → sleep → update → wake; the training work between
resume and sleep is left out). Group work the agent overlapped is drawn only where it made the
trainer wait. A last row is the floor measured in the same run.
"""

from __future__ import annotations

import json
import statistics
import sys
from html import escape
from pathlib import Path
from typing import Any

# (part key, label, category) in the order the trainer waits through them.
SEGMENTS = (
    ("resume.train_phase", "engine release + NVML", "engine"),
    ("resume.groups", "group rebuild", "groups"),
    ("resume.groups_wait", "group rebuild (wait)", "groups"),
    ("resume.onload", "state onload", "copy"),
    ("sleep.offload_optimizer", "optimizer offload", "copy"),
    ("sleep.groups", "group destroy", "groups"),
    ("sleep.cleanup", "cleanup", "cleanup"),
    ("sleep.sync_phase", "engine weights back", "engine"),
    ("update", "update_weights", "push"),
    ("wake.offload_weights", "weights offload", "copy"),
    ("wake.cleanup", "cleanup", "cleanup"),
    ("wake.groups_wait", "group destroy (wait)", "groups"),
    ("wake.rollout_phase", "engine KV back", "engine"),
)
COLORS = {"engine": "#4c78a8", "copy": "#f58518", "groups": "#e45756", "cleanup": "#b279a2", "push": "#54a24b",
          "other": "#bab0ac"}
PX_PER_S = 160
ROW, LEFT, TOP = 34, 150, 40


def median_step(steps: list[dict[str, Any]]) -> dict[str, Any]:
    timed = [s for s in steps if not s["warmup"]] or steps
    target = statistics.median_low(s["switch_s"] for s in timed)
    return next(s for s in timed if s["switch_s"] == target)


def segments(step: dict[str, Any]) -> list[tuple[str, str, float]]:
    parts = dict(step["parts"], update=step["update_s"])
    out = [(label, cat, float(parts[key])) for key, label, cat in SEGMENTS if parts.get(key, 0.0) > 0]
    other = step["switch_s"] - sum(d for _, _, d in out)
    if other > 0:
        out.append(("HTTP + client", "other", other))
    return out


def render(record: dict[str, Any]) -> str:
    floor = record["floor"]
    rows: list[tuple[str, list[tuple[str, str, float]]]] = [
        (name, segments(median_step(steps))) for name, steps in record["steps"].items()
    ]
    rows.append(("floor", [
        ("PCIe out", "copy", floor["offload_s"]), ("PCIe in", "copy", floor["onload_s"]),
        ("alloc/release", "engine", floor["alloc_s"]), ("device copy", "push", floor["device_copy_s"]),
    ]))
    width = LEFT + int(PX_PER_S * max(sum(d for *_, d in segs) for _, segs in rows)) + 80
    height = TOP + ROW * len(rows) + 60
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
           f'font-size="11">',
           f'<text x="8" y="18" font-size="13">python3 -m benchmarks.switch: {escape(record["model"])} on '
           f'{escape(str(record["gpu"]))}, median step per preset (seconds)</text>']
    for i, (name, segs) in enumerate(rows):
        y, x = TOP + i * ROW, float(LEFT)
        svg.append(f'<text x="8" y="{y + 17}">{escape(name)}</text>')
        for label, cat, d in segs:
            w = d * PX_PER_S
            svg.append(f'<rect x="{x:.1f}" y="{y}" width="{max(w, 0.5):.1f}" height="24" fill="{COLORS[cat]}">'
                       f'<title>{escape(label)}: {d:.3f} s</title></rect>')
            if w > 60:
                svg.append(f'<text x="{x + 3:.1f}" y="{y + 16}" fill="white">{escape(label)} {d:.2f}</text>')
            x += w
        total = sum(d for *_, d in segs)
        svg.append(f'<text x="{x + 4:.1f}" y="{y + 17}">{total:.2f} s</text>')
    y = TOP + ROW * len(rows) + 10
    for j, (cat, color) in enumerate(COLORS.items()):
        svg.append(f'<rect x="{LEFT + j * 110}" y="{y}" width="12" height="12" fill="{color}"/>'
                   f'<text x="{LEFT + j * 110 + 16}" y="{y + 10}">{cat}</text>')
    svg.append(f'<line x1="{LEFT}" y1="{TOP - 6}" x2="{LEFT + PX_PER_S}" y2="{TOP - 6}" stroke="black"/>'
               f'<text x="{LEFT + PX_PER_S + 4}" y="{TOP - 3}">1 s</text>')
    svg.append("</svg>")
    return "\n".join(svg) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    record = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).parent.mkdir(parents=True, exist_ok=True)
    Path(argv[1]).write_text(render(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
