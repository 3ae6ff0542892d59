#!/usr/bin/env bash
# Device call 3 of 2026-12-05: the GPU spec tier on the merged redesign (tests through the one factory, cuda_ipc's
# device check at the daemon, loads that outlive their session).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
echo "=== gpu tier"; t0=$SECONDS
PYTHONPATH=/tmp/site:/tmp/after timeout 240 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  tests/gpu > "$OUT/call3-gpu-tier.log" 2>&1; echo "=== gpu tier rc=$? in $((SECONDS-t0)) s"; tail -12 "$OUT/call3-gpu-tier.log"
