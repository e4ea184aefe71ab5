#!/usr/bin/env bash
# W2 (bench.one_batch, 512 in, OUTPUT_LEN out) driven two ways, side by side in one call:
#   runner   the bare ModelRunner, synchronous steps (SGLang's bench_one_batch): each step pays
#            the host's preparation, the graph's launch and the read back in full
#   engine   the Engine: its scheduler with overlap scheduling, as a server decodes (step N+1
#            prepared and launched while step N runs); the mean step from whole generations
#   sync     the Engine with --disable-overlap-schedule
# for each configuration of CONFIGS ("label=model flags;..."; NAME=value words among the flags go
# into the environment, e.g. RADIXSERVE_PDL=0), batch sizes BATCH_SIZES.
# TESTS="files..." first runs those GPU test files. -> w2.jsonl (each line's "label" and "driver"),
# gpu-tests.txt.
#
#   OUT=/some/dir benchmarks/gpu_w2_drivers.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and
# PYTHONPATH set). CPU smoke test (a minute):
#   CONFIGS="tiny=tiny-llama --device cpu --dtype float32" BATCH_SIZES="1 2" OUTPUT_LEN=8 \
#   ARGS="--input-len 32" OUT=drivers-smoke benchmarks/gpu_w2_drivers.sh
set -uo pipefail

CONFIGS=${CONFIGS:-"bf16=llama-3.1-8b;fp8=llama-3.1-8b --quantization fp8;moe=qwen3-30b-a3b"}
DRIVERS=${DRIVERS:-runner engine sync} BATCH_SIZES=${BATCH_SIZES:-1 32 256} OUTPUT_LEN=${OUTPUT_LEN:-128}
ARGS=${ARGS:-} TESTS=${TESTS:-} TESTS_TIMEOUT=${TESTS_TIMEOUT:-240}
BUDGET=${BUDGET:-570} RESERVE=10
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail

if [[ -n $TESTS ]]; then
    log "GPU tests: $TESTS"
    # shellcheck disable=SC2086  # TESTS is a list
    timeout -k 20 "$(cap "$TESTS_TIMEOUT")" "$PY" -m pytest -q -m gpu -p no:cacheprovider $TESTS \
        >"$LOGDIR/tests.log" 2>&1 || FAILED+=("tests")
    grep -E "passed|failed|Error" "$LOGDIR/tests.log" | tail -40 | tee "$OUT/gpu-tests.txt"
fi

IFS=';' read -ra configs <<<"$CONFIGS"
for config in "${configs[@]}"; do
    label=${config%%=*} words=() envs=()
    for word in ${config#*=}; do  # the model, then its flags and environment
        if [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$word"); else words+=("$word"); fi
    done
    for driver in $DRIVERS; do
        case $driver in
            runner) flags=() ;;
            engine) flags=(--engine) ;;
            sync) flags=(--engine --disable-overlap-schedule) ;;
            *) log "unknown driver $driver"; FAILED+=("$driver"); continue ;;
        esac
        log "$label $driver: ${envs[*]} ${words[*]}"
        # shellcheck disable=SC2086  # ARGS and BATCH_SIZES are lists
        env "${envs[@]}" timeout "$(cap 240)" "$PY" -m radixserve.bench.one_batch --workload W2 --load-format dummy \
            --model-path "${words[0]}" "${words[@]:1}" --batch-sizes $BATCH_SIZES --output-len "$OUTPUT_LEN" \
            $ARGS "${flags[@]}" >"$LOGDIR/w2.out" 2>"$LOGDIR/w2.log" || fail "$label $driver" "$LOGDIR/w2.log"
        grep '^{' "$LOGDIR/w2.out" | "$PY" -c "import json, sys
for line in sys.stdin:
    d = dict(json.loads(line), label=sys.argv[1], driver=sys.argv[2])
    print(json.dumps(d))
    head = f\"{d['label']:>6} {d['driver']:>6} bs {d['batch_size']:>4}:\"
    if 'skipped' in d:
        print(head, 'skipped:', d['skipped'], file=sys.stderr)
        continue
    step = d['decode_median_ms'] or d['decode_mean_ms']  # the runner's median, the Engine's mean
    print(f\"{head} {step:.3f} ms a step, {d['decode_tok_s']:,.1f} tok/s\", file=sys.stderr)" \
            "$label" "$driver" >>"$OUT/w2.jsonl"
    done
done
finish
