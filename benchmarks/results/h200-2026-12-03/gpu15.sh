#!/usr/bin/env bash
# Device call J of 2026-12-03: bench switch (`tuned`, the defaults) after (http1) / before (the commit before it).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
for tree in after before; do
  echo "=== switch-$tree"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/$tree timeout 220 $PY -m colocd.cli bench switch --model qwen3-8b --device cuda --steps 2 \
    --warmup 1 --rollout-s 2 --presets tuned --out "$OUT/switch-$tree.json" > "$OUT/switch-$tree.log" 2>&1
  echo "=== switch-$tree rc=$? in $((SECONDS-t0)) s"; grep -E "^\| *(tuned|floor)|floor|tuned " "$OUT/switch-$tree.log" | tail -4
done
echo "=== done in $SECONDS s"
