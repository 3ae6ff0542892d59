#!/usr/bin/env bash
# Device call F of 2026-12-02: the idle-wake cost of one engine request (h11 / httptools, engine loop spinning
# or not), bench weights after / before (8148f2c) / after with httptools / after, the GPU spec tier.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ht .devcarry/ht/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 path=$3; shift 3; echo "=== $name ($path): $*"; local t0=$SECONDS;
  PYTHONPATH=$path timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-6}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
A=/tmp/site:/tmp/after B=/tmp/site:/tmp/before AH=/tmp/ht:/tmp/site:/tmp/after
TAILN=1 step wake-h11 60 $A $PY .devcarry/wake.py cuda
TAILN=1 SPIN=1 step wake-h11-spin 60 $A:$PWD/.devcarry/spinsite $PY .devcarry/wake.py cuda
TAILN=1 step wake-ht 60 $AH $PY .devcarry/wake.py cuda
TAILN=1 SPIN=1 step wake-ht-spin 60 $AH:$PWD/.devcarry/spinsite $PY .devcarry/wake.py cuda
W="-m colocd.cli bench weights --model $MODEL --device cuda --repeats 5 --variants zero_copy@all+chan,overlap3@2048+chan --verify off"
TAILN=40 step weights-after1 100 $A $PY $W --out "$OUT/weights-after1.json"
TAILN=4 step weights-before1 100 $B $PY $W --out "$OUT/weights-before1.json"
TAILN=40 step weights-after-ht 100 $AH $PY $W --out "$OUT/weights-after-ht.json"
TAILN=4 step weights-after2 100 $A $PY $W --out "$OUT/weights-after2.json"
T="-q -p no:cacheprovider -o addopts=--import-mode=importlib"
[ -n "${GPU_TIER:-}" ] && step gpu-tier 200 $A $PY -m pytest $T -ra tests/gpu
# At most 8 files come back: one log per kind of run.
(cd "$OUT" && for k in wake weights; do for f in $k-*.log; do echo "##### $f"; cat "$f"; done > $k.log; rm -f $k-*.log; done)
echo "=== done in $SECONDS s"
