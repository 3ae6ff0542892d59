#!/usr/bin/env bash
# Device call O of 2026-12-03: the defaults' bucket size as a lever (fewer chunks, each fresh bucket's IPC handle
# opened once): bench weights on the final code, overlap3@2048 (the defaults) beside 4096 MiB buckets, twice.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
for n in 1 2; do echo "=== buckets-$n"
  PYTHONPATH=/tmp/site:/tmp/after timeout 120 $PY -m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 \
    --variants overlap3@2048+chan,overlap3@4096+chan,overlap2@4096+chan --verify off --out "$OUT/buckets-$n.json" \
    > "$OUT/buckets-$n.log" 2>&1; echo "=== rc=$?"; grep -E "^(overlap)" "$OUT/buckets-$n.log" | head -3
done
