#!/usr/bin/env bash
# Device call E of 2026-12-02: the GPU spec tier on this stop's code, then the README's push against
# WeightPusher() defaults after and before (5e8212a): the user's path now opens and commits on the chunk channel.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-12}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
TAILN=8 step gpu-tier 200 after $PY -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" tests/gpu
TAILN=8 step readme-after 150 after $PY -m colocd.bench.readme_push --model $MODEL --device cuda --repeats 5 --out "$OUT/readme-after.json"
TAILN=8 step readme-before 150 before $PY -m colocd.bench.readme_push --model $MODEL --device cuda --repeats 5 --out "$OUT/readme-before.json"
echo "=== done in $SECONDS s"
