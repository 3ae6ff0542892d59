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
# The tiny Qwen2 model both engine tiers serve (scripts/build_tiny_qwen2.py, run by the engine venv's python);
# its RECIPE names the build, so a cached model is rebuilt only when the recipe changes.
build_tiny_model() {
    local py="$1" repo="$2" model="$3" recipe
    recipe="$(sed -n 's/^RECIPE = "\(.*\)"$/\1/p' "${repo}/scripts/build_tiny_qwen2.py")"
    if [[ "$(cat "${model}/colocd-recipe" 2>/dev/null)" == "${recipe}" ]]; then
        log "tiny model already at ${model}"
    else
        log "building the tiny Qwen2 model and tokenizer in ${model}"
        rm -rf "${model}"
        with_progress "building the tiny model" "${py}" "${repo}/scripts/build_tiny_qwen2.py" "${model}" 0 >&2 \
            || die "building the tiny model failed"
    fi
}
