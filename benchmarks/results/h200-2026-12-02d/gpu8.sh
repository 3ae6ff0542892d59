#!/usr/bin/env bash
# Device call D of 2026-12-02: issue 29 item 1 after this stop's levers (the begin and the end prove the engine,
# so open and commit observe nothing first; a one-rank push opens, joins and commits on the chunk channel; the
# manifest by reference), A/B against 5e8212a (the stop's start) twice, interleaved on one machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-12}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
V=zero_copy@all+chan,overlap3@2048+chan
for i in 1 2; do
  TAILN=40 step weights-after$i 110 after $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants $V --verify off,full --out "$OUT/weights-after$i.json"
  TAILN=3 step weights-before$i 110 before $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants $V --verify off,full --out "$OUT/weights-before$i.json"
done
echo "=== done in $SECONDS s"
