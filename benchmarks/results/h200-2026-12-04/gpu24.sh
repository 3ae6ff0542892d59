#!/usr/bin/env bash
# Device call S of 2026-12-04, on the final code: three more bench weights runs of the new defaults (overlap2@4096)
# beside the old (overlap3@2048) and the best variant, for the spread of the defaults' margin under 4x.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
V=overlap2@4096+chan,overlap3@2048+chan,zero_copy@all+chan
for n in 1 2 3; do echo "=== weights-$n"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/after timeout 100 $PY $W --variants $V --out "$OUT/weights-$n.json" > "$OUT/weights-$n.log" 2>&1
  echo "=== weights-$n rc=$? in $((SECONDS-t0)) s"; grep -E "^(overlap|zero_copy)[^ ]* +[a-z_]+ +[0-9]" "$OUT/weights-$n.log"
done
echo "=== done in $SECONDS s"
