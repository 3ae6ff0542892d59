#!/usr/bin/env bash
# Device call Y of 2026-12-04: the GPU spec tier on 9ec1f6e (the review's mends of the sink's load paths).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
PYTHONPATH=/tmp/site:/tmp/after timeout 200 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  tests/gpu > "$OUT/gpu-tier.log" 2>&1; echo "=== gpu tier rc=$?"; tail -5 "$OUT/gpu-tier.log"
