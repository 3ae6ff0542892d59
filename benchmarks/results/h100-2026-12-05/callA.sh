#!/usr/bin/env bash
# Device call A (ran on an H100 on 13f4408; its logs beside this file): the GPU spec tier on the merged tree (.devcarry/after), then the weight push at the defaults,
# after (this tree) and before (.devcarry/before = git archive 38add8e), on one GPU.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
ROOT=$PWD
nvidia-smi -L
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before "$OUT/r" && ln -sfn "$ROOT/.devcarry/after" /tmp/after/colocd && ln -sfn "$ROOT/.devcarry/before" /tmp/before/colocd
t0=$SECONDS
(cd .devcarry/after && PYTHONPATH=/tmp/site:/tmp/after timeout ${TIER_S:-260} $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  --durations=8 tests/gpu > "$OUT/r/gpu-tier.log" 2>&1); echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -30 "$OUT/r/gpu-tier.log"
ARGS="--model qwen3-8b --device cuda --repeats 5 --verify off"
rows() { grep -E "^(overlap|serial)[^ ]* +[a-z_]+ +[0-9]|^variant +chunks|^(overlap|serial)[^ ]* +[0-9]+ +[0-9]|floor" "$1" | head -12; }
echo "=== weights-after-1"; t1=$SECONDS
(cd .devcarry/after && PYTHONPATH=/tmp/site:/tmp/after timeout 140 $PY -m benchmarks.weights $ARGS --variants overlap2@4096 \
  --out "$OUT/r/weights-after-1.json" > "$OUT/r/weights-after-1.log" 2>&1)
echo "=== rc=$? in $((SECONDS-t1)) s"; rows "$OUT/r/weights-after-1.log"
if [ $SECONDS -lt 440 ]; then
echo "=== weights-before-1"; t1=$SECONDS
(cd /tmp && PYTHONPATH=/tmp/site:/tmp/before timeout 140 $PY -m colocd.cli bench weights $ARGS \
  --variants overlap2@4096+chan,overlap2@4096 --out "$OUT/r/weights-before-1.json" > "$OUT/r/weights-before-1.log" 2>&1)
echo "=== rc=$? in $((SECONDS-t1)) s"; rows "$OUT/r/weights-before-1.log"
fi
tar -C "$OUT" -czf "$OUT/callA.tgz" r && rm -rf "$OUT/r"
echo "=== done in $SECONDS s"
