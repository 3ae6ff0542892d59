#!/usr/bin/env bash
# Device call P of 2026-12-04: the ring per session (session_ring, WeightPusher's default against the reference
# engine). The GPU specs it touches (transports, IPC leases under an engine SIGKILL, ring refs, layouts); bench
# weights, the new defaults beside the old (overlap3@2048: fresh cuda_ipc buckets) and the best variant, twice;
# bench switch, tuned (now session_ring) beside tuned-fresh (the old cuda_ipc buckets) and seed-baseline.
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=python3 OUT=${OUT:-$(mktemp -d)}
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9
mkdir -p /tmp/after && ln -sfn "$PWD" /tmp/after/colocd
echo "=== gpu specs"; t0=$SECONDS
PYTHONPATH=/tmp/site:/tmp/after timeout 170 $PY -m pytest -q -p no:cacheprovider -o addopts=--import-mode=importlib -ra \
  tests/gpu/test_cuda_transports.py tests/gpu/test_ipc_leases.py tests/gpu/test_ring_refs.py tests/gpu/test_transport_layouts.py \
  > "$OUT/gpu-specs.log" 2>&1; echo "=== gpu specs rc=$? in $((SECONDS-t0)) s"; tail -5 "$OUT/gpu-specs.log"
W="-m colocd.cli bench weights --model qwen3-8b --device cuda --repeats 5 --verify off"
for n in 1 2; do echo "=== weights-$n"; t0=$SECONDS
  PYTHONPATH=/tmp/site:/tmp/after timeout 110 $PY $W --variants session_ring3@2048+chan,overlap3@2048+chan,zero_copy@all+chan \
    --out "$OUT/weights-$n.json" > "$OUT/weights-$n.log" 2>&1
  echo "=== weights-$n rc=$? in $((SECONDS-t0)) s"; grep -E "^(session_ring3|overlap3|zero_copy)" "$OUT/weights-$n.log"
done
echo "=== switch"; t0=$SECONDS
NCCL_COMM_SPLIT_SHARE_RESOURCES=1 PYTHONPATH=/tmp/site:/tmp/after timeout 230 $PY -m colocd.cli bench switch \
  --model qwen3-8b --device cuda --steps 2 --warmup 1 --rollout-s 2 --presets seed-baseline,tuned,tuned-fresh \
  --out "$OUT/switch.json" > "$OUT/switch.log" 2>&1
echo "=== switch rc=$? in $((SECONDS-t0)) s"; grep -A6 "^floor" "$OUT/switch.log"
echo "=== done in $SECONDS s"
