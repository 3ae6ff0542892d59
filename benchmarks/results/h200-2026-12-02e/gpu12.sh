#!/usr/bin/env bash
# Device call G of 2026-12-02: the GPU spec tier on this stop's code, bench weights after (with httptools, now a
# dependency) / before (8148f2c, without) / before with httptools (the code's share alone), the README push
# after / before.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 COLOCD_SKIP_VLLM=1 COLOCD_SKIP_SGLANG=1
PY=python3 MODEL=qwen3-8b OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/ht .devcarry/ht/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 path=$3; shift 3; echo "=== $name ($path): $*"; local t0=$SECONDS;
  PYTHONPATH=$path timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n ${TAILN:-6}; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
A=/tmp/ht:/tmp/site:/tmp/after B=/tmp/site:/tmp/before BH=/tmp/ht:/tmp/site:/tmp/before
T="-q -p no:cacheprovider -o addopts=--import-mode=importlib"
TAILN=4 step gpu-tier 200 $A $PY -m pytest $T -ra tests/gpu
W="-m colocd.cli bench weights --model $MODEL --device cuda --repeats 5 --variants zero_copy@all+chan,overlap3@2048+chan --verify off"
TAILN=3 step weights-after1 100 $A $PY $W --out "$OUT/weights-after1.json"
TAILN=3 step weights-before1 100 $B $PY $W --out "$OUT/weights-before1.json"
TAILN=3 step weights-after2 100 $A $PY $W --out "$OUT/weights-after2.json"
TAILN=3 step weights-before2 100 $B $PY $W --out "$OUT/weights-before2.json"
TAILN=3 step weights-beforeht 100 $BH $PY $W --out "$OUT/weights-beforeht.json"
R="-m colocd.bench.readme_push --model $MODEL --device cuda --repeats 5"
TAILN=3 step readme-after 120 $A $PY $R --out "$OUT/readme-after.json"
TAILN=3 step readme-before 120 $B $PY $R --out "$OUT/readme-before.json"
# At most 8 files come back: one JSON and one log per kind of run.
(cd "$OUT" && for k in weights readme; do for f in $k-*.log; do echo "##### $f"; cat "$f"; done > $k.log; rm -f $k-*.log; done
 python3 - <<'PY'
import glob, json
for kind in ("weights", "readme"):
    out = {f.removesuffix(".json"): json.load(open(f)) for f in sorted(glob.glob(f"{kind}-*.json"))}
    json.dump(out, open(f"{kind}.json", "w"), indent=1)
PY
 rm -f weights-*.json readme-*.json)
echo "=== done in $SECONDS s"
