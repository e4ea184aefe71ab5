#!/usr/bin/env bash
# E10: prefill/decode disaggregation on two GPUs of one host, in one call, within BUDGET seconds.
#   kv-transfer.json  the KV transfer against the NCCL p2p ceiling between the two GPUs
#                     (python -m radixserve.bench.kv_transfer; docs/disaggregation.md)
#   w5-pd.json        W5 (random 1024 in / 256 out, Poisson at W5_RATES req/s, goodput at TTFT 1 s /
#                     TPOT 50 ms) through sglang-router --pd-disaggregation: a prefill server on
#                     GPU 0, a decode server on GPU 1
#   w5-replicas.json  W5 at the same rates through sglang-router over two colocated servers, one a GPU
#
#   OUT=/some/dir benchmarks/gpu_pd.sh            # PIECES="transfer pd replicas" picks the pieces
#
# radixserve's dependencies, aiohttp and sglang-router must be importable: a wheelhouse from
# scripts/build_wheelhouse.py with `--package aiohttp --package sglang-router` (the router's wheel
# and its dependencies; without `--extras bench`, whose plotting wheels would not leave room in
# a device call's 64 MiB), installed with --target and PYTHONPATH set. Logs go to LOGDIR (a temp
# folder); a failed piece prints the tail of its log. CPU smoke test (tiny model, gloo; a minute):
#   DEVICE=cpu MODEL=tiny-llama ATTN=torch_native DTYPE=float32 W5_PROMPTS=8 W5_INPUT=32 W5_OUTPUT=8 \
#   W5_RATES=4 TRANSFER_ARGS="--requests 2 --tokens 32 --layers 2 --kv-heads 2 --head-dim 8 --dtype float32 --p2p-mib 4" \
#   OUT=pd-smoke benchmarks/gpu_pd.sh
set -uo pipefail

MODEL=${MODEL:-llama-3.1-8b} ATTN=${ATTN:-triton} DTYPE=${DTYPE:-bfloat16} DEVICE=${DEVICE:-cuda}
SERVER_ARGS=${SERVER_ARGS:-}          # more flags for every server, e.g. "--mem-fraction-static 0.85"
PIECES=${PIECES:-transfer pd replicas} TRANSFER_ARGS=${TRANSFER_ARGS:-}
W5_PROMPTS=${W5_PROMPTS:-600} W5_RATES=${W5_RATES:-16 24 32} W5_INPUT=${W5_INPUT:-1024} W5_OUTPUT=${W5_OUTPUT:-256}
BUDGET=${BUDGET:-560} START_TIMEOUT=${START_TIMEOUT:-240} W5_TIMEOUT=${W5_TIMEOUT:-200}
PORT_A=31000 PORT_B=31001 ROUTER_PORT=31100 BOOTSTRAP_PORT=31200
RESERVE=30                            # s kept back to stop the servers after the last piece
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail
PIDS=()

start() {  # NAME CMD...: in its own process group, logged to LOGDIR/NAME.log
    local name=$1; shift
    log "start $name: $*"
    setsid "$@" >"$LOGDIR/$name.log" 2>&1 &
    PIDS+=($!)
}

