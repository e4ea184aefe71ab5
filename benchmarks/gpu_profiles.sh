#!/usr/bin/env bash
# Where a decode step's device time goes, kernel by kernel, for the goals still open (one call):
# bench.one_batch W2 (512 in) with --kernel-profile, each case timed as usual and then 8 more
# decode steps profiled (bench/kernel_profile.py). PARTS picks what runs, in this order:
#   dense   llama-3.1-8b bf16, batch 1 and 256 (E16: the batch-1 reference, W1-like decode)
#   fp8     llama-3.1-8b --quantization fp8, batch 1 and 32 (E16: fp8 at small batches)
#   moe     qwen3-30b-a3b bf16, batch 1 and 32 (E15: batch-1 MoE decode against its bandwidth)
#   lora    llama-3.1-8b with 0 and 8 rank-16 adapters, batch 1 and 256 (E17)
# -> w2.jsonl (the cases' timings) and kernels.jsonl (the tables: the device's kernels, then the
# host's calls and the steps' wall time, "where": "host"), a summary of each table printed.
#
#   OUT=/some/dir PARTS="dense fp8 moe lora" benchmarks/gpu_profiles.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and
# PYTHONPATH set). CPU smoke test: PARTS=dense MODEL=tiny-llama DTYPE=float32
# ARGS="--device cpu --input-len 32 --output-len 12" BS_SMALL=1 BS_LARGE=4 OUT=prof-smoke benchmarks/gpu_profiles.sh
set -uo pipefail

PARTS=${PARTS:-dense fp8 moe lora} MODEL=${MODEL:-llama-3.1-8b} MOE_MODEL=${MOE_MODEL:-qwen3-30b-a3b}
DTYPE=${DTYPE:-bfloat16} ARGS=${ARGS:---output-len 32} BS_SMALL=${BS_SMALL:-1} BS_LARGE=${BS_LARGE:-256}
BUDGET=${BUDGET:-570} RESERVE=10
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail, has

profile() {  # NAME MODEL BATCH_SIZES... -- EXTRA_FLAGS...
    local name=$1 model=$2 sizes=() extra=()
    shift 2
    while (($#)) && [[ $1 != -- ]]; do sizes+=("$1"); shift; done
    (($#)) && shift
    extra=("$@")
    log "$name: $model bs ${sizes[*]} ${extra[*]}"
    # shellcheck disable=SC2086  # ARGS is a list
    timeout "$(cap 200)" "$PY" -m radixserve.bench.one_batch --workload W2 --load-format dummy --model-path "$model" \
        --dtype "$DTYPE" --batch-sizes "${sizes[@]}" $ARGS "${extra[@]}" --kernel-profile "$LOGDIR/k.jsonl" \
        >"$LOGDIR/w2.out" 2>"$LOGDIR/w2.log" || fail "$name" "$LOGDIR/w2.log"
    grep '^{' "$LOGDIR/w2.out" | "$PY" -c "import json, sys
for line in sys.stdin:
    d = json.loads(line); d['part'] = sys.argv[1]; print(json.dumps(d))" "$name" >>"$OUT/w2.jsonl"
    [[ -f $LOGDIR/k.jsonl ]] || return
    "$PY" -c "import json, sys
rows = [dict(json.loads(line), part=sys.argv[2]) for line in open(sys.argv[1])]
with open(sys.argv[3], 'a') as f:
    f.writelines(json.dumps(r) + '\n' for r in rows)
for r in rows:
    host = r.get('where') == 'host'
    if r['name'].startswith('(') or host and r['us_per_step'] >= 50 or r.get('share', 0) >= 0.03:
        share = 'host' if host else f\"{r['share']:.1%}\"
        print(f\"bs {r['batch_size']:>4} lora {r['lora_adapters']} {r['us_per_step']:>9.1f} us {share:>6} \"
              f\"x{r['calls_per_step']:<6} {r['name'][:90]}\")" "$LOGDIR/k.jsonl" "$name" "$OUT/kernels.jsonl"
    rm -f "$LOGDIR/k.jsonl"
}

has dense && profile dense "$MODEL" "$BS_SMALL" "$BS_LARGE"
has fp8 && profile fp8 "$MODEL" "$BS_SMALL" 32 -- --quantization fp8
has moe && profile moe "$MOE_MODEL" "$BS_SMALL" 32
has lora && profile lora "$MODEL" "$BS_SMALL" "$BS_LARGE" -- --lora-adapters 0 8
finish
