#!/usr/bin/env bash
# Device call 2 of 2026-12-05: the tuned switch twice more, after/before interleaved (call 1 had after 1.45x, before
# 1.32x: is that the change or the noise?), then the GPU spec tier on this checkout.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before "$OUT/r" && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
SW="--model qwen3-8b --device cuda --steps 3 --warmup 1 --rollout-s 2 --presets tuned"
sw() {  # $1 after|before $2 run
  echo "=== switch-$1-$2"; local t0=$SECONDS
  if [ "$1" = after ]; then
    NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 150 $PY -m benchmarks.switch $SW \
      --out "$OUT/r/switch-$1-$2.json" > "$OUT/r/switch-$1-$2.log" 2>&1
  else
    (cd /tmp && NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/before timeout 150 $PY -m colocd.cli bench switch \
      $SW --out "$OUT/r/switch-$1-$2.json" > "$OUT/r/switch-$1-$2.log" 2>&1)
  fi
  echo "=== rc=$? in $((SECONDS-t0)) s"; grep -A2 "^preset" "$OUT/r/switch-$1-$2.log"
}
sw before 2; sw after 2; sw before 3; sw after 3
echo "=== gpu tier"; t0=$SECONDS
PYTHONPATH=/tmp/site:/tmp/after timeout 200 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  tests/gpu > "$OUT/r/gpu-tier.log" 2>&1; echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -8 "$OUT/r/gpu-tier.log"
tar -C "$OUT" -czf "$OUT/call2.tgz" r && rm -rf "$OUT/r"
echo "=== done in $SECONDS s"
