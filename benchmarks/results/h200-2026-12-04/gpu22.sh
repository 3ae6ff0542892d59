#!/usr/bin/env bash
# Device call Q of 2026-12-04: the defaults' shape as the lever (call P's ring per session did not pay and was
# reverted). bench weights three times: the defaults (overlap3@2048) beside depth 2 at 2, 3 and 4 GiB and the best
# variant; bench switch, tuned beside tuned-2x4096 (2 x 4 GiB buckets) and seed-baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
V=overlap3@2048+chan,overlap2@2048+chan,overlap2@3072+chan,overlap2@4096+chan,zero_copy@all+chan
for n in 1 2 3; do echo "=== weights-$n"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/after timeout 120 $PY $W --variants $V --out "$OUT/weights-$n.json" > "$OUT/weights-$n.log" 2>&1
  echo "=== weights-$n rc=$? in $((SECONDS-t0)) s"; grep -E "^(overlap|zero_copy)[^ ]* +[a-z_]+ +[0-9]" "$OUT/weights-$n.log"
done
echo "=== switch"; t0=$SECONDS
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 230 $PY -m colocd.cli bench switch \
  --model qwen3-8b --device cuda --steps 2 --warmup 1 --rollout-s 2 --presets seed-baseline,tuned,tuned-2x4096 \
  --out "$OUT/switch.json" > "$OUT/switch.log" 2>&1
echo "=== switch rc=$? in $((SECONDS-t0)) s"; grep -A5 "^floor" "$OUT/switch.log"
echo "=== done in $SECONDS s"
