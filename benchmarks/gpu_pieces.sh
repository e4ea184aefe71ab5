#!/usr/bin/env bash
# E7: piecewise CUDA graphs for extends (on by default; --disable-piecewise-cuda-graph) on one GPU, in one call,
# within BUDGET seconds. PIECES picks what runs, in this order:
#   tests    the GPU tests (their engine and mixed-chunk tests replay pieces) -> gpu-tests.txt
#   prefill  bench.one_batch's prefill latency at W3's shapes scaled to PREFILL_LENS tokens a
#            request and PREFILL_BS requests, eager extends then pieces, one process each
#            -> prefill.jsonl (each line's "piecewise_cuda_graph" says which)
#   fp8      the decode kernel over bf16 and fp8 pools (benchmarks/decode_attention_sweep.py, W2's and
#            W5's batches, a few launch configs) and W2 (bench.one_batch) with --kv-cache-dtype auto
#            and fp8_e4m3 -> sweep.jsonl, w2.jsonl (each line names its kv_cache_dtype)
#   quant    --quantization fp8 against bf16 linear layers: the GEMMs alone (bench.fp8_gemm), then
#            W2 and W3 (bench.one_batch, QUANT_W3_LEN tokens a request) with each -> gemm.jsonl,
#            w2.jsonl, w3.jsonl (each line names its quantization)
#   w5       W5 (random 1024 in / 256 out, Poisson at W5_RATES req/s, goodput at TTFT 1 s /
#            TPOT 50 ms) against one server per configuration of W5_CONFIGS
#            ("label=flags;label=flags", W5_PROMPTS requests a rate; W5_CLIENT_ARGS adds bench.serving
#            options, e.g. --save-requests; NAME=value words among the flags go into the server's
#            environment, e.g. RADIXSERVE_CACHED_LAUNCH=0) -> w5-1.json, w5-2.json, ...
#
#   OUT=/some/dir benchmarks/gpu_pieces.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and
# PYTHONPATH set); the tests need pytest. Logs go to LOGDIR (a temp folder); a failed piece
# prints the tail of its log. CPU smoke test (the pieces stay eager there; a minute):
#   PIECES="prefill w5" MODEL=tiny-llama PREFILL_LENS=32 PREFILL_BS="1 2" W5_PROMPTS=8 W5_RATES=4 \
#   W5_INPUT=32 W5_OUTPUT=8 W5_CONFIGS="plain=--device cpu" OUT=pieces-smoke benchmarks/gpu_pieces.sh
set -uo pipefail

MODEL=${MODEL:-llama-3.1-8b} PIECES=${PIECES:-tests prefill w5}
PREFILL_LENS=${PREFILL_LENS:-128 512} PREFILL_BS=${PREFILL_BS:-1 2 4 8}
W5_PROMPTS=${W5_PROMPTS:-1000} W5_RATES=${W5_RATES:-12 16 20 24} W5_INPUT=${W5_INPUT:-1024} W5_OUTPUT=${W5_OUTPUT:-256}
W5_CLIENT_ARGS=${W5_CLIENT_ARGS:-}
W5_CONFIGS=${W5_CONFIGS:-"mixed 512, eager=--enable-mixed-chunk --chunked-prefill-size 512 --disable-piecewise-cuda-graph;mixed 512=--enable-mixed-chunk --chunked-prefill-size 512"}
BUDGET=${BUDGET:-570} START_TIMEOUT=${START_TIMEOUT:-240} TESTS_TIMEOUT=${TESTS_TIMEOUT:-330}
RESERVE=20                            # s kept back to stop a server after the last piece
PY=${PYTHON:-python3} PORT=${PORT:-31000}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail
# shellcheck source=benchmarks/server_lib.sh
source benchmarks/server_lib.sh        # SERVER_PID, stop_server, wait_healthy

run_tests() {
    local t; t=$(cap "$TESTS_TIMEOUT")
    log "GPU tests (timeout ${t}s)"
    timeout -k 20 "$t" "$PY" -m pytest -q -m gpu -p no:cacheprovider -s --ignore=tests/test_openai_protocol.py \
        --ignore=tests/test_server_openai.py --ignore=tests/test_structured_output.py \
        --ignore=tests/test_openai_tools.py >"$LOGDIR/tests.log" 2>&1 || FAILED+=("tests")
    grep -E "logprob \|diff\||passed|failed|Error" "$LOGDIR/tests.log" | tail -40 | tee "$OUT/gpu-tests.txt"
}

run_prefill() {
    local mode flags len t
    for mode in eager pieces; do
        flags=(); [[ $mode == eager ]] && flags=(--disable-piecewise-cuda-graph)
        for len in $PREFILL_LENS; do
            t=$(cap 200); ((t >= 30)) || { FAILED+=("prefill $mode $len (no time left)"); continue; }
            log "prefill, $mode, $len tokens a request"
            timeout -k 10 "$t" "$PY" -m radixserve.bench.one_batch --workload W3 --model-path "$MODEL" --load-format dummy \
                --batch-sizes $PREFILL_BS --input-len "$len" "${flags[@]}" --output-json "$LOGDIR/prefill-$mode.jsonl" \
                >"$LOGDIR/prefill-$mode-$len.log" 2>&1 || fail "prefill $mode $len" "$LOGDIR/prefill-$mode-$len.log"
            grep -h "captured" "$LOGDIR/prefill-$mode-$len.log" | tail -2
        done
        [[ -f $LOGDIR/prefill-$mode.jsonl ]] && cat "$LOGDIR/prefill-$mode.jsonl" >>"$OUT/prefill.jsonl"
    done
}

