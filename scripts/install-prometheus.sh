#!/usr/bin/env bash
# Install Debian's prometheus package (prometheus and promtool) for the operator-view tests, and print
# where the binaries are. Idempotent: with both binaries on PATH it only prints them.
#
#   eval "$(bash scripts/install-prometheus.sh)"   # COLOCD_PROMETHEUS, COLOCD_PROMTOOL
#
# stdout carries only the two NAME=value lines (scripts/test.sh parses them); progress goes to stderr.
# Exits non-zero with the reason on stderr when it cannot install (no apt-get, not root, no network):
# the tests that need Prometheus then skip and say why. The package's own service is never started;
# the tests run the binary on loopback with a data directory of their own.
set -euo pipefail

log() { echo "install-prometheus: $*" >&2; }
die() { log "IMPOSSIBLE: $*"; exit 1; }

found() { command -v prometheus >/dev/null && command -v promtool >/dev/null; }

if ! found; then
    command -v apt-get >/dev/null || die "no apt-get on this machine (install Prometheus >= 2.37 and promtool by hand)"
    [[ "$(id -u)" == "0" ]] || die "apt-get needs root (run as root, or install the prometheus package yourself)"
    log "installing Debian's prometheus package (apt-get; about a minute cold)"
    export DEBIAN_FRONTEND=noninteractive
    # policy-rc.d exit 101: the package's postinst must not start its own service on this machine.
    rcd=/usr/sbin/policy-rc.d
    made_rcd=0
    if [[ ! -e "${rcd}" ]]; then
        printf '#!/bin/sh\nexit 101\n' > "${rcd}" && chmod +x "${rcd}" && made_rcd=1
    fi
    rc=0
    { apt-get install -y -q --no-install-recommends prometheus >&2 \
        || { apt-get update -q >&2 && apt-get install -y -q --no-install-recommends prometheus >&2; }; } || rc=$?
    [[ "${made_rcd}" == "1" ]] && rm -f "${rcd}"
    [[ "${rc}" == "0" ]] || die "apt-get install prometheus failed (exit ${rc})"
    found || die "the prometheus package installed no prometheus/promtool on PATH"
fi
log "$(prometheus --version 2>&1 | head -1)"
echo "COLOCD_PROMETHEUS=$(command -v prometheus)"
echo "COLOCD_PROMTOOL=$(command -v promtool)"
