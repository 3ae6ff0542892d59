#!/usr/bin/env bash
# Device call B of 2026-12-02b: issue 29 item 2, the strict memory-neutral presets beside tuned and the seed, one run.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-45}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
TAILN=8 step group-split 60 after $PY -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib -ra" tests/gpu/test_group_split.py
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 step switch-strict 450 after $PY -m colocd.cli bench switch --model $MODEL --device cuda --steps 2 --warmup 1 --rollout-s 2 \
  --presets seed-baseline,tuned,tuned-settled,tuned-split,tuned-split-early --out "$OUT/switch-strict.json"
echo "=== done in $SECONDS s"