run_fp8() {
    local kv t
    for kv in bf16 fp8_e4m3; do
        t=$(cap 150); ((t >= 30)) || { FAILED+=("fp8 sweep $kv (no time left)"); continue; }
        log "decode kernel sweep, $kv pool"
        timeout -k 10 "$t" "$PY" benchmarks/decode_attention_sweep.py --kv-cache-dtype "$kv" \
            --cases w2-llama-8b-bs256 w5-llama-8b-bs448 --block-n 64 128 --num-warps 4 --num-stages 2 3 \
            >>"$OUT/sweep.jsonl" 2>"$LOGDIR/sweep-$kv.log" || fail "fp8 sweep $kv" "$LOGDIR/sweep-$kv.log"
    done
    for kv in auto fp8_e4m3; do
        t=$(cap 150); ((t >= 30)) || { FAILED+=("fp8 w2 $kv (no time left)"); continue; }
        log "W2, --kv-cache-dtype $kv"
        timeout -k 10 "$t" "$PY" -m radixserve.bench.one_batch --workload W2 --model-path "$MODEL" --load-format dummy \
            --kv-cache-dtype "$kv" --output-json "$OUT/w2.jsonl" >"$LOGDIR/w2-$kv.log" 2>&1 || fail "fp8 w2 $kv" "$LOGDIR/w2-$kv.log"
    done
}

run_quant() {
    local q t w flags
    t=$(cap 120); log "fp8 GEMMs (timeout ${t}s)"
    timeout -k 10 "$t" "$PY" -m radixserve.bench.fp8_gemm >"$OUT/gemm.jsonl" 2>"$LOGDIR/gemm.log" || fail "fp8 gemm" "$LOGDIR/gemm.log"
    for w in W2 W3; do
        for q in none fp8; do
            t=$(cap 150); ((t >= 40)) || { FAILED+=("quant $w $q (no time left)"); continue; }
            flags=(); [[ $q == fp8 ]] && flags=(--quantization fp8)
            [[ $w == W3 ]] && flags+=(--input-len "${QUANT_W3_LEN:-1024}" --batch-sizes 1 2 4 8)
            log "$w, quantization $q"
            timeout -k 10 "$t" "$PY" -m radixserve.bench.one_batch --workload "$w" --model-path "$MODEL" --load-format dummy \
                "${flags[@]}" --output-json "$OUT/${w,,}.jsonl" >"$LOGDIR/$w-$q.log" 2>&1 || fail "quant $w $q" "$LOGDIR/$w-$q.log"
        done
    done
}

run_w5() {
    local cfg label flags envs word n=0 t
    IFS=';' read -ra cfgs <<<"$W5_CONFIGS"
    for cfg in "${cfgs[@]}"; do
        label=${cfg%%=*} flags=() envs=() n=$((n + 1))
        for word in ${cfg#*=}; do
            if [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$word"); else flags+=("$word"); fi
        done
        t=$(cap 60); ((t >= 60)) || { FAILED+=("w5 $label (no time left)"); continue; }
        log "server $n ($label): ${envs[*]} ${flags[*]}"
        setsid env "${envs[@]}" "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy --port "$PORT" "${flags[@]}" \
            >"$LOGDIR/server-$n.log" 2>&1 &
        SERVER_PID=$!
        wait_healthy "$LOGDIR/server-$n.log" || { FAILED+=("w5 $label (server)"); continue; }
        grep -h "captured" "$LOGDIR/server-$n.log" | tail -2
        t=$(cap 600)
        log "W5 at $W5_RATES req/s (timeout ${t}s)"
        timeout -s INT -k 20 "$t" "$PY" -m radixserve.bench.serving --port "$PORT" --disable-tqdm \
            --output-json "$OUT/w5-$n.json" --dataset-name random --num-prompts "$W5_PROMPTS" \
            --random-input-len "$W5_INPUT" --random-output-len "$W5_OUTPUT" --random-range-ratio 1 \
            --request-rate $W5_RATES --seed 3 --slo-ttft 1000 --slo-tpot 50 --label "$label" $W5_CLIENT_ARGS \
            >"$LOGDIR/w5-$n.log" 2>&1 || fail "w5 $label" "$LOGDIR/w5-$n.log"
        stop_server
        [[ -f $OUT/w5-$n.json ]] && "$PY" -m radixserve.bench.serving_report "$OUT/w5-$n.json"
    done
}

log "E7 pieces: model $MODEL; pieces $PIECES; budget ${BUDGET}s; logs in $LOGDIR"
for piece in $PIECES; do
    case $piece in
        tests) run_tests ;;
        prefill) run_prefill ;;
        fp8) run_fp8 ;;
        quant) run_quant ;;
        w5) run_w5 ;;
        *) FAILED+=("unknown piece $piece") ;;
    esac
done
finish
