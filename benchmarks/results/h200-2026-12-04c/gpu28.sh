#!/usr/bin/env bash
# Device call W of 2026-12-04, on the code of ee69711 (+ the switch preset tuned-3x4096): (1) deeper windows of 4 GiB and 3 GiB buckets beside the
# defaults; (2) the same with every colocd process's GIL switch interval at 0.5 ms instead of Python's 5 ms (a
# sitecustomize on PYTHONPATH, inherited by the engine): does a thread that holds the GIL (the engine's model thread,
# the trainer's export thread) delay the event loops' replies and acks? Interleaved, two runs each; (3) bench switch
# with tuned beside tuned-3x4096.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after /tmp/sw "$OUT/w" && ln -sfn "$PWD" /tmp/after/colocd
printf 'import sys\nsys.setswitchinterval(0.0005)\n' > /tmp/sw/sitecustomize.py
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
V=overlap2@4096+chan,overlap3@4096+chan,overlap3@3072+chan,zero_copy@all+chan
weights() {  # $1: 5ms|0.5ms, $2: run number
  echo "=== weights-$1-$2"; local t0=$SECONDS extra=""
  [ "$1" = 0.5ms ] && extra=/tmp/sw:
  (cd /tmp && PYTHONPATH=$extra/tmp/site:/tmp/after timeout 120 $PY $W --variants $V --out "$OUT/w/weights-$1-$2.json" \
    > "$OUT/w/weights-$1-$2.log" 2>&1)
  echo "=== weights-$1-$2 rc=$? in $((SECONDS-t0)) s"
  grep -E "^(overlap|zero_copy)[^ ]* +[a-z_]+ +[0-9]|^variant +chunks|^(overlap|zero_copy)[^ ]* +[0-9]+ +[0-9]" "$OUT/w/weights-$1-$2.log"
}
weights 5ms 1; weights 0.5ms 1; weights 5ms 2; weights 0.5ms 2
echo "=== switch"; t0=$SECONDS
(cd /tmp && NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 200 $PY -m colocd.cli bench switch \
  --model qwen3-8b --device cuda --steps 2 --warmup 1 --rollout-s 2 --presets seed-baseline,tuned,tuned-3x4096 \
  --out "$OUT/w/switch.json" > "$OUT/w/switch.log" 2>&1)
echo "=== switch rc=$? in $((SECONDS-t0)) s"; grep -A5 "^floor" "$OUT/w/switch.log"
if [ $SECONDS -lt 380 ]; then weights 5ms 3; weights 0.5ms 3; fi
tar -C "$OUT" -czf "$OUT/callW.tgz" w && rm -rf "$OUT/w"
echo "=== done in $SECONDS s"
