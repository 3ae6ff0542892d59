#!/usr/bin/env bash
# Device call L of 2026-12-03: the GPU group specs with the groups torn down together (one thread each), then
# bench switch after (that) for seed-baseline, tuned, tuned-settled, tuned-split, and before (9c3bb98) for
# tuned-settled, the memory-neutral preset the teardown is for.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
echo "=== gpu group specs"; PYTHONPATH=/tmp/site:/tmp/after timeout 120 $PY -m pytest -q -p no:cacheprovider \
  -o addopts=--import-mode=importlib -ra tests/gpu -k "group or split or nccl" 2>&1 | tail -4 | tee "$OUT/gpu-groups.log"
run() { local tree=$1 presets=$2 t=$3; echo "=== switch-$tree ($presets)"; local t0=$SECONDS
  NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" $PY -m colocd.cli bench switch \
    --model qwen3-8b --device cuda --steps 2 --warmup 1 --rollout-s 2 --presets "$presets" \
    --out "$OUT/switch-$tree.json" > "$OUT/switch-$tree.log" 2>&1
  echo "=== switch-$tree rc=$? in $((SECONDS-t0)) s"; grep -A8 "^floor" "$OUT/switch-$tree.log" | grep -v "^targets"; }
run after seed-baseline,tuned,tuned-settled,tuned-split 300
run before tuned-settled 150
echo "=== done in $SECONDS s"
