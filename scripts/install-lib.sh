# Shared by the install scripts (sourced, not run): progress and errors on stderr, named by INSTALL_NAME.
log() { echo "${INSTALL_NAME}: $*" >&2; }
die() { log "IMPOSSIBLE: $*"; exit 1; }
# pip warns once per package about this machine's extra index folders that lack it; drop that noise.
pipq() { "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } >&2; }
# A long step (a cold engine install takes minutes) says every 15 s that it is still running, so CI logs
# and a waiting user never see minutes of silence.
with_progress() {
    local what="$1"; shift
    local t0=$SECONDS
    ( while sleep 15; do log "${what}: still running ($(( SECONDS - t0 )) s)"; done ) >&2 &
    local ticker=$!
    local rc=0
    "$@" || rc=$?
    kill "${ticker}" 2>/dev/null; wait "${ticker}" 2>/dev/null || true
    log "${what}: done in $(( SECONDS - t0 )) s"
    return "${rc}"
}
