#!/usr/bin/env bash
# E5: serving benchmarks on one GPU, in one call, within BUDGET seconds (~8 min).
#   W4  generated shared prefix, all at once: radix cache on (lpm), on (fcfs), off
#   W5  random 1024 in / 256 out, Poisson at W5_RATES req/s, goodput at TTFT 1 s / TPOT 50 ms
#
#   OUT=/some/dir benchmarks/gpu_serving.sh
#
# radixserve's dependencies must be importable (e.g. the wheelhouse installed with
# --target and PYTHONPATH set, README "Offline / air-gapped install"); the code run
# is this checkout's. $OUT receives 8 files (the most a device run sends back):
# w4-{lpm,fcfs,nocache}.json, w4-compare.png, w4-latency.png, w5.json,
# w5-latency.png, w5-rates.png. Server and bench logs go to LOGDIR (a temp folder);
# a failed piece prints the tail of its log. Every piece gets a timeout cut to what
# is left of BUDGET; a bench stopped early still writes its finished requests
# ("interrupted": true). CPU smoke test (about a minute, mostly server start-ups):
#   MODEL=tiny-llama ATTN=torch_native DTYPE=float32 W4_GROUPS=2 W4_PER_GROUP=4 W4_PREFIX=64 \
#   W4_QUESTION=16 W4_OUTPUT=8 W5_PROMPTS=8 W5_INPUT=32 W5_OUTPUT=8 OUT=e5-smoke benchmarks/gpu_serving.sh
set -uo pipefail

MODEL=${MODEL:-llama-3.1-8b} ATTN=${ATTN:-triton} DTYPE=${DTYPE:-bfloat16} PORT=${PORT:-31000}
SERVER_ARGS=${SERVER_ARGS:-}          # more server flags, e.g. "--mem-fraction-static 0.85"
W4_GROUPS=${W4_GROUPS:-64} W4_PER_GROUP=${W4_PER_GROUP:-16} W4_PREFIX=${W4_PREFIX:-2048}
W4_QUESTION=${W4_QUESTION:-128} W4_OUTPUT=${W4_OUTPUT:-256}
W5_PROMPTS=${W5_PROMPTS:-128} W5_RATES=${W5_RATES:-4 8 16} W5_INPUT=${W5_INPUT:-1024} W5_OUTPUT=${W5_OUTPUT:-256}
BUDGET=${BUDGET:-470} START_TIMEOUT=${START_TIMEOUT:-240} W4_TIMEOUT=${W4_TIMEOUT:-150} W5_TIMEOUT=${W5_TIMEOUT:-150}
RESERVE=60                            # s kept back to stop a server and plot after the last piece
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail
SERVER_PID=

start_server() {  # NAME FLAGS...: start, wait for /health
    local name=$1 t; shift
    t=$(cap "$START_TIMEOUT")
    ((t >= 30)) || { FAILED+=("$name (no time left)"); return 1; }
    log "server $name: $*"
    setsid "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy --attention-backend "$ATTN" \
        --dtype "$DTYPE" --port "$PORT" $SERVER_ARGS "$@" >"$LOGDIR/server-$name.log" 2>&1 &
    SERVER_PID=$!
    local deadline=$((SECONDS + t))
    while ((SECONDS < deadline)); do
        kill -0 "$SERVER_PID" 2>/dev/null || { fail "server $name (exited)" "$LOGDIR/server-$name.log"; SERVER_PID=; return 1; }
        "$PY" -c "import sys, urllib.request as u; u.urlopen(sys.argv[1], timeout=2)" \
            "http://127.0.0.1:$PORT/health" 2>/dev/null && { log "server $name healthy"; return 0; }
        sleep 1
    done
    fail "server $name (not healthy after ${t}s)" "$LOGDIR/server-$name.log"; stop_server; return 1
}

stop_server() {  # SIGTERM and wait; kill the process group if it hangs
    [[ -n $SERVER_PID ]] || return 0
    kill -TERM "$SERVER_PID" 2>/dev/null
    for ((i = 0; i < 30; i++)); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 1; done
    kill -0 "$SERVER_PID" 2>/dev/null && { log "server did not stop: SIGKILL"; kill -KILL -- "-$SERVER_PID"; }
    wait "$SERVER_PID" 2>/dev/null; SERVER_PID=
}
trap stop_server EXIT

bench() {  # NAME TIMEOUT ARGS...: one bench.serving run into $OUT/NAME.json
    local name=$1 t; t=$(cap "$2"); shift 2
    ((t >= 10)) || { FAILED+=("$name (no time left)"); return 1; }
    log "bench $name (timeout ${t}s)"
    timeout -s INT -k 20 "$t" "$PY" -m radixserve.bench.serving --port "$PORT" --disable-tqdm \
        --output-json "$OUT/$name.json" "$@" >"$LOGDIR/$name.log" 2>&1
    case $? in
        0) ;;
        124) FAILED+=("$name (timed out)"); log "bench $name timed out: the JSON holds the requests that finished" ;;
        *) fail "bench $name" "$LOGDIR/$name.log" ;;
    esac
}

W4=(--dataset-name generated-shared-prefix --gsp-num-groups "$W4_GROUPS" --gsp-prompts-per-group "$W4_PER_GROUP"
    --gsp-system-prompt-len "$W4_PREFIX" --gsp-question-len "$W4_QUESTION" --gsp-output-len "$W4_OUTPUT"
    --request-rate inf --save-requests)

log "E5: model $MODEL, $ATTN, $DTYPE; budget ${BUDGET}s; logs in $LOGDIR"
"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu')"

start_server lpm --schedule-policy lpm && bench w4-lpm "$W4_TIMEOUT" "${W4[@]}" --label "cache on, lpm"
stop_server
if start_server fcfs --schedule-policy fcfs; then
    # W5 first: a W4 run cut short would leave its aborted tail on the server. Its own
    # seed keeps its random ids from sharing prefixes with W4's if a flush is refused.
    # shellcheck disable=SC2086  # W5_RATES is a list
    bench w5 "$W5_TIMEOUT" --dataset-name random --num-prompts "$W5_PROMPTS" --random-input-len "$W5_INPUT" \
        --random-output-len "$W5_OUTPUT" --random-range-ratio 1 --request-rate $W5_RATES --seed 3 \
        --slo-ttft 1000 --slo-tpot 50 --plot --label "W5"
    bench w4-fcfs "$W4_TIMEOUT" "${W4[@]}" --label "cache on, fcfs"
fi
stop_server
start_server nocache --disable-radix-cache && bench w4-nocache "$W4_TIMEOUT" "${W4[@]}" --label "cache off"
stop_server

w4_files=("$OUT"/w4-*.json)
if [[ -e ${w4_files[0]} ]]; then
    "$PY" -m radixserve.bench.serving --compare "${w4_files[@]}" --plot "$OUT/w4" >"$LOGDIR/w4-compare.log" 2>&1 ||
        fail "w4 plots" "$LOGDIR/w4-compare.log"
fi
compgen -G "$OUT/*.json" >/dev/null && "$PY" -m radixserve.bench.serving_report "$OUT"/*.json
ls -l "$OUT"
finish
