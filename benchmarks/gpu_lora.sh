#!/usr/bin/env bash
# E17: multi-LoRA on one GPU, in one call. PARTS picks what runs, in this order:
#   tests   tests/test_gpu_lora.py (kernels in bf16 and under a graph; the Engine with
#           graphs against HF + peft) -> gpu-tests.txt
#   kernel  benchmarks/lora_kernel.py: the kernels against the base GEMM at llama-3.1-8b's
#           projections (KERNEL_ARGS, e.g. --sweep) -> kernel.jsonl
#   w2      bench.one_batch W2 (bs 1, 32, 256) without LoRA, then on a LoRA runner with
#           0, 1, 4 and 8 distinct rank-16 adapters (all linear layers) per batch -> w2.jsonl
#   w8      W8: W5 at W8_RATE req/s against a server without adapters, then against one
#           serving 8 random rank-16 adapters with requests spread evenly over them, W8_ROUNDS
#           times in turn; then bench.serving_compare over the rounds' saved requests (the
#           p50 and p99 ratios with their 95% intervals) -> w8-base-N.json, w8-lora-N.json,
#           w8.txt, w8-compare.jsonl
#
#   OUT=/some/dir PARTS="tests kernel w2 w8" benchmarks/gpu_lora.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and
# PYTHONPATH set). CPU smoke test (scaled down): PARTS="w2 w8" MODEL=tiny-llama ATTN=torch_native
# DTYPE=float32 W2_ARGS="--batch-sizes 1 4 --input-len 32 --output-len 4 --device cpu"
# W8_PROMPTS=8 W8_INPUT=32 W8_OUTPUT=8 OUT=e17-smoke benchmarks/gpu_lora.sh
set -uo pipefail

PARTS=${PARTS:-tests kernel w2 w8} KERNEL_ARGS=${KERNEL_ARGS:-} MODEL=${MODEL:-llama-3.1-8b} ATTN=${ATTN:-triton} DTYPE=${DTYPE:-bfloat16}
PORT=${PORT:-31000} START_TIMEOUT=${START_TIMEOUT:-240} BUDGET=${BUDGET:-570} RESERVE=10
W2_ARGS=${W2_ARGS:-"--output-len 64"} LORA_RANK=${LORA_RANK:-16} ADAPTERS=${ADAPTERS:-8}
W8_RATE=${W8_RATE:-16} W8_PROMPTS=${W8_PROMPTS:-256} W8_INPUT=${W8_INPUT:-1024} W8_OUTPUT=${W8_OUTPUT:-256}
W8_TIMEOUT=${W8_TIMEOUT:-120} W8_ROUNDS=${W8_ROUNDS:-2}
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail, has
# shellcheck source=benchmarks/server_lib.sh
source benchmarks/server_lib.sh  # SERVER_PID, stop_server, wait_healthy

if has tests; then
    log "GPU tests"
    timeout "$(cap 200)" "$PY" -m pytest -q -p no:cacheprovider tests/test_gpu_lora.py >"$OUT/gpu-tests.txt" 2>&1 ||
        fail "tests" "$OUT/gpu-tests.txt"
    tail -n 3 "$OUT/gpu-tests.txt"
fi
if has kernel; then
    log "kernels"
    # shellcheck disable=SC2086  # KERNEL_ARGS is a list
    timeout "$(cap 200)" "$PY" benchmarks/lora_kernel.py $KERNEL_ARGS >"$OUT/kernel.jsonl" 2>"$LOGDIR/kernel.log" ||
        fail "kernel" "$LOGDIR/kernel.log"
    "$PY" -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f\"{r['shape']:>8} rows {r['rows']:>5}  base {r['base_us']:>8} us  lora {r['lora_us']:>7} us \"
          f\"({r['lora_pct_of_base']}%)  shrink {r['shrink_us']}  expand {r['expand_us']}  split {r['config']['split_k']}\")
