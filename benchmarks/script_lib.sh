# Shared by the benchmark scripts that run within one device call (gpu_serving.sh,
# gpu_pd.sh): source it after setting BUDGET (s) and RESERVE (s kept back for the end).
# It resolves OUT (required) and LOGDIR (a temp folder by default), moves to the
# checkout's root (python -m then runs this checkout's radixserve), and defines
# FAILED, `log MSG`, `fail WHAT LOG` (records it, prints the log's tail),
# `cap SECONDS` (SECONDS cut to what is left of BUDGET), `has PART` (PART is
# in the space-separated PARTS) and `finish` (below), and puts the checkout
# first on PYTHONPATH.

: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOGDIR=${LOGDIR:-$(mktemp -d)}
mkdir -p "$LOGDIR" && LOGDIR=$(cd "$LOGDIR" && pwd)
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's radixserve, also for scripts run by path
FAILED=()

log() { echo "[$(date +%T) +${SECONDS}s] $*"; }
cap() { local l=$((BUDGET - SECONDS - RESERVE)); echo $(($1 < l ? $1 : l)); }
fail() { FAILED+=("$1"); log "FAILED $1; the end of $2:"; tail -n 25 "$2"; }
has() { [[ " ${PARTS:-} " == *" $1 "* ]]; }

# A script's last line: logs what failed, packs OUT's files into OUT/out.tar.gz
# when there are more than OUT_MAX_FILES (8: a remote runner may hand back only
# a few files of a call), and returns 1 when anything failed.
finish() {
    log "done in ${SECONDS}s; failed: ${FAILED[*]:-none}"
    local n tgz
    n=$(find "$OUT" -type f | wc -l)
    if ((n > ${OUT_MAX_FILES:-8})); then
        tgz=$(mktemp --suffix=.tar.gz)
        tar -czf "$tgz" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tgz" "$OUT/out.tar.gz" &&
            log "$n files packed into out.tar.gz (tar -xzf out.tar.gz)"
    fi
    ((${#FAILED[@]} == 0))
}
