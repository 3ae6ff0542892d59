#!/usr/bin/env bash
# Issue 29 in one device call (about 4 minutes on one H200, qwen3-8b shapes): every figure against a floor measured
# in the same run, every JSON record under $OUT.
#
#   bash benchmarks/gpu_issue29.sh                           # on the device: cuda, qwen3-8b
#   OUT=/tmp/i29 bash benchmarks/gpu_issue29.sh --device cpu --model tiny   # the same steps on CPU, tiny shapes (CI-sized)
#
# 1. digests: engines/digest.py against the earlier block loop on the same tensors, GB/s each, at several scratch
#    sizes and both widenings, and against one device copy (benchmarks/digests.py).
# 2. weights: `python3 -m benchmarks.weights`, the best variant (zero_copy@all) and the defaults (overlap3@2048),
#    verify off and full, with the session's breakdown open -> commit (benchmarks/session_breakdown.py).
# 3. switch: `python3 -m benchmarks.switch`, seed-baseline, tuned, tuned-keep and the onload levers tuned-onload and
#    tuned-onload2 (benchmarks/onload.py), against the same run's floor.
# 4. compiled: step 1's tensors once more with a torch.compile'd fused row sum beside the eager digests.
# Each step has its own time limit, so one that hangs costs only its own slot; the summary at the end reads the
# JSON records. Wheels in .whl/ (fastapi, uvicorn, pydantic for a bare box) are installed first where present.
set -uo pipefail
DEVICE=cuda MODEL=qwen3-8b
while [ $# -gt 0 ]; do
  case $1 in
    --device) DEVICE=$2; shift 2 ;;
    --model) MODEL=$2; shift 2 ;;
    *) echo "usage: $0 [--device cuda|cpu] [--model NAME]" >&2; exit 2 ;;
  esac
done
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
ROOT=$(cd "$(dirname "$0")/.." && pwd)  # the repository root is the package colocd
cd "$ROOT" || exit 9
SITE=$(mktemp -d) PKG=$(mktemp -d)
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 9
fi
ln -sfn "$ROOT" "$PKG/colocd"
export PYTHONPATH=$SITE:$PKG${PYTHONPATH:+:$PYTHONPATH}
"$PY" -c 'import torch, colocd; print("torch", torch.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no cuda", colocd.__file__)'
# The digest micro-bench (run from the checkout); override where benchmarks/ lives elsewhere (DIGESTS="python3 -m ...").
read -r -a DIGESTS <<< "${DIGESTS:-$PY -m benchmarks.digests}"
step() { local name=$1 t=$2; shift 2; echo "=== $name: $*"; local t0=$SECONDS; timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 60; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }

if [ "$DEVICE" = cuda ]; then
  ROWS=4,16,32,128 REPEATS=5 SWITCH=(--steps 2 --warmup 1 --rollout-s 2)
  T_DIG=40 T_WEIGHTS=90 T_SWITCH=180 T_COMPILED=50  # expected ~20 + 60 + 130 + 35 s
else  # a CPU smoke run of the same steps: tiny shapes, few repeats, two one-rank groups, no destroy wait
  ROWS=8,16 REPEATS=2 SWITCH=(--steps 1 --warmup 1 --groups 2 --train-tokens 8 --gen-tokens 4 --post-destroy-wait-s 0)
  T_DIG=300 T_WEIGHTS=600 T_SWITCH=900 T_COMPILED=400
fi

step digests "$T_DIG" "${DIGESTS[@]}" --model "$MODEL" --device "$DEVICE" --repeats "$REPEATS" \
  --scratch-rows "$ROWS" --out "$OUT/digests-$MODEL.json"
step weights "$T_WEIGHTS" "$PY" -m benchmarks.weights --model "$MODEL" --device "$DEVICE" --repeats 3 \
  --variants "zero_copy@all,overlap3@2048" --verify off,full --out "$OUT/weights-$MODEL.json"
step switch "$T_SWITCH" "$PY" -m benchmarks.switch --model "$MODEL" --device "$DEVICE" "${SWITCH[@]}" \
  --presets seed-baseline,tuned,tuned-onload,tuned-onload2,tuned-keep --out "$OUT/switch-$MODEL.json"

# Last, as it may not finish: the same digests with the row sums fused by torch.compile (a candidate lever).
step compiled "$T_COMPILED" "${DIGESTS[@]}" --model "$MODEL" --device "$DEVICE" --repeats "$REPEATS" \
  --scratch-rows 16 --compiled --out "$OUT/digests-compiled-$MODEL.json"

"$PY" - "$OUT" "$MODEL" <<'EOF'
import json, sys
from pathlib import Path
out, model = Path(sys.argv[1]), sys.argv[2]
def load(name):
    p = out / f"{name}-{model}.json"
    return json.loads(p.read_text()) if p.exists() else None
summary = {}
if (d := load("digests")) is not None:
    summary["digests"] = {"old_gb_per_s": d["implementations"]["block_loop"]["gb_per_s"],
                          "default": d["default"], "default_speedup": d["default_speedup"],
                          "best": d["best_fused"], "best_speedup": d["speedup"], "same_digests": d["same_digests"],
                          "cpu_agrees": d["cpu_agrees"], "copy_s": d["copy_s"], "full_s": d["full_s"],
                          "gb_per_s": {k: v["gb_per_s"] for k, v in d["implementations"].items()}}
if (c := load("digests-compiled")) is not None:
    summary["digests_compiled"] = {"gb_per_s": {k: v["gb_per_s"] for k, v in c["implementations"].items()},
                                   "first_call_s": c["implementations"].get("compiled", {}).get("first_call_s"),
                                   "same_digests": c["same_digests"], "errors": c["errors"]}
if (w := load("weights")) is not None:
    summary["weights"] = {"floor_ms": 1e3 * w["floor_s"], "targets": w["targets"],
                          "variants": {v["name"]: {"stream_x": v["x_floor"], "wall_x": v["wall_x_floor"],
                                                   "breakdown_ms": {k: round(1e3 * s, 3) for k, s in v["breakdown"].items()}}
                                       for v in w["variants"] if not v["skipped"]}}
if (s := load("switch")) is not None:
    summary["switch"] = {"floor_s": s["floor"]["total_s"], "targets": s.get("targets"),
                         "presets": {p["preset"]: {k: p.get(k) for k in ("switch_s", "x_floor", "resume_s", "sleep_s",
                                                                         "update_s", "wake_s", "trainer_nvml_gib_max",
                                                                         "trainer_nvml_settled_gib_max",
                                                                         "trainer_window_peak_gib",
                                                                         "verified_all", "onload_intact_all")}
                                     | {"onload_s": p["parts"].get("resume.onload"),
                                        "groups_wait_s": p["parts"].get("resume.groups_wait")}
                                     for p in s["summary"]}}
(out / f"issue29-summary-{model}.json").write_text(json.dumps(summary, indent=2))
print(json.dumps(summary, indent=2))
EOF