" "$OUT/kernel.jsonl"
fi
if has w2; then
    log "W2 without LoRA"
    # shellcheck disable=SC2086  # W2_ARGS is a list
    timeout "$(cap 150)" "$PY" -m radixserve.bench.one_batch --workload W2 --model-path "$MODEL" --load-format dummy \
        --dtype "$DTYPE" --attention-backend "$ATTN" $W2_ARGS --output-json "$OUT/w2.jsonl" >"$LOGDIR/w2-base.log" 2>&1 ||
        fail "w2 base" "$LOGDIR/w2-base.log"
    log "W2 with 0 1 4 $ADAPTERS adapters"
    # shellcheck disable=SC2086
    timeout "$(cap 240)" "$PY" -m radixserve.bench.one_batch --workload W2 --model-path "$MODEL" --load-format dummy \
        --dtype "$DTYPE" --attention-backend "$ATTN" $W2_ARGS --lora-adapters 0 1 4 "$ADAPTERS" --lora-rank "$LORA_RANK" \
        --output-json "$OUT/w2.jsonl" >"$LOGDIR/w2-lora.log" 2>&1 || fail "w2 lora" "$LOGDIR/w2-lora.log"
    "$PY" -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get('backend') == 'radixserve':
        print(f\"bs {r['batch_size']:>3}  adapters {str(r.get('lora_adapters', '-')):>2}  decode median \"
              f\"{r.get('decode_median_ms')} ms  {r.get('decode_tok_s')} tok/s\")
" "$OUT/w2.jsonl"
fi
start() {  # NAME FLAGS...
    local name=$1; shift
    log "server $name: $*"
    setsid "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy --attention-backend "$ATTN" \
        --dtype "$DTYPE" --port "$PORT" "$@" >"$LOGDIR/server-$name.log" 2>&1 &
    SERVER_PID=$!
    START_TIMEOUT=$(cap "$START_TIMEOUT") wait_healthy "$LOGDIR/server-$name.log" || { FAILED+=("server $name"); return 1; }
}
w8() {  # NAME BENCH-FLAGS...
    local name=$1; shift
    timeout -s INT -k 20 "$(cap "$W8_TIMEOUT")" "$PY" -m radixserve.bench.serving --port "$PORT" --disable-tqdm \
        --dataset-name random --num-prompts "$W8_PROMPTS" --random-input-len "$W8_INPUT" \
        --random-output-len "$W8_OUTPUT" --random-range-ratio 1 --request-rate "$W8_RATE" --seed 3 \
        --label "$name" --save-requests --output-json "$OUT/w8-$name.json" "$@" >"$LOGDIR/w8-$name.log" 2>&1 ||
        fail "w8 $name" "$LOGDIR/w8-$name.log"
}
if has w8; then
    adapters=$("$PY" -m radixserve.bench.lora_adapters --model-path "$MODEL" --count "$ADAPTERS" --rank "$LORA_RANK" \
        --dest "$LOGDIR/adapters")
    names=$(for e in $adapters; do printf '%s ' "${e%%=*}"; done)
    for round in $(seq "$W8_ROUNDS"); do
        start "base-$round" && w8 "base-$round"
        stop_server
        # shellcheck disable=SC2086  # lists
        start "lora-$round" --lora-paths $adapters --max-loras-per-batch "$ADAPTERS" && w8 "lora-$round" --lora-name $names
        stop_server
    done
    "$PY" - "$OUT" <<'PYEOF' | tee "$OUT/w8.txt"
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "w8-*.json"))):
    for r in json.load(open(path))["runs"]:
        print(f"{r.get('label')}: ok {r['completed']}/{r['completed'] + r['failed']}  out {r['output_throughput']:.0f} tok/s"
              f"  TTFT p50/p99 {r['ttft_ms']['median']:.0f}/{r['ttft_ms']['p99']:.0f} ms"
              f"  ITL p50/p99 {r['itl_ms']['median']:.1f}/{r['itl_ms']['p99']:.1f} ms"
              f"  peak running {r.get('peak_running_requests')}")
PYEOF
    "$PY" -m radixserve.bench.serving_compare --baseline "$OUT"/w8-base-*.json --candidate "$OUT"/w8-lora-*.json \
        >"$OUT/w8-compare.jsonl" 2>"$LOGDIR/w8-compare.log" || fail "w8 compare" "$LOGDIR/w8-compare.log"
    "$PY" -c "
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f\"{r['metric']} p{r['percentile']}: {r['candidate']:.1f} against {r['baseline']:.1f} ms, x{r['ratio']:.3f} \"
          f\"(95% {r['ci95'][0]:.3f}-{r['ci95'][1]:.3f}; {r['candidate_runs']} and {r['baseline_runs']} runs)\")
" "$OUT/w8-compare.jsonl"
fi
finish
