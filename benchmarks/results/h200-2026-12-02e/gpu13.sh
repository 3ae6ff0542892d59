#!/usr/bin/env bash
# Device call H of 2026-12-02: bench weights on this stop's final code (httptools, its dependency, installed)
# against before (8148f2c, as shipped), interleaved: after / before / after / after / before / after.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ht .devcarry/ht/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 path=$3; shift 3; echo "=== $name ($path): $*"; local t0=$SECONDS;
  PYTHONPATH=$path timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-6}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
W="-m colocd.cli bench weights --model $MODEL --device cuda --repeats 5 --variants zero_copy@all+chan,overlap3@2048+chan --verify off"
n=0
for tree in after before after after before after; do n=$((n+1))
  path=/tmp/site:/tmp/$tree; [ $tree = after ] && path=/tmp/ht:$path  # httptools: after's dependency only
  TAILN=1 step weights-$n-$tree 100 $path $PY $W --out "$OUT/weights-$n-$tree.json"
done
(cd "$OUT" && for f in weights-*.log; do echo "##### $f"; cat "$f"; done > weights.log && rm -f weights-*.log && python3 - <<'PY'
import glob, json
json.dump({f.removesuffix(".json"): json.load(open(f)) for f in sorted(glob.glob("weights-*.json"))}, open("weights.json", "w"), indent=1)
PY
rm -f weights-*.json)
echo "=== done in $SECONDS s"
