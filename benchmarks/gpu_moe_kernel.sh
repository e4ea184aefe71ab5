#!/usr/bin/env bash
# E15: the fused MoE kernel on one GPU, in one call, within BUDGET seconds. PIECES picks what runs, in order:
#   tests    the kernels' GPU tests (tests/test_fused_moe_kernel.py and test_moe_topk_kernel.py, -m gpu)
#            -> tests.json (each test's outcome), gpu-tests.txt (pytest's output)
#   before   the layer benchmark with the untuned defaults, qwen3-30b-a3b -> moe-layer-default.jsonl (not by
#            default: the tuning lines carry the default's time beside the best)
#   tune     benchmarks/tune_fused_moe.py for each of TUNE_MODELS (TUNE_BUDGET s each; TUNE_BATCHES: the batch
#            sizes, else the tuner's) -> tune-MODEL.jsonl
#            (tune-MODEL.log: the candidates that failed), and the tables it wrote -> configs/ (copy them
#            into radixserve/layers/moe/configs/)
#   bench    the layer benchmark with those tables, each of BENCH_MODELS -> moe-layer-MODEL.jsonl
#
#   OUT=/some/dir benchmarks/gpu_moe_kernel.sh
#
# Needs torch, triton and pytest only (radixserve from this checkout: PYTHONPATH is set to it).
set -uo pipefail

PIECES=${PIECES:-tests tune bench}
TUNE_MODELS=${TUNE_MODELS:-qwen3-30b-a3b mixtral-8x7b} BENCH_MODELS=${BENCH_MODELS:-qwen3-30b-a3b mixtral-8x7b}
TUNE_BATCHES=${TUNE_BATCHES:-}  # batch sizes to tune (tokens); empty: the tuner's own list
BUDGET=${BUDGET:-570} TUNE_BUDGET=${TUNE_BUDGET:-150} TESTS_TIMEOUT=${TESTS_TIMEOUT:-150}
RESERVE=5
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail
mkdir -p "$OUT/configs"

run_tests() {
    local t; t=$(cap "$TESTS_TIMEOUT")
    log "GPU tests (timeout ${t}s)"
    # --noconftest: tests/conftest.py's server fixtures import httpx, which this kernel's tests do not need
    timeout -k 10 "$t" "$PY" -m pytest -q -m gpu -p no:cacheprovider --noconftest tests/test_fused_moe_kernel.py \
        tests/test_moe_topk_kernel.py --junitxml="$LOGDIR/tests.xml" >"$OUT/gpu-tests.txt" 2>&1 || FAILED+=("tests")
    tail -n 25 "$OUT/gpu-tests.txt"
    "$PY" - "$LOGDIR/tests.xml" >"$OUT/tests.json" <<'PYEOF'
import json, sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(json.dumps({"error": str(exc)}))
    raise SystemExit
cases = []
for case in root.iter("testcase"):
    outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
    detail = next((child.get("message", "")[:500] for child in case if child.tag in ("failure", "error")), None)
    cases.append({"test": case.get("name"), "outcome": outcome, "s": float(case.get("time", 0)), "detail": detail})
counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failure", "error", "skipped")}
print(json.dumps({"counts": counts, "cases": cases}, indent=1))
PYEOF
}

run_layer() {  # run_layer NAME MODEL CONFIG_DIR
    local t; t=$(cap 120); ((t >= 20)) || { FAILED+=("$1 (no time left)"); return; }
    log "layer benchmark: $1 (timeout ${t}s)"
    timeout -k 10 "$t" "$PY" benchmarks/moe_layer.py --model "$2" --config-dir "$3" \
        >"$OUT/$1.jsonl" 2>"$OUT/$1.log" || fail "$1" "$OUT/$1.log"
    cat "$OUT/$1.jsonl"
}

run_tune() {
    local model t
    for model in $TUNE_MODELS; do
        t=$(cap $((TUNE_BUDGET + 40))); ((t >= 40)) || { FAILED+=("tune $model (no time left)"); continue; }
        log "tuning $model (search budget ${TUNE_BUDGET}s, timeout ${t}s)"
        timeout -k 10 "$t" "$PY" benchmarks/tune_fused_moe.py --model "$model" --budget-s "$((t - 40 < TUNE_BUDGET ? t - 40 : TUNE_BUDGET))" \
            ${TUNE_BATCHES:+--batches $TUNE_BATCHES} \
            --output-dir "$OUT/configs" >"$OUT/tune-$model.jsonl" 2>"$OUT/tune-$model.log" \
            || fail "tune $model" "$OUT/tune-$model.log"
        tail -n 3 "$OUT/tune-$model.jsonl"
    done
}

for piece in $PIECES; do
    case $piece in
        tests) run_tests ;;
        before) run_layer moe-layer-default qwen3-30b-a3b "$LOGDIR/no-configs" ;;
        tune) run_tune ;;
        bench) for model in $BENCH_MODELS; do run_layer "moe-layer-$model" "$model" "$OUT/configs"; done ;;
        *) FAILED+=("unknown piece $piece") ;;
    esac
done

"$PY" - "$SECONDS" "${FAILED[@]}" >"$OUT/summary.json" <<'PYEOF'
import json, sys
import torch, triton
print(json.dumps({"device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                  "torch": torch.__version__, "triton": triton.__version__, "seconds": int(sys.argv[1]),
                  "failed": sys.argv[2:]}))
PYEOF
finish
