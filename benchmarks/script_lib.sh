# Shared by the benchmark scripts that run within one device call (gpu_serving.sh,
# gpu_pd.sh): source it after setting BUDGET (s) and RESERVE (s kept back for the end).
# It resolves OUT (required) and LOGDIR (a temp folder by default), moves to the
# checkout's root (python -m then runs this checkout's radixserve), and defines
# FAILED, `log MSG`, `fail WHAT LOG` (records it, prints the log's tail),
# `cap SECONDS` (SECONDS cut to what is left of BUDGET) and `has PART` (PART is
# in the space-separated PARTS), and puts the checkout first on PYTHONPATH.

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
