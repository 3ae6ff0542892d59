#!/usr/bin/env bash
# Device call V of 2026-12-04: the reference engine's one-rank flattened_bucket loads by a plan per chunk shape
# (after) against the code before it (before, .devcarry/before = git archive 0f7155e): bench/chunk_load.py, then
# bench weights interleaved after/before, and the GPU spec tier on the new code.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
echo "=== chunk-load 4096"
(cd /tmp && PYTHONPATH=/tmp/site:/tmp/after timeout 120 $PY -m colocd.bench.chunk_load --model qwen3-8b \
  --bucket-mib 4096 --pushes 8 --out "$OUT/chunk-load-4096.json") 2>&1 | tail -4
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
V=overlap2@4096+chan,overlap3@2048+chan,zero_copy@all+chan
weights() {  # $1: after|before, $2: run number
  echo "=== weights-$1-$2"; local t0=$SECONDS
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/$1 timeout 100 $PY $W --variants $V --out "$OUT/weights-$1-$2.json" \
    > "$OUT/weights-$1-$2.log" 2>&1)
  echo "=== weights-$1-$2 rc=$? in $((SECONDS-t0)) s"
  grep -E "^(overlap|zero_copy)[^ ]* +[a-z_]+ +[0-9]|^variant +chunks|^(overlap|zero_copy)[^ ]* +[0-9]+ +[0-9]" "$OUT/weights-$1-$2.log"
}
weights after 1; weights before 1; weights after 2; weights before 2
echo "=== gpu tier"; t0=$SECONDS
PYTHONPATH=/tmp/site:/tmp/after timeout 170 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  tests/gpu > "$OUT/gpu-tier.log" 2>&1; echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -4 "$OUT/gpu-tier.log"
if [ $SECONDS -lt 420 ]; then weights after 3; fi
if [ $SECONDS -lt 480 ]; then weights before 3; fi
echo "=== done in $SECONDS s"