stop_all() {  # SIGTERM every process group started, wait, then SIGKILL what is left
    ((${#PIDS[@]})) || return 0
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    for ((i = 0; i < 40; i++)); do
        local alive=0
        for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
        ((alive)) || break
        sleep 1
    done
    for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; wait "$pid" 2>/dev/null; done
    PIDS=()
}
trap stop_all EXIT

server() {  # NAME PORT GPU FLAGS...
    local name=$1 port=$2 gpu=$3; shift 3
    start "$name" "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy --attention-backend "$ATTN" \
        --dtype "$DTYPE" --device "$DEVICE" --base-gpu-id "$gpu" --port "$port" $SERVER_ARGS "$@"
}

wait_ready() {  # NAME URL [KEY]: until URL answers 200 (with a JSON body whose KEY is not empty), or the time is up
    local name=$1 url=$2 key=${3:-} deadline=$((SECONDS + $(cap "$START_TIMEOUT")))
    until "$PY" -c "import json, sys, urllib.request as u; body = u.urlopen(sys.argv[1], timeout=2).read()
sys.exit(bool(sys.argv[2]) and not json.loads(body).get(sys.argv[2]))" "$url" "$key" 2>/dev/null; do
        for pid in "${PIDS[@]}"; do
            kill -0 "$pid" 2>/dev/null || { fail "$name (a process exited)" "$LOGDIR/$name.log"; return 1; }
        done
        ((SECONDS < deadline)) || { fail "$name (not ready)" "$LOGDIR/$name.log"; return 1; }
        sleep 1
    done
    log "$name ready"
}

w5() {  # NAME LABEL WORKER_URLS...: W5 through the router into $OUT/NAME.json
    local name=$1 label=$2 t; shift 2; t=$(cap "$W5_TIMEOUT")
    ((t >= 10)) || { FAILED+=("$name (no time left)"); return 1; }
    log "bench $name (timeout ${t}s)"
    # shellcheck disable=SC2086  # W5_RATES is a list
    timeout -s INT -k 20 "$t" "$PY" -m radixserve.bench.serving --port "$ROUTER_PORT" --disable-tqdm \
        --output-json "$OUT/$name.json" --worker-urls "$@" --dataset-name random --num-prompts "$W5_PROMPTS" \
        --random-input-len "$W5_INPUT" --random-output-len "$W5_OUTPUT" --random-range-ratio 1 \
        --request-rate $W5_RATES --seed 3 --slo-ttft 1000 --slo-tpot 50 --label "$label" >"$LOGDIR/$name.log" 2>&1
    case $? in
        0) ;;
        124) FAILED+=("$name (timed out)"); log "bench $name timed out: the JSON holds the requests that finished" ;;
        *) fail "bench $name" "$LOGDIR/$name.log" ;;
    esac
}

router() {  # ARGS...: sglang-router on ROUTER_PORT
    start router "$PY" -m sglang_router.launch_router --host 127.0.0.1 --port "$ROUTER_PORT" --policy round_robin \
        --prometheus-host 127.0.0.1 --prometheus-port $((ROUTER_PORT + 1)) --log-level warn "$@"
    wait_ready router "http://127.0.0.1:$ROUTER_PORT/v1/models" data  # a model listed: a worker is healthy
}

A=http://127.0.0.1:$PORT_A B=http://127.0.0.1:$PORT_B
log "E10 on $DEVICE: model $MODEL, $ATTN, $DTYPE; pieces: $PIECES; budget ${BUDGET}s; logs in $LOGDIR"
"$PY" -c "import torch; print('torch', torch.__version__, [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])"

if [[ " $PIECES " == *" transfer "* ]]; then
    devices=cuda:0,cuda:1; [[ $DEVICE == cpu ]] && devices=cpu,cpu
    log "kv transfer on $devices"
    # shellcheck disable=SC2086  # TRANSFER_ARGS is a list of flags
    timeout "$(cap 180)" "$PY" -m radixserve.bench.kv_transfer --devices "$devices" $TRANSFER_ARGS \
        >"$OUT/kv-transfer.json" 2>"$LOGDIR/kv-transfer.log" || fail "kv transfer" "$LOGDIR/kv-transfer.log"
    cat "$OUT/kv-transfer.json"; echo
fi

if [[ " $PIECES " == *" pd "* ]]; then
    server prefill "$PORT_A" 0 --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
    server decode "$PORT_B" 1 --disaggregation-mode decode
    if wait_ready prefill "$A/health" && wait_ready decode "$B/health" &&
        router --pd-disaggregation --prefill "$A" "$BOOTSTRAP_PORT" --decode "$B"; then
        w5 w5-pd "W5, 1 prefill + 1 decode" "$A" "$B"
    fi
    stop_all
fi

if [[ " $PIECES " == *" replicas "* ]]; then
    server replica-0 "$PORT_A" 0
    server replica-1 "$PORT_B" 1
    if wait_ready replica-0 "$A/health" && wait_ready replica-1 "$B/health" && router --worker-urls "$A" "$B"; then
        w5 w5-replicas "W5, 2 colocated replicas" "$A" "$B"
    fi
    stop_all
fi

compgen -G "$OUT/w5-*.json" >/dev/null && "$PY" -m radixserve.bench.serving_report "$OUT"/w5-*.json
ls -l "$OUT"
finish
