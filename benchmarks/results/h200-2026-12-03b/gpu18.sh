#!/usr/bin/env bash
# Device call M of 2026-12-03, on the final code: the GPU spec tier; bench switch with tuned now memory-neutral
# (seed-baseline, tuned, tuned-early, tuned-split); bench weights after / before (9c3bb98), interleaved.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
echo "=== gpu tier"; PYTHONPATH=/tmp/site:/tmp/after timeout 170 $PY -m pytest -q -p no:cacheprovider \
  -o addopts=--import-mode=importlib -ra tests/gpu 2>&1 | tail -4 | tee "$OUT/gpu-tier.log"
echo "=== switch"; t0=$SECONDS
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 300 $PY -m colocd.cli bench switch \
  --model qwen3-8b --device cuda --steps 2 --warmup 1 --rollout-s 2 --presets seed-baseline,tuned,tuned-early,tuned-split \
  --out "$OUT/switch.json" > "$OUT/switch.log" 2>&1
echo "=== switch rc=$? in $((SECONDS-t0)) s"; grep -A8 "^floor" "$OUT/switch.log"
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --variants zero_copy@all+chan,overlap3@2048+chan --verify off"
n=4
for tree in after before after before; do n=$((n+1)); echo "=== weights-$n-$tree"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/$tree timeout 100 $PY $W --out "$OUT/weights-$n-$tree.json" > "$OUT/weights-$n-$tree.log" 2>&1
  echo "=== weights-$n-$tree rc=$? in $((SECONDS-t0)) s"; grep -E "^(zero_copy|overlap3)" "$OUT/weights-$n-$tree.log"
done
echo "=== done in $SECONDS s"
