#!/usr/bin/env bash
# Device call A of 2026-12-02b: issue 29 item 1 (session fixed cost) before/after on one machine, then the GPU spec tier.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-40}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
V=zero_copy@all+chan,overlap3@2048+chan
step weights-after 120 after $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants $V --verify off,full --out "$OUT/weights-after.json"
step weights-before 100 before $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants $V --verify off,full --out "$OUT/weights-before.json"
TAILN=25 step gpu-tier 240 after $PY -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" tests/gpu
echo "=== done in $SECONDS s"
