#!/usr/bin/env bash
# A/B static-batch latency: the same bench.one_batch run from each of two source
# trees, in turn, in one call (so that both see the same machine).
#
#   A=/path/to/old/tree B=. OUT=/some/dir benchmarks/ab_one_batch.sh [bench.one_batch args...]
#
# A and B are folders holding a radixserve package (a checkout, or `git archive
# REV radixserve | tar -x -C DIR`). Each run is `python -m radixserve.bench.one_batch`
# started in that folder: `python -m` puts the working directory first on sys.path,
# so a tree named only on PYTHONPATH would lose to the checkout the command runs in.
# ROUNDS (default 2) repeats A then B; PROFILE=1 adds one more round of each with
# --kernel-profile and RADIXSERVE_PDL=0 (each kernel's own time, none overlapped).
# Writes $OUT/{a,b}-<round>.jsonl (and {a,b}-profile.jsonl) and prints one line per
# case. radixserve's dependencies must be importable (PYTHONPATH), as for
# gpu_moe.sh. Default case: W2 at batch 1, 32 tokens out, qwen3-30b-a3b dummy weights.
set -uo pipefail

: "${A:?set A to the first tree}" "${B:?set B to the second tree}" "${OUT:?set OUT to the output folder}"
ROUNDS=${ROUNDS:-2} PROFILE=${PROFILE:-0} TIMEOUT=${TIMEOUT:-300}
PY=${PYTHON:-python3}
ARGS=("$@")
((${#ARGS[@]})) || ARGS=(--workload W2 --model-path qwen3-30b-a3b --load-format dummy --batch-sizes 1 --output-len 32)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
A=$(cd "$A" && pwd) B=$(cd "$B" && pwd)

run() {  # name tree file [extra args...]
    local name=$1 tree=$2 file=$3
    shift 3
    (cd "$tree" && timeout -k 10 "$TIMEOUT" "$PY" -m radixserve.bench.one_batch "${ARGS[@]}" "$@" \
        --output-json "$OUT/$file.jsonl" >"$OUT/$file.log" 2>&1) || { echo "$file failed:"; tail -n 5 "$OUT/$file.log"; }
    [[ -f $OUT/$file.jsonl ]] && "$PY" -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "batch_size" in r and not r.get("summary"):
        print(sys.argv[2], "bs", r["batch_size"], "in", r["input_len"], "prefill ms", r.get("prefill_ms"),
              "decode ms", r.get("decode_median_ms"), "tok/s", r.get("decode_tok_s"))' "$OUT/$file.jsonl" "$name"
}

for ((round = 1; round <= ROUNDS; round++)); do
    run "A[$round]" "$A" "a-$round"
    run "B[$round]" "$B" "b-$round"
done
if [[ $PROFILE == 1 ]]; then
    RADIXSERVE_PDL=0 run "A[profile]" "$A" a-profile --kernel-profile "$OUT/a-kernels.jsonl"
    RADIXSERVE_PDL=0 run "B[profile]" "$B" b-profile --kernel-profile "$OUT/b-kernels.jsonl"
fi
