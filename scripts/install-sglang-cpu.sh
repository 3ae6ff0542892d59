#!/usr/bin/env bash
# Install SGLang on CPU (version $COLOCD_SGLANG_VERSION, default 0.5.23, the newest tested) into its own venv, build
# a tiny Qwen2 model for it, and print the environment the SGLang tests need. Idempotent: a second run only
# re-checks (seconds). Tested versions: 0.5.20 (what verl pins) and 0.5.23 (docs/sglang.md, "Tested against").
#
#   set -a; eval "$(scripts/install-sglang-cpu.sh)"; set +a   # COLOCD_SGLANG_PYTHON, COLOCD_SGLANG_MODEL
#
# stdout carries only the three NAME=value lines (scripts/test.sh parses them); progress and errors go to
# stderr. Exits non-zero, with the reason on stderr, when the install is impossible (no python3.10+, no
# network/wheels, ...).
#
# What it installs (recipe and measurements: ../shared/research/sglang-cpu.md, docs/sglang.md):
# - sglang==<version> with --no-deps (its own requirements pin a CUDA torch and ~18 nvidia wheels), then only
#   the packages a CPU text-model launch imports; torch==2.13.0 (the CPU wheel) is pinned by a pip
#   constraint on every pip call, so nothing can swap it for a multi-GB CUDA build.
# - Two shims, for this test environment only (scripts/sglang_cpu_shims/): a stand-in `sgl_kernel` that
#   registers no torch ops (SGLang then takes its plain-torch paths) plus the one op a text model calls,
#   and a `sitecustomize` that defines torchvision's two op schemas so its CUDA wheel imports. With them a
#   plain `SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --device cpu ...` serves.
#
# Where: $COLOCD_SGLANG_HOME (default ~/.cache/colocd/sglang-<version>, one per version;
# $COLOCD_ENGINE_CACHE moves the folder that holds them) holds venv/ and tiny-qwen2/.
set -euo pipefail

SGLANG_VERSION="${COLOCD_SGLANG_VERSION:-0.5.23}"
HOME_DIR="${COLOCD_SGLANG_HOME:-${COLOCD_ENGINE_CACHE:-${HOME}/.cache/colocd}/sglang-${SGLANG_VERSION}}"
VENV="${HOME_DIR}/venv"
MODEL="${HOME_DIR}/tiny-qwen2"
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHIMS="${REPO}/scripts/sglang_cpu_shims"
PY="${VENV}/bin/python"
CONSTRAINT="${HOME_DIR}/constraints.txt"

# What a CPU text-model launch imports, beside torch and sglang (sglang-cpu.md, "What it takes", item 1).
# triton is imported unconditionally and imports fine without a GPU; torchvision goes in with --no-deps.
RUNTIME=(triton==3.6.0 numpy psutil requests fastapi "uvicorn>=0.51" orjson pybase64 msgspec "pyzmq>=25.1.2"
         transformers==5.19.0 tokenizers==0.23.2 safetensors pydantic packaging tqdm aiohttp setproctitle uvloop
         prometheus-client pillow ipython dill apache-tvm-ffi==0.1.11 sentencepiece==0.2.1 gguf openai==2.8.0
         compressed-tensors==0.18.0 partial-json-parser einops jsonschema xgrammar==0.2.7 soundfile
         python-multipart)

INSTALL_NAME=install-sglang-cpu
# shellcheck source=scripts/install-lib.sh
source "${REPO}/scripts/install-lib.sh"
pip_c() { pipq "${VENV}/bin/pip" install -q -c "${CONSTRAINT}" "$@"; }

start=$(date +%s)
mkdir -p "${HOME_DIR}" || die "cannot create ${HOME_DIR}"
BASE_PY="${COLOCD_SGLANG_BASE_PYTHON:-python3}"
command -v "${BASE_PY}" >/dev/null || die "no ${BASE_PY} on PATH"
"${BASE_PY}" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || die "${BASE_PY} is older than 3.10"
printf '%s\n' "torch==2.13.0" "torchvision==0.28.0" > "${CONSTRAINT}"

installed_ok() {
    [[ -x "${PY}" ]] && "${PY}" - "${SGLANG_VERSION}" <<'EOF2' 2>/dev/null
import importlib.metadata as md, importlib.util as u, sys
ok = md.version("sglang") == sys.argv[1] and md.version("torch").startswith("2.13.0")
ok = ok and md.version("torchvision") == "0.28.0"
# CUDA-only packages must be absent: a real sgl-kernel would fight the shim, flashinfer and
# torch_memory_saver mean --no-deps was lost somewhere.
def present(dist):
    try:
        md.version(dist)
        return True
    except md.PackageNotFoundError:
        return False
ok = ok and not any(present(d) for d in ("sgl-kernel", "sglang-kernel", "flashinfer-python", "torch-memory-saver"))
sys.exit(0 if ok else 1)
EOF2
}

if installed_ok; then
    log "sglang ${SGLANG_VERSION} already installed in ${VENV}"
else
    log "creating ${VENV} and installing sglang==${SGLANG_VERSION} for CPU (3-7 min cold)"
    rm -rf "${VENV}"
    "${BASE_PY}" -m venv "${VENV}" || die "python -m venv failed"
    pipq "${VENV}/bin/pip" install -q -U pip || die "cannot upgrade pip in the venv"
    # torch==2.13.0+cpu resolves only from the machine's local wheel folder (pip config find-links).
    with_progress "pip install torch==2.13.0" pip_c torch==2.13.0 \
        || die "pip install torch==2.13.0 failed (the CPU wheel must come from a local find-links folder)"
    with_progress "pip install SGLang's CPU runtime imports" pip_c "${RUNTIME[@]}" \
        || die "installing SGLang's runtime imports failed"
    with_progress "pip install --no-deps sglang==${SGLANG_VERSION} torchvision==0.28.0" \
        pip_c --no-deps "sglang==${SGLANG_VERSION}" torchvision==0.28.0 \
        || die "pip install --no-deps sglang==${SGLANG_VERSION} failed"
    installed_ok || die "sglang installed but the version check failed (torch $("${PY}" -c 'import torch; print(torch.__version__)' 2>&1))"
fi

# The shims (test environment only), copied on every run so the venv always has this checkout's.
site="$("${PY}" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -rf "${site}/sgl_kernel"
cp -r "${SHIMS}/sgl_kernel" "${site}/sgl_kernel"
cp "${SHIMS}/sitecustomize.py" "${site}/sitecustomize.py"
# The server's import check costs ~20 s, so it runs once per install and shim version (the stamp).
shims_stamp="$(cat "${SHIMS}/sgl_kernel/__init__.py" "${SHIMS}/sitecustomize.py" | sha256sum | cut -c1-16)"
if [[ "$(cat "${VENV}/.colocd-shims" 2>/dev/null)" != "${shims_stamp}" ]]; then
    log "checking that sglang's server imports on the CPU engine"
    SGLANG_USE_CPU_ENGINE=1 with_progress "import sglang.launch_server" "${PY}" -W ignore -c \
        'import sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler, sglang.srt.mem_cache.allocation' \
        >&2 || die "sglang does not import on the CPU engine (see above)"
    echo "${shims_stamp}" > "${VENV}/.colocd-shims"
fi

build_tiny_model "${PY}" "${REPO}" "${MODEL}"

log "ready in $(( $(date +%s) - start )) s: python ${PY}, model ${MODEL}"
echo "COLOCD_SGLANG_PYTHON=${PY}"
echo "COLOCD_SGLANG_MODEL=${MODEL}"
echo "COLOCD_SGLANG_VERSION=${SGLANG_VERSION}"
