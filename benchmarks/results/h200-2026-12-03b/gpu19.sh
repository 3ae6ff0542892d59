#!/usr/bin/env bash
# Device call N of 2026-12-03: the destroy probe (probe_destroy.py), then bench weights after (the first export
# waiting until the open is written) / before (9c3bb98), interleaved.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
echo "=== probe"; timeout 120 $PY bench/results/h200-2026-12-03b/probe_destroy.py 2>&1 | tail -2 | tee "$OUT/probe-destroy.log"
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --variants zero_copy@all+chan,overlap3@2048+chan --verify off"
n=8
for tree in after before after before; do n=$((n+1)); echo "=== weights-$n-$tree"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/$tree timeout 100 $PY $W --out "$OUT/weights-$n-$tree.json" > "$OUT/weights-$n-$tree.log" 2>&1
  echo "=== weights-$n-$tree rc=$? in $((SECONDS-t0)) s"; grep -E "^(zero_copy|overlap3)@" "$OUT/weights-$n-$tree.log" | head -2
  grep -E "open \+ join|first chunk's export|open's reply" "$OUT/weights-$n-$tree.log"
done
(cd "$OUT" && python3 - <<'PY'
import glob, json
json.dump({f.removesuffix(".json"): json.load(open(f)) for f in sorted(glob.glob("weights-*.json"))}, open("weights.json", "w"), indent=1)
PY
rm -f weights-*.json; cat weights-*.log > weights.log; rm -f weights-*.log)
echo "=== done in $SECONDS s"
