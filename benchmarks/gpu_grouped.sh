#!/usr/bin/env bash
# E16: prefix-grouped decode on one GPU, in one call. PARTS picks what runs, in this order:
#   tests   the grouped decode's GPU tests and the Triton backend's -> gpu-tests.txt
#   kernel  benchmarks/grouped_decode_kernel.py: one layer's decode attention, plain and
#           grouped, at W4's shape and others -> kernel.jsonl
#   w4      W4 (bench.serving's generated shared prefix, all at once, lpm) against servers
#           started with each line of W4_CONFIGS in turn -> w4-<n>.json, w4.txt
#
#   OUT=/some/dir PARTS="tests kernel w4" benchmarks/gpu_grouped.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and
# PYTHONPATH set). CPU smoke test (W4 scaled down): PARTS=w4 MODEL=tiny-llama ATTN=torch_native
# DTYPE=float32 W4_GROUPS=2 W4_PER_GROUP=4 W4_PREFIX=64 W4_QUESTION=16 W4_OUTPUT=8 OUT=e16-smoke \
# benchmarks/gpu_grouped.sh
set -uo pipefail

PARTS=${PARTS:-tests kernel w4} MODEL=${MODEL:-llama-3.1-8b} ATTN=${ATTN:-triton} DTYPE=${DTYPE:-bfloat16}
PORT=${PORT:-31000} START_TIMEOUT=${START_TIMEOUT:-240} BUDGET=${BUDGET:-570} RESERVE=10
W4_GROUPS=${W4_GROUPS:-64} W4_PER_GROUP=${W4_PER_GROUP:-16} W4_PREFIX=${W4_PREFIX:-2048}
W4_QUESTION=${W4_QUESTION:-128} W4_OUTPUT=${W4_OUTPUT:-256} W4_TIMEOUT=${W4_TIMEOUT:-120}
# one server per line: its flags beyond the model's
W4_CONFIGS=${W4_CONFIGS:-"--schedule-policy lpm
--schedule-policy lpm --enable-prefix-grouped-decode"}
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail, has
# shellcheck source=benchmarks/server_lib.sh
source benchmarks/server_lib.sh  # SERVER_PID, stop_server, wait_healthy

if has tests; then
    log "GPU tests"
    timeout "$(cap 240)" "$PY" -m pytest -q tests/test_gpu_prefix_grouped_decode.py tests/test_triton_backend.py \
        >"$OUT/gpu-tests.txt" 2>&1 || fail "tests" "$OUT/gpu-tests.txt"
    tail -n 3 "$OUT/gpu-tests.txt"
fi
if has kernel; then
    log "kernel"
    timeout "$(cap 120)" "$PY" benchmarks/grouped_decode_kernel.py >"$OUT/kernel.jsonl" 2>"$LOGDIR/kernel.log" ||
        fail "kernel" "$LOGDIR/kernel.log"
    cat "$OUT/kernel.jsonl"
fi
if has w4; then
    n=0
    while IFS= read -r flags; do
        [[ -n $flags ]] || continue
        n=$((n + 1))
        log "W4 server $n: $flags"
        # shellcheck disable=SC2086  # flags is a list
        setsid "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy --attention-backend "$ATTN" \
            --dtype "$DTYPE" --port "$PORT" $flags >"$LOGDIR/server-$n.log" 2>&1 &
        SERVER_PID=$!
        START_TIMEOUT=$(cap "$START_TIMEOUT") wait_healthy "$LOGDIR/server-$n.log" || { FAILED+=("server $n"); continue; }
        timeout -s INT -k 20 "$(cap "$W4_TIMEOUT")" "$PY" -m radixserve.bench.serving --port "$PORT" --disable-tqdm \
            --dataset-name generated-shared-prefix --gsp-num-groups "$W4_GROUPS" --gsp-prompts-per-group "$W4_PER_GROUP" \
            --gsp-system-prompt-len "$W4_PREFIX" --gsp-question-len "$W4_QUESTION" --gsp-output-len "$W4_OUTPUT" \
            --request-rate inf --label="$flags" --output-json "$OUT/w4-$n.json" >"$LOGDIR/w4-$n.log" 2>&1 ||
            fail "w4 $n" "$LOGDIR/w4-$n.log"
        stop_server
    done <<<"$W4_CONFIGS"
    "$PY" - "$OUT" <<'PYEOF' | tee "$OUT/w4.txt"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "w4-*.json"))):
    d = json.load(open(path))
    for r in d["runs"]:
        print(f"{os.path.basename(path)} [{r.get('label', d.get('label'))}] ok {r['completed']}/{r['completed'] + r['failed']}"
              f"  out {r['output_throughput']:.0f} tok/s  TTFT p50 {r['ttft_ms']['median']:.0f} ms"
              f"  ITL p50/p99 {r['itl_ms']['median']:.1f}/{r['itl_ms']['p99']:.1f} ms"
              f"  hit {r.get('cache_hit_rate')}  peak running {r.get('peak_running_requests')}"
              f"  peak KV {r.get('peak_kv_usage')}")
PYEOF
fi
finish
