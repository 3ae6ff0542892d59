#!/usr/bin/env bash
# Device call I of 2026-12-03: the GPU spec tier on the http1 transport, then bench weights after (http1 under the
# daemon's engine client and the trainer's client) against before (the commit before it), interleaved:
# after / before / after / before.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)} ORDER=${ORDER:-after before after before}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 path=$3; shift 3; echo "=== $name ($path): $*"; local t0=$SECONDS;
  PYTHONPATH=$path timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-6}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
T="-q -p no:cacheprovider -o addopts=--import-mode=importlib"
[ "${GPU_TIER:-1}" = 1 ] && TAILN=4 step gpu-tier 170 /tmp/site:/tmp/after $PY -m pytest $T -ra tests/gpu
W="-m colocd.cli bench weights --model $MODEL --device cuda --repeats 5 --variants zero_copy@all+chan,overlap3@2048+chan --verify off"
n=${FIRST:-0}
for tree in $ORDER; do n=$((n+1))
  TAILN=1 step weights-$n-$tree 100 /tmp/site:/tmp/$tree $PY $W --out "$OUT/weights-$n-$tree.json"
done
(cd "$OUT" && for f in weights-*.log; do echo "##### $f"; cat "$f"; done > weights.log && rm -f weights-*.log && python3 - <<'PY'
import glob, json
json.dump({f.removesuffix(".json"): json.load(open(f)) for f in sorted(glob.glob("weights-*.json"))}, open("weights.json", "w"), indent=1)
PY
rm -f weights-*.json)
echo "=== done in $SECONDS s"
