#!/usr/bin/env bash
# The GPU spec tier on this checkout, on two GPUs so the NCCL specs run too.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
nvidia-smi -L
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
t0=$SECONDS
PYTHONPATH=/tmp/site:/tmp/after timeout ${TIER_S:-300} $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  --durations=8 tests/gpu > "$OUT/gpu-tier.log" 2>&1; echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -40 "$OUT/gpu-tier.log"
