#!/usr/bin/env bash
# Device call U of 2026-12-04: where one fresh-bucket chunk's load goes in an engine process (bench/chunk_load.py),
# the reference engine's way now against a plan cached by the chunk's metadata.
set -uo pipefail
export PYTHONUNBUFFERED=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
for mib in 4096 2048; do
  echo "=== chunk-load $mib"
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/after timeout 120 $PY -m colocd.bench.chunk_load --model qwen3-8b \
    --bucket-mib $mib --pushes 8 --out "$OUT/chunk-load-$mib.json") 2>&1 | tail -8
done
echo "=== done in $SECONDS s"
