"""Draw the dashboard's panels with matplotlib from real /metrics scrapes, where Grafana cannot run.

    colocd demo --steps 30 --metrics-out scrapes.jsonl
    python deploy/grafana/render_preview.py scrapes.jsonl -o docs/img/dashboard-preview.png

Not Grafana and not PromQL: each panel's query is reduced to what it plots over one scrape per
step: gauges as read; ``rate``/``increase`` of a counter as its increase per step; a histogram
``_sum / _count`` as the mean of the step's observations; ``histogram_quantile`` from the step's
bucket increases (linear inside a bucket, as Prometheus does). The x axis is the step.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Any

Labels = tuple[tuple[str, str], ...]
Series = dict[str, list[tuple[int, float]]]  # legend → [(step, value)]


def _load_panels() -> list[Any]:
    spec = importlib.util.spec_from_file_location("build_dashboard", Path(__file__).with_name("build_dashboard.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return list(module.PANELS)


def _parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name].append((dict(s.labels), float(s.value)))
    return out


def _matchers(selector: str) -> list[tuple[str, str, str]]:
    return [(k, op, v) for k, op, v in re.findall(r'(\w+)\s*(=~|!=|=)\s*"([^"]*)"', selector) if k != "instance"]


def _match(labels: dict[str, str], matchers: list[tuple[str, str, str]]) -> bool:
    for k, op, v in matchers:
        got = labels.get(k, "")
        if (op == "=" and got != v) or (op == "!=" and got == v) or (op == "=~" and not re.fullmatch(v, got)):
            return False
    return True


def _select(scrape: dict[str, Any], metric: str, matchers: list[tuple[str, str, str]], by: list[str] | None,
            ) -> dict[Labels, float]:
    """Samples of ``metric`` that match, summed by ``by`` (None: every label set kept)."""
    out: dict[Labels, float] = defaultdict(float)
    for labels, value in scrape.get(metric, []):
        if not _match(labels, matchers):
            continue
        keep = labels if by is None else {k: labels.get(k, "") for k in by}
        out[tuple(sorted(keep.items()))] += value
    return out


def _legend(fmt: str, labels: Labels) -> str:
    d = dict(labels)
    text = re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: d.get(m.group(1), ""), fmt).strip()
    return text or ",".join(f"{k}={v}" for k, v in labels if k != "le") or "value"


def _quantile(q: float, buckets: dict[float, float]) -> float | None:
    if not buckets:
        return None
    bounds = sorted(buckets)
    total = buckets[bounds[-1]]
    if total <= 0:
        return None
    rank, prev_b, prev_c = q * total, 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == float("inf"):
                return prev_b
            return prev_b + (b - prev_b) * ((rank - prev_c) / (c - prev_c) if c > prev_c else 0)
        prev_b, prev_c = b, c
    return prev_b


def evaluate(expr: str, legend: str, scrapes: list[dict[str, Any]], steps: list[int]) -> Series:
    """One query over the scrapes, reduced as the module docstring says."""
    series: Series = defaultdict(list)
    metrics = re.findall(r"\b((?:colocd|process)_[a-z0-9_]+)(\{[^}]*\})?", expr)
    if not metrics:
        return series
    by_m = re.search(r"by \(([^)]*)\)", expr)
    by = [x.strip() for x in by_m.group(1).split(",")] if by_m else None
    name, selector = metrics[0]
    matchers = _matchers(selector)
    pairs = list(zip(scrapes, steps, strict=True))
    if "group_left" in expr:  # memory per engine: engine→gpu info joined with the GPU's used bytes
        right, right_sel = metrics[1]
        for scrape, step in pairs:
            used = {dict(k)["gpu"]: v for k, v in _select(scrape, right, _matchers(right_sel), ["gpu"]).items()}
            per_engine: dict[str, float] = defaultdict(float)
            for labels, _v in scrape.get(name, []):
                if labels.get("gpu") in used:
                    per_engine[labels["engine"]] += used[labels["gpu"]]
            for engine, value in per_engine.items():
                series[_legend(legend, (("engine", engine),))].append((step, value))
        return series
    for (prev, _), (cur, step) in itertools.pairwise(pairs):
        if expr.startswith("histogram_quantile"):
            q = float(re.match(r"histogram_quantile\(([0-9.]+)", expr).group(1))  # type: ignore[union-attr]
            group = [b for b in (by or []) if b != "le"]
            now = _select(cur, name, matchers, [*group, "le"])
            before = _select(prev, name, matchers, [*group, "le"])
            per: dict[Labels, dict[float, float]] = defaultdict(dict)
            for key, value in now.items():
                d = dict(key)
                le = float(d.pop("le"))
                per[tuple(sorted(d.items()))][le] = value - before.get(key, 0.0)
            for key, buckets in per.items():
                if (v := _quantile(q, buckets)) is not None:
                    series[_legend(legend, key)].append((step, v))
        elif name.endswith("_sum") and "/" in expr:
            count = name.removesuffix("_sum") + "_count"
            s_now, s_before = _select(cur, name, matchers, by), _select(prev, name, matchers, by)
            c_now, c_before = _select(cur, count, matchers, by), _select(prev, count, matchers, by)
            for key, value in s_now.items():
                n = c_now.get(key, 0.0) - c_before.get(key, 0.0)
                if n > 0:
                    series[_legend(legend, key)].append((step, (value - s_before.get(key, 0.0)) / n))
        elif "rate(" in expr or "increase(" in expr:
            now, before = _select(cur, name, matchers, by), _select(prev, name, matchers, by)
            dt = max(cur.get("__time__", [({}, 1.0)])[0][1] - prev.get("__time__", [({}, 0.0)])[0][1], 1e-9)
            for key, value in now.items():
                delta = value - before.get(key, 0.0)
                series[_legend(legend, key)].append((step, delta / dt if "rate(" in expr else delta))
    if not any(f in expr for f in ("rate(", "increase(", "histogram_quantile")):
        since = expr.startswith("time() - ")  # how long ago a timestamp gauge was set, at each scrape
        for scrape, step in pairs:
            now = scrape.get("__time__", [({}, 0.0)])[0][1]
            for key, value in _select(scrape, name, matchers, by).items():
                series[_legend(legend, key)].append((step, now - value if since else value))
    return series


def _fmt(value: float, unit: str) -> str:
    if unit == "s":
        return f"{value * 1000:.0f} ms" if value < 1 else f"{value:.2f} s"
    if unit in ("bytes", "Bps"):
        return f"{value / 2**20:.1f} MiB" + ("/s" if unit == "Bps" else "")
    return f"{value:g}"


def render(scrapes_path: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in scrapes_path.read_text().splitlines() if line.strip()]
    scrapes = []
    for row in rows:
        parsed = _parse(row["metrics"])
        parsed["__time__"] = [({}, float(row["time"]))]
        scrapes.append(parsed)
    steps = [int(r["step"]) for r in rows]
    panels = _load_panels()
    drawable = [p for p in panels if p[1] != "row"]
    cols = 4
    nrows = -(-len(drawable) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(22, 3.1 * nrows), dpi=80)
    section = ""
    flat = list(axes.flat)
    i = 0
    for title, kind, unit, targets, _desc in panels:
        if kind == "row":
            section = title
            continue
        ax = flat[i]
        i += 1
        ax.set_title(f"[{section}] {title}", fontsize=9, loc="left")
        data: Series = {}
        for expr, legend in targets:
            data.update(evaluate(expr, legend, scrapes, steps))
        data = {k: v for k, v in data.items() if v}
        if kind == "table":  # a table is an instant query: only what the last scrape holds
            data = {k: v for k, v in data.items() if v[-1][0] == steps[-1]}
        if not data:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", color="#888888", fontsize=10,
                    transform=ax.transAxes)
            ax.set_xticks([])
            ax.set_yticks([])
            continue
        if kind in ("stat", "table"):
            ax.axis("off")
            lines = [f"{k}: {_fmt(v[-1][1], unit)}" if kind == "stat" else k for k, v in sorted(data.items())]
            ax.text(0.02, 0.85, "\n".join(lines[:6]), va="top", fontsize=13 if kind == "stat" else 8,
                    fontweight="bold" if kind == "stat" else "normal", transform=ax.transAxes)
            continue
        scale, ylabel = (2**20, "MiB") if unit in ("bytes", "Bps") else (1e-3, "ms") if unit == "s" else (1, "")
        if kind == "stacked":
            keys = sorted(data)
            xs = sorted({s for v in data.values() for s, _ in v})
            bottom = [0.0] * len(xs)
            for k in keys:
                values = dict(data[k])
                ys = [values.get(x, 0.0) / scale for x in xs]
                ax.bar(xs, ys, bottom=bottom, label=k, width=0.8)
                bottom = [b + y for b, y in zip(bottom, ys, strict=True)]
        else:
            for k, v in sorted(data.items()):
                ax.plot([s for s, _ in v], [y / scale for _, y in v], label=k, marker="." if len(v) < 40 else None,
                        drawstyle="steps-post" if kind == "state" else "default")
        ax.set_ylabel(ylabel + ("/s" if unit == "Bps" else ""), fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if len(data) <= 8:
            ax.legend(fontsize=6, loc="best")
    for ax in flat[i:]:
        ax.axis("off")
    fig.suptitle(f"colocd dashboard panels (matplotlib, not Grafana) from {len(rows)} real /metrics scrapes "
                 f"of a CPU demo run, one per step; x = step", fontsize=13, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(out)
    plt.close(fig)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scrapes", type=Path, help="JSON lines from `colocd demo --metrics-out`")
    parser.add_argument("-o", "--output", type=Path, default=Path("dashboard-preview.png"))
    args = parser.parse_args()
    print(render(args.scrapes, args.output))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
