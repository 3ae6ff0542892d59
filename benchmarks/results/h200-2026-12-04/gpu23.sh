#!/usr/bin/env bash
# Device call R of 2026-12-04, on the final code (defaults now overlap2@4096): the GPU spec tier; bench weights
# twice, the new defaults beside the old (overlap3@2048) and the best variant; bench switch, tuned (now 2 x 4 GiB)
# beside tuned-3x2048 (the old shape) and seed-baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
echo "=== gpu tier"; t0=$SECONDS
PYTHONPATH=/tmp/site:/tmp/after timeout 200 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  tests/gpu > "$OUT/gpu-tier.log" 2>&1; echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -5 "$OUT/gpu-tier.log"
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
V=overlap2@4096+chan,overlap3@2048+chan,zero_copy@all+chan
for n in 1 2; do echo "=== weights-$n"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/after timeout 100 $PY $W --variants $V --out "$OUT/weights-$n.json" > "$OUT/weights-$n.log" 2>&1
  echo "=== weights-$n rc=$? in $((SECONDS-t0)) s"; grep -E "^(overlap|zero_copy)[^ ]* +[a-z_]+ +[0-9]" "$OUT/weights-$n.log"
done
echo "=== switch"; t0=$SECONDS
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 200 $PY -m colocd.cli bench switch \
  --model qwen3-8b --device cuda --steps 2 --warmup 1 --rollout-s 2 --presets seed-baseline,tuned,tuned-3x2048 \
  --out "$OUT/switch.json" > "$OUT/switch.log" 2>&1
echo "=== switch rc=$? in $((SECONDS-t0)) s"; grep -A5 "^floor" "$OUT/switch.log"
echo "=== done in $SECONDS s"
