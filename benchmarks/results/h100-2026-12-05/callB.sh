#!/usr/bin/env bash
# Device call B (not run: no machine; carry .whl and .devcarry, after = git archive of main, before = of 38add8e):
# the GPU spec tier, then weights at the defaults and the tuned switch, after and before, on one GPU, guarded by elapsed time. Call A (logs beside this file, on 13f4408) ran its tier and its weights-after-1 and weights-before-1 steps.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
ROOT=$PWD
nvidia-smi -L
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before "$OUT/r" && ln -sfn "$ROOT/.devcarry/after" /tmp/after/colocd && ln -sfn "$ROOT/.devcarry/before" /tmp/before/colocd
t0=$SECONDS
(cd .devcarry/after && PYTHONPATH=/tmp/site:/tmp/after timeout 200 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  --durations=8 tests/gpu > "$OUT/r/gpu-tier.log" 2>&1); echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -22 "$OUT/r/gpu-tier.log"
ARGS="--model qwen3-8b --device cuda --repeats 5 --verify off"
rows() { grep -E "^(overlap|serial)[^ ]* +[a-z_]+ +[0-9]|^variant +chunks|^(overlap|serial)[^ ]* +[0-9]+ +[0-9]|floor" "$1" | head -12; }
after_w() {
  echo "=== weights-after-$1"; local t1=$SECONDS
  (cd .devcarry/after && PYTHONPATH=/tmp/site:/tmp/after timeout 120 $PY -m benchmarks.weights $ARGS --variants overlap2@4096 \
    --out "$OUT/r/weights-after-$1.json" > "$OUT/r/weights-after-$1.log" 2>&1)
  echo "=== rc=$? in $((SECONDS-t1)) s"; rows "$OUT/r/weights-after-$1.log"; tail -3 "$OUT/r/weights-after-$1.log"
}
before_w() {
  echo "=== weights-before-$1"; local t1=$SECONDS
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/before timeout 120 $PY -m colocd.cli bench weights $ARGS \
    --variants overlap2@4096+chan,overlap2@4096 --out "$OUT/r/weights-before-$1.json" > "$OUT/r/weights-before-$1.log" 2>&1)
  echo "=== rc=$? in $((SECONDS-t1)) s"; rows "$OUT/r/weights-before-$1.log"
}
SW="--model qwen3-8b --device cuda --steps 3 --warmup 1 --rollout-s 2 --presets tuned"
after_w 1; before_w 1
if [ $SECONDS -lt 260 ]; then
echo "=== switch-after"; t1=$SECONDS
(cd .devcarry/after && NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 130 $PY -m benchmarks.switch $SW \
  --out "$OUT/r/switch-after.json" > "$OUT/r/switch-after.log" 2>&1)
echo "=== rc=$? in $((SECONDS-t1)) s"; grep -A4 "^floor" "$OUT/r/switch-after.log"; tail -3 "$OUT/r/switch-after.log"
fi
if [ $SECONDS -lt 360 ]; then
echo "=== switch-before"; t1=$SECONDS
(cd /tmp && NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/before timeout 130 $PY -m colocd.cli bench switch $SW \
  --out "$OUT/r/switch-before.json" > "$OUT/r/switch-before.log" 2>&1)
echo "=== rc=$? in $((SECONDS-t1)) s"; grep -A4 "^floor" "$OUT/r/switch-before.log"
fi
if [ $SECONDS -lt 420 ]; then after_w 2; fi
tar -C "$OUT" -czf "$OUT/callB.tgz" r && rm -rf "$OUT/r"
echo "=== done in $SECONDS s"
