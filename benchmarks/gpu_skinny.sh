#!/usr/bin/env bash
# E16: fp8 at a few rows (the skinny GEMM, layers/triton_ops/skinny_gemm.py) on one GPU, in one call, within
# BUDGET seconds. PIECES picks what runs, in order:
#   tune     bench.fp8_gemm's tile search for llama-3.1-8b's projections at TUNE_TOKENS rows, fp8 weights
#            (TUNE_S s a case), writing the tuned tables into this checkout's configs/skinny, where the
#            engine reads them -> tune.jsonl, configs.tar.gz (unpack it into radixserve/layers/triton_ops/configs/skinny/)
#   tests    the kernel's and fp8's GPU tests (tests/test_skinny_gemm.py, test_gpu_quantization.py, -m gpu)
#            -> gpu-tests.txt
#   gemm     bench.fp8_gemm at GEMM_TOKENS rows with whatever tables there are -> gemm.jsonl
#   w2       W2 (bench.one_batch, llama-3.1-8b dummy, W2_BS, W2_OUT tokens out) in bf16, then with
#            --quantization fp8 -> w2.jsonl (each line names its quantization)
#
#   OUT=/some/dir benchmarks/gpu_skinny.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and PYTHONPATH set);
# the tests need pytest.
set -uo pipefail

PIECES=${PIECES:-tune tests gemm w2}
TUNE_TOKENS=${TUNE_TOKENS:-1 2 4 8 16} TUNE_S=${TUNE_S:-15} GEMM_TOKENS=${GEMM_TOKENS:-1 2 4 8 16 32 64}
W2_BS=${W2_BS:-1 32 256} W2_OUT=${W2_OUT:-64}
BUDGET=${BUDGET:-570} TESTS_TIMEOUT=${TESTS_TIMEOUT:-200}
RESERVE=5
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail
TABLES=radixserve/layers/triton_ops/configs/skinny

run_tune() {
    local t; t=$(cap $((4 * $(wc -w <<<"$TUNE_TOKENS") * TUNE_S + 90))); ((t >= 60)) || { FAILED+=("tune (no time left)"); return; }
    log "skinny tile search at $TUNE_TOKENS rows (${TUNE_S}s a case, timeout ${t}s)"
    timeout -k 10 "$t" "$PY" -m radixserve.bench.fp8_gemm --tokens $TUNE_TOKENS --sweep-s "$TUNE_S" \
        --write-tables "$TABLES" >"$OUT/tune.jsonl" 2>"$LOGDIR/tune.log" || fail "tune" "$LOGDIR/tune.log"
    tar -czf "$OUT/configs.tar.gz" -C "$TABLES" --exclude README.md .  # names with = and , do not come back
    grep -h skinny_sweep "$OUT/tune.jsonl" | cut -c1-220
}

run_tests() {
    local t; t=$(cap "$TESTS_TIMEOUT")
    log "GPU tests (timeout ${t}s)"
    timeout -k 10 "$t" "$PY" -m pytest -q -s -m gpu -p no:cacheprovider tests/test_skinny_gemm.py \
        tests/test_gpu_quantization.py >"$OUT/gpu-tests.txt" 2>&1 || FAILED+=("tests")
    grep -E "flipped|passed|failed|Error" "$OUT/gpu-tests.txt" | tail -n 25
}

run_gemm() {
    local t; t=$(cap 150); ((t >= 30)) || { FAILED+=("gemm (no time left)"); return; }
    log "fp8 GEMMs at $GEMM_TOKENS rows (timeout ${t}s)"
    timeout -k 10 "$t" "$PY" -m radixserve.bench.fp8_gemm --tokens $GEMM_TOKENS >"$OUT/gemm.jsonl" \
        2>"$LOGDIR/gemm.log" || fail "gemm" "$LOGDIR/gemm.log"
}

run_w2() {
    local q t flags
    for q in none fp8; do
        t=$(cap 200); ((t >= 40)) || { FAILED+=("w2 $q (no time left)"); continue; }
        flags=(); [[ $q == fp8 ]] && flags=(--quantization fp8)
        log "W2 at $W2_BS, quantization $q (timeout ${t}s)"
        timeout -k 10 "$t" "$PY" -m radixserve.bench.one_batch --workload W2 --model-path llama-3.1-8b --load-format dummy \
            --batch-sizes $W2_BS --output-len "$W2_OUT" "${flags[@]}" --output-json "$OUT/w2.jsonl" \
            >"$LOGDIR/w2-$q.log" 2>&1 || fail "w2 $q" "$LOGDIR/w2-$q.log"
    done
    "$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r.get("quantization"), r.get("batch_size"), r.get("decode_median_ms"), r.get("decode_tok_s"))' "$OUT/w2.jsonl"
}

log "E16 skinny: pieces $PIECES; budget ${BUDGET}s; logs in $LOGDIR"
for piece in $PIECES; do
    case $piece in
        tune) run_tune ;;
        tests) run_tests ;;
        gemm) run_gemm ;;
        w2) run_w2 ;;
        *) FAILED+=("unknown piece $piece") ;;
    esac
done
finish
