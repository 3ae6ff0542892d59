#!/usr/bin/env bash
# Final device call of the session: issue 29's levers and issue 28's before/after, same machine, same run.
# Order = priority (what is left under $OUT comes back even if the call runs out of time).
set -uo pipefail
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
PY=${PY:-python3} DEVICE=${DEVICE:-cuda} MODEL=${MODEL:-qwen3-8b} OUT=${OUT:-$(mktemp -d)}
[ "$DEVICE" = cuda ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 9; }
mkdir -p /tmp/after /tmp/before && ln -sfn "$PWD" /tmp/after/colocd && ln -sfn "$PWD/.devcarry/before" /tmp/before/colocd
step() { local name=$1 t=$2 tree=$3; shift 3; echo "=== $name ($tree): $*"; local t0=$SECONDS;
  PYTHONPATH=/tmp/site:/tmp/$tree timeout "$t" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 45; echo "=== $name rc=${PIPESTATUS[0]} in $((SECONDS-t0)) s"; }
if [ "$DEVICE" = cuda ]; then R=3 SW=(--steps 2 --warmup 1 --rollout-s 2) ROWS=4,16,32
else R=1 SW=(--steps 1 --warmup 1 --groups 2 --train-tokens 8 --gen-tokens 4 --post-destroy-wait-s 0) ROWS=16; fi
PYTHONPATH=/tmp/site:/tmp/after $PY -c 'import torch, colocd; print(torch.__version__, torch.cuda.is_available() and torch.cuda.get_device_name(0))'
step switch-after2 150 after $PY -m colocd.cli bench switch --model $MODEL --device $DEVICE "${SW[@]}" --presets seed-baseline,tuned,tuned-onload2 --out "$OUT/switch-after2.json"
echo "=== done in $SECONDS s"
