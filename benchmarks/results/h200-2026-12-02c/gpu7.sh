#!/usr/bin/env bash
# Device call C of 2026-12-02b: the session fixed cost after all of today's levers, A/B against 33d06d2 twice
# (interleaved, one machine), then a second sample of the strict switch presets on a fresh machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-12}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
V=zero_copy@all+chan,overlap3@2048+chan
for i in 1 2; do
  TAILN=22 step weights-after$i 100 after $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants $V --verify off,full --out "$OUT/weights-after$i.json"
  TAILN=3 step weights-before$i 100 before $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants $V --verify off,full --out "$OUT/weights-before$i.json"
done
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 TAILN=8 step switch-strict2 240 after $PY -m colocd.cli bench switch --model $MODEL --device cuda --steps 2 --warmup 1 --rollout-s 2 \
  --presets seed-baseline,tuned,tuned-split --out "$OUT/switch-strict2.json"
echo "=== done in $SECONDS s"
