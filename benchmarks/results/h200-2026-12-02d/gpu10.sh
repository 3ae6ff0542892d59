#!/usr/bin/env bash
# Device call E of 2026-12-02: the fused digest kernel (bit-exact spec, then its speed beside torch's kernels),
# the GPU spec tier on this stop's code, the README's push after and before (5e8212a), and bench weights after.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-6}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
T="-q -p no:cacheprovider -o addopts=--import-mode=importlib"
step digest-kernel-spec 90 after $PY -m pytest $T -ra tests/gpu/test_digest_kernel.py
TAILN=3 step digests 120 after $PY -m colocd.bench.digests --model $MODEL --device cuda --repeats 3 --out "$OUT/digests.json"
step gpu-tier 200 after $PY -m pytest $T -ra tests/gpu
step readme-after 120 after $PY -m colocd.bench.readme_push --model $MODEL --device cuda --repeats 5 --out "$OUT/readme-after.json"

TAILN=4 step weights-after3 90 after $PY -m colocd.cli bench weights --model $MODEL --device cuda --repeats 3 --variants zero_copy@all+chan,overlap3@2048+chan --verify off,full --out "$OUT/weights-after3.json"
echo "=== done in $SECONDS s"
