#!/usr/bin/env bash
# E15 on one GPU, in one call (within BUDGET seconds), after benchmarks/gpu_moe_kernel.sh has
# tuned the kernel (its tables copied into radixserve/layers/moe/configs/). PARTS picks, in order:
#   tests   the whole GPU path against HF on tiny Qwen3-MoE and Mixtral models
#           (tests/test_gpu_engine.py) -> gpu-engine-tests.txt
#   w2      bench.one_batch W2 on the qwen3-30b-a3b dummy at batch 1, 32, 256 -> w2.jsonl
#   w3      bench.one_batch W3 (prefill: 8 x 1,024 and 1 x 8,192 tokens) -> w3.jsonl
#   w1      W1 (256 requests) on qwen3-30b-a3b, then on the dense qwen3-8b -> w1.jsonl
# HF=1 runs HF transformers side by side in W2 and W3 (--compare-hf: the same shapes, after the runner is gone).
#
#   OUT=/some/dir PARTS="tests w2 w1" benchmarks/gpu_moe.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and PYTHONPATH set).
set -uo pipefail

PARTS=${PARTS:-tests w2 w3 w1} BUDGET=${BUDGET:-560} RESERVE=5 HF=${HF:-0}
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail, has

json() { grep '^{' "$1" | tee -a "$2"; }
hf=() && ((HF)) && hf=(--compare-hf)

if has tests; then
    log "GPU engine tests, MoE models"
    timeout "$(cap 200)" "$PY" -m pytest -q -x tests/test_gpu_engine.py -k "qwen3_moe or mixtral" \
        >"$OUT/gpu-engine-tests.txt" 2>&1 || fail "tests" "$OUT/gpu-engine-tests.txt"
    tail -n 3 "$OUT/gpu-engine-tests.txt"
fi
if has w2; then
    log "W2 qwen3-30b-a3b"
    timeout "$(cap $((HF ? 330 : 150)))" "$PY" -m radixserve.bench.one_batch --workload W2 --model-path qwen3-30b-a3b \
        --load-format dummy --batch-sizes 1 32 256 "${hf[@]}" >"$LOGDIR/w2.out" 2>"$LOGDIR/w2.log" || fail "W2" "$LOGDIR/w2.log"
    json "$LOGDIR/w2.out" "$OUT/w2.jsonl"
fi
if has w3; then
    log "W3 qwen3-30b-a3b"
    timeout "$(cap $((HF ? 200 : 120)))" "$PY" -m radixserve.bench.one_batch --workload W3 --model-path qwen3-30b-a3b \
        --load-format dummy "${hf[@]}" >"$LOGDIR/w3.out" 2>"$LOGDIR/w3.log" || fail "W3" "$LOGDIR/w3.log"
    json "$LOGDIR/w3.out" "$OUT/w3.jsonl"
fi
if has w1; then
    for model in qwen3-30b-a3b qwen3-8b; do
        log "W1 $model"
        timeout "$(cap 150)" "$PY" -m radixserve.bench.offline_throughput --workload W1 --model-path "$model" \
            --load-format dummy >"$LOGDIR/w1.out" 2>"$LOGDIR/w1.log" || fail "W1 $model" "$LOGDIR/w1.log"
        json "$LOGDIR/w1.out" "$OUT/w1.jsonl"
    done
fi
finish
