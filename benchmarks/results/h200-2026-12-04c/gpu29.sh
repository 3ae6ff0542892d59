#!/usr/bin/env bash
# Device call X of 2026-12-04, on the code of eb6c0bd: the defaults beside the best variant, six runs on one machine.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after "$OUT/x" && ln -sfn "$PWD" /tmp/after/colocd
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
V=overlap2@4096+chan,zero_copy@all+chan
for run in 1 2 3 4 5 6; do
  [ $SECONDS -lt 400 ] || break
  echo "=== weights-$run"; t0=$SECONDS
  (cd /tmp && PYTHONPATH=/tmp/site:/tmp/after timeout 100 $PY $W --variants $V --out "$OUT/x/weights-$run.json" \
    > "$OUT/x/weights-$run.log" 2>&1)
  echo "=== weights-$run rc=$? in $((SECONDS-t0)) s"
  grep -E "^(overlap|zero_copy)[^ ]* +[a-z_]+ +[0-9]" "$OUT/x/weights-$run.log"
done
tar -C "$OUT" -czf "$OUT/callX.tgz" x && rm -rf "$OUT/x"
echo "=== done in $SECONDS s"
