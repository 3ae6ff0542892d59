#!/usr/bin/env bash
# Device call 1 of 2026-12-05: the weight push at the defaults and the tuned switch, before the redesign's folding
# (.devcarry/before = git archive 38add8e, its defaults over the chunk channel) and after (this checkout: HTTP only,
# no ipc_ring/zero_copy, weight sessions through the engine sync), interleaved, on one H200.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before "$OUT/r" && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
ARGS="--model qwen3-8b --device cuda --repeats 5 --verify off"
rows() { grep -E "^(overlap|serial)[^ ]* +[a-z_]+ +[0-9]|^variant +chunks|^(overlap|serial)[^ ]* +[0-9]+ +[0-9]|floor" "$1" | head -12; }
after_w() {
  echo "=== weights-after-$1"; local t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/after timeout 150 $PY -m benchmarks.weights $ARGS --variants overlap2@4096 \
    --out "$OUT/r/weights-after-$1.json" > "$OUT/r/weights-after-$1.log" 2>&1
  echo "=== rc=$? in $((SECONDS-t0)) s"; rows "$OUT/r/weights-after-$1.log"
}
before_w() {
  echo "=== weights-before-$1"; local t0=$SECONDS
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/before timeout 150 $PY -m colocd.cli bench weights $ARGS \
    --variants overlap2@4096+chan,overlap2@4096 --out "$OUT/r/weights-before-$1.json" > "$OUT/r/weights-before-$1.log" 2>&1)
  echo "=== rc=$? in $((SECONDS-t0)) s"; rows "$OUT/r/weights-before-$1.log"
}
SW="--model qwen3-8b --device cuda --steps 3 --warmup 1 --rollout-s 2 --presets tuned"
after_w 1; before_w 1
echo "=== switch-after"; t0=$SECONDS
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 170 $PY -m benchmarks.switch $SW \
  --out "$OUT/r/switch-after.json" > "$OUT/r/switch-after.log" 2>&1
echo "=== rc=$? in $((SECONDS-t0)) s"; grep -A4 "^floor" "$OUT/r/switch-after.log"
echo "=== switch-before"; t0=$SECONDS
(cd /tmp && NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/before timeout 170 $PY -m colocd.cli bench switch $SW \
  --out "$OUT/r/switch-before.json" > "$OUT/r/switch-before.log" 2>&1)
echo "=== rc=$? in $((SECONDS-t0)) s"; grep -A4 "^floor" "$OUT/r/switch-before.log"
if [ $SECONDS -lt 460 ]; then after_w 2; fi
if [ $SECONDS -lt 530 ]; then before_w 2; fi
tar -C "$OUT" -czf "$OUT/call1.tgz" r && rm -rf "$OUT/r"
echo "=== done in $SECONDS s"
