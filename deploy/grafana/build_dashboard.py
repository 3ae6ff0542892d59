"""Build the Grafana dashboard for colocd's /metrics: ``python deploy/grafana/build_dashboard.py``.

Writes ``colocd-dashboard.json`` beside this file (import it in Grafana: Dashboards → New → Import;
pick the Prometheus data source when asked). The JSON is generated so it stays in sync with the
metrics: tests/integration/test_operator_view.py checks it equals ``build()`` and that every query
names a metric a real daemon exposes; tests/integration/test_prometheus.py evaluates every query on a real
Prometheus scraping a real daemon.

Two kinds of window. Rates of counters use Grafana's ``$__rate_interval``: between events a rate is 0, which
is data. A mean or quantile of a histogram is a ratio, empty in any window without an observation, so with
minute-long steps a short window leaves those panels mostly blank: per-step panels plot the last-value gauges
(``colocd_last_*``) and means and quantiles use a fixed 30-minute window (``RATIO_WINDOW``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "build"]

OUT = Path(__file__).with_name("colocd-dashboard.json")
SEL = 'instance=~"$instance"'  # every query is scoped to the chosen daemons
W = "$__rate_interval"
RATIO_WINDOW = "30m"  # means and quantiles: wide enough to hold several steps of a slow run

# (title, kind, unit, [(expr, legend)], description); kind: timeseries | stacked | stat | state | row
Panel = tuple[str, str, str, list[tuple[str, str]], str]


def _q(expr: str, legend: str = "") -> tuple[str, str]:
    return expr.replace("{SEL}", SEL).replace("{W}", W), legend


def _mean(metric: str, by: str, extra: str = "") -> str:
    sel = f"{{{SEL}{',' + extra if extra else ''}}}"
    w = RATIO_WINDOW
    return (f"sum by ({by}) (increase({metric}_sum{sel}[{w}])) / sum by ({by}) (increase({metric}_count{sel}[{w}]))")


def _quantile(q: float, metric: str, by: str) -> str:
    return f"histogram_quantile({q}, sum by (le, {by}) (increase({metric}_bucket{{{SEL}}}[{RATIO_WINDOW}])))"


PANELS: list[Panel] = [
    ("Switch time", "row", "", [], ""),
    ("Last step: switch time", "stat", "s", [_q('colocd_last_step_part_seconds{{SEL},part="total"}')],
     "Daemon + trainer-side switch of the last finished step (training itself excluded)."),
    ("Last step", "stat", "none", [_q("colocd_last_step{{SEL}}")], "Step number of the last finished rollout."),
    ("NVML available", "stat", "none", [_q("colocd_nvml_available{{SEL}}")],
     "0: no GPU readings on this node (CPU engines or no NVML); GPU memory panels stay empty."),
    ("Last step's switch by part", "stacked", "s",
     [_q('colocd_last_step_part_seconds{{SEL},part!="total"}', "{{part}}")],
     "sleep = train (pause+flush+release), load_weights_memory = sync, update = weight session, "
     "wake = rollout, cleanup / groups = trainer-reported."),
    ("Switch time per step (last; mean and p90 over 30 min)", "timeseries", "s",
     [_q('colocd_last_step_part_seconds{{SEL},part="total"}', "last {{instance}}"),
      _q(_mean("colocd_step_switch_seconds", "instance"), "mean {{instance}}"),
      _q(_quantile(0.9, "colocd_step_switch_seconds", "instance"), "p90 {{instance}}")], ""),
    ("Mean time per part (30 min)", "stacked", "s",
     [_q(_mean("colocd_step_part_duration_seconds", "part"), "{{part}}")], ""),
    ("Last phase time by engine", "timeseries", "s",
     [_q("colocd_last_phase_duration_seconds{{SEL}}", "{{phase}} {{engine}}")],
     "engine=all is the whole node's transition; phase=weights is the last weight session."),
    ("Phase p90 by engine (30 min)", "timeseries", "s",
     [_q(_quantile(0.9, "colocd_phase_duration_seconds", "phase, engine"), "{{phase}} {{engine}}")], ""),
    ("Engine sub-steps (last call)", "timeseries", "s",
     [_q("max by (substep) (colocd_last_substep_duration_seconds{{SEL}})", "{{substep}}")],
     "pause_generation, flush_cache, release_memory, resume_memory, begin/end_weight_update, ... "
     "(the slowest engine's last call)."),
    ("Trainer cleanup and process groups (mean, 30 min)", "timeseries", "s",
     [_q(_mean("colocd_trainer_substep_duration_seconds", "substep"), "{{substep}}")], ""),
    ("Weights", "row", "", [], ""),
    ("Weight bytes/s by engine", "timeseries", "Bps",
     [_q("sum by (engine, transport) (rate(colocd_weight_bytes_total{{SEL}}[{W}]))", "{{engine}} {{transport}}")], ""),
    ("Chunks/s by engine", "timeseries", "ops",
     [_q("sum by (engine) (rate(colocd_weight_chunks_total{{SEL}}[{W}]))", "{{engine}}")], ""),
    ("Chunk load latency (p50, p99; 30 min)", "timeseries", "s",
     [_q(_quantile(0.5, "colocd_weight_chunk_load_seconds", "engine"), "p50 {{engine}}"),
      _q(_quantile(0.99, "colocd_weight_chunk_load_seconds", "engine"), "p99 {{engine}}")], ""),
    ("Weight session duration (last; mean by outcome, 30 min)", "timeseries", "s",
     [_q('colocd_last_phase_duration_seconds{{SEL},phase="weights",engine="all"}', "last"),
      _q(_mean("colocd_weight_session_duration_seconds", "outcome"), "{{outcome}}")], ""),
    ("Open weight session: idle for", "timeseries", "s",
     [_q("colocd_weight_session_idle_seconds{{SEL}}", "{{instance}}")],
     "Seconds since the open session last saw the trainer (0: none open); it expires at timeouts.session_idle_s."),
    ("GPU memory", "row", "", [], ""),
    ("GPU memory used / total per GPU", "timeseries", "bytes",
     [_q("colocd_gpu_memory_used_bytes{{SEL}}", "used gpu {{gpu}}"),
      _q("colocd_gpu_memory_total_bytes{{SEL}}", "total gpu {{gpu}}")],
     "NVML readings; uuid joins dcgm-exporter's series (its UUID label)."),
    ("GPU memory free per GPU", "timeseries", "bytes",
     [_q("colocd_gpu_memory_free_bytes{{SEL}}", "gpu {{gpu}}")], ""),
    ("GPU memory used on each engine's GPUs", "timeseries", "bytes",
     [_q('sum by (engine) (colocd_engine_gpu_info{{SEL}} * on (instance, gpu) group_left '
         'colocd_gpu_memory_used_bytes{{SEL}})', "{{engine}}")],
     "NVML used bytes of the GPUs each engine is configured on (a shared GPU counts for each engine)."),
    ("GPU memory per process", "timeseries", "bytes",
     [_q("colocd_gpu_process_memory_bytes{{SEL}}", "gpu {{gpu}} pid {{pid}}")],
     "Where NVML attributes memory to processes (not on every driver or MIG setup)."),
    ("Engine memory by tag (engine's own accounting)", "stacked", "bytes",
     [_q("colocd_engine_memory_bytes{{SEL}}", "{{engine}} {{tag}}")], "Reference engine only."),
    ("Memory freed by releases", "timeseries", "Bps",
     [_q("sum by (engine, source) (rate(colocd_memory_freed_bytes_total{{SEL}}[{W}]))", "{{engine}} {{source}}")],
     ""),
    ("Memory the trainer's process groups kept", "timeseries", "bytes",
     [_q("colocd_trainer_groups_kept_bytes{{SEL}}", "{{instance}} {{action}}")], ""),
    ("Engines and failures", "row", "", [], ""),
    ("Node phase", "state", "none", [_q("colocd_node_phase{{SEL}} == 1", "{{instance}} {{phase}}")], ""),
    ("Time in the current phase", "timeseries", "s",
     [_q("time() - colocd_node_phase_entered_timestamp_seconds{{SEL}}", "{{instance}}")],
     "How long the node has been in its (step, phase); the ColocdPhaseStuck alert reads this."),
    ("Node busy", "state", "none", [_q("colocd_node_busy{{SEL}}", "{{instance}}")],
     "1 while a transition, a weight-session call or a reconcile holds the node."),
    ("Engine healthy", "state", "none", [_q("colocd_engine_healthy{{SEL}}", "{{engine}}")], ""),
    ("Engine serving (1) or paused (0)", "state", "none",
     [_q('colocd_engine_generation_state{{SEL},state="serving"}', "{{engine}}")], ""),
    ("Engine weights state", "state", "none",
     [_q("colocd_engine_weights_state{{SEL}} == 1", "{{engine}} {{state}}")],
     "clean = the committed version; updating = a session is open; stale = released or abandoned without a "
     "full update (the engine stays paused)."),
    ("Memory tag resident", "state", "none", [_q("colocd_engine_tag_resident{{SEL}}", "{{engine}} {{tag}}")], ""),
    ("Engine restarts and launch failures", "timeseries", "none",
     [_q("sum by (engine) (increase(colocd_engine_restarts_total{{SEL}}[{W}]))", "{{engine}} restarts"),
      _q("sum by (engine) (increase(colocd_engine_launch_failures_total{{SEL}}[{W}]))", "{{engine}} launch failures")],
     "Launch failures rising while launches do not is a crash loop (ColocdEngineCrashLooping)."),
    ("Transitions by outcome", "timeseries", "none",
     [_q("sum by (phase, outcome) (increase(colocd_transitions_total{{SEL}}[{W}]))", "{{phase}} {{outcome}}")], ""),
    ("Failures: transitions and weight sessions", "timeseries", "none",
     [_q('sum by (phase) (increase(colocd_transitions_total{{SEL},outcome="failed"}[{W}]))', "{{phase}} failed"),
      _q('sum by (outcome) (increase(colocd_weight_sessions_total{{SEL},outcome!="committed"}[{W}]))',
         "session {{outcome}}")], ""),
    ("Fallbacks", "timeseries", "none",
     [_q("sum by (kind) (increase(colocd_fallbacks_total{{SEL}}[{W}]))", "{{kind}}")], ""),
    ("Reconcile actions", "timeseries", "none",
     [_q("sum by (engine, action) (increase(colocd_reconcile_actions_total{{SEL}}[{W}]))", "{{engine}} {{action}}")],
     ""),
    ("Node step", "timeseries", "none", [_q("colocd_node_step{{SEL}}", "{{instance}}")], ""),
    ("Weight version per engine", "table", "none", [_q("colocd_engine_weight_version_info{{SEL}} == 1", "")], ""),
    ("Active policy", "table", "none", [_q("colocd_policy_info{{SEL}} == 1", "")], ""),
    ("Daemon process: CPU and resident memory", "timeseries", "none",
     [_q("rate(process_cpu_seconds_total{{SEL}}[{W}])", "cpu {{instance}}"),
      _q("process_resident_memory_bytes{{SEL}}", "rss bytes {{instance}}")], ""),
    ("colocd version", "table", "none", [_q("colocd_build_info{{SEL}}", "")], ""),
]


def _panel(pid: int, title: str, kind: str, unit: str, targets: list[tuple[str, str]], description: str,
           pos: dict[str, int]) -> dict[str, Any]:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    if kind == "row":
        return {"id": pid, "type": "row", "title": title, "collapsed": False, "gridPos": pos, "panels": []}
    grafana_type = {"stacked": "timeseries", "state": "state-timeline"}.get(kind, kind)
    custom: dict[str, Any] = {}
    if kind == "stacked":
        custom = {"stacking": {"mode": "normal", "group": "A"}, "fillOpacity": 60, "drawStyle": "bars"}
    elif grafana_type == "timeseries":
        custom = {"fillOpacity": 10, "showPoints": "auto"}
    panel: dict[str, Any] = {
        "id": pid, "type": grafana_type, "title": title, "description": description, "datasource": ds,
        "gridPos": pos,
        "fieldConfig": {"defaults": {"unit": unit, "custom": custom}, "overrides": []},
        "targets": [{"refId": chr(ord("A") + i), "datasource": ds, "expr": expr, "legendFormat": legend,
                     **({"format": "table", "instant": True} if kind == "table" else {})}
                    for i, (expr, legend) in enumerate(targets)],
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}, "tooltip": {"mode": "multi"}},
    }
    if kind == "state":
        panel["fieldConfig"]["defaults"]["mappings"] = [
            {"type": "value", "options": {"0": {"text": "no", "color": "red"}, "1": {"text": "yes", "color": "green"}}}]
    return panel


def build() -> dict[str, Any]:
    """The dashboard as a dict (Grafana schema 39; data source and instance are template variables)."""
    panels, x, y, pid = [], 0, 0, 1
    for title, kind, unit, targets, description in PANELS:
        if kind == "row":
            y += 8 if x else 0
            x = 0
            panels.append(_panel(pid, title, kind, unit, targets, description, {"h": 1, "w": 24, "x": 0, "y": y}))
            y += 1
        else:
            w = 6 if kind == "stat" else 12
            if x + w > 24:
                x, y = 0, y + 8
            panels.append(_panel(pid, title, kind, unit, targets, description, {"h": 8 if w == 12 else 4,
                                                                                "w": w, "x": x, "y": y}))
            x += w
        pid += 1
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": "colocd: colocated RL switch", "uid": "colocd-node", "editable": True, "schemaVersion": 39,
        "tags": ["colocd", "rl"], "time": {"from": "now-1h", "to": "now"}, "refresh": "10s",
        "templating": {"list": [
            {"name": "datasource", "type": "datasource", "query": "prometheus", "label": "Data source"},
            {"name": "instance", "type": "query", "label": "Daemon", "multi": True, "includeAll": True,
             "datasource": {"type": "prometheus", "uid": "${datasource}"},
             "query": {"query": "label_values(colocd_node_step, instance)", "refId": "instance"},
             "definition": "label_values(colocd_node_step, instance)", "refresh": 2},
        ]},
        "panels": panels,
    }


def main() -> int:
    OUT.write_text(json.dumps(build(), indent=2) + "\n")
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
