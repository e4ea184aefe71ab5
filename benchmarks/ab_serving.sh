#!/usr/bin/env bash
# A/B serving: the same bench.serving run against a server started from each of
# two source trees, in turn, in one call (so that both see the same machine).
#
#   A=/path/to/old/tree B=. OUT=/some/dir benchmarks/ab_serving.sh [bench.serving args...]
#
# A and B are folders holding a radixserve package (a checkout, or `git archive
# REV radixserve | tar -x -C DIR`). The client is always this checkout's
# bench.serving; each server runs from its tree (python -m in that folder). ROUNDS
# (default 1) repeats A then B. Writes $OUT/{a,b}-<round>.json and prints one line
# per rate. radixserve's dependencies must be importable (PYTHONPATH), as for
# gpu_serving.sh. Default workload: W5 (random 1024 in / 256 out) at 8, 16 and
# inf req/s on llama-3.1-8b dummy weights.
set -uo pipefail

: "${A:?set A to the first tree}" "${B:?set B to the second tree}" "${OUT:?set OUT to the output folder}"
MODEL=${MODEL:-llama-3.1-8b} PORT=${PORT:-31000} ROUNDS=${ROUNDS:-1} START_TIMEOUT=${START_TIMEOUT:-240}
SERVER_ARGS=${SERVER_ARGS:-}
PY=${PYTHON:-python3}
ARGS=("$@")
((${#ARGS[@]})) || ARGS=(--dataset-name random --num-prompts 128 --random-input-len 1024 --random-output-len 256
                         --random-range-ratio 1 --request-rate 8 16 inf --seed 3 --slo-ttft 1000 --slo-tpot 50)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
A=$(cd "$A" && pwd) B=$(cd "$B" && pwd)
HERE=$(cd "$(dirname "$0")/.." && pwd)
LOGDIR=$(mktemp -d)
source "$HERE/benchmarks/server_lib.sh"

run_side() {  # NAME TREE ROUND
    local name=$1 tree=$2 round=$3
    (cd "$tree" && exec setsid "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy \
        --port "$PORT" $SERVER_ARGS >"$LOGDIR/server-$name-$round.log" 2>&1) &
    SERVER_PID=$!
    wait_healthy "$LOGDIR/server-$name-$round.log" || return 1
    (cd "$HERE" && "$PY" -m radixserve.bench.serving --port "$PORT" --disable-tqdm --label "$name" \
        --output-json "$OUT/$name-$round.json" "${ARGS[@]}" >"$LOGDIR/bench-$name-$round.log" 2>&1) ||
        { echo "bench $name failed:"; tail -n 20 "$LOGDIR/bench-$name-$round.log"; }
    stop_server
}

for ((r = 1; r <= ROUNDS; r++)); do
    run_side a "$A" "$r"
    run_side b "$B" "$r"
done
"$PY" - "$OUT" <<'EOF'
import glob, json, os, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    for r in json.load(open(path))["runs"]:
        print(f"{os.path.basename(path):10} rate {r['request_rate']!s:>4}  ok {r['completed']}/{r['completed'] + r['failed']}"
              f"  out {r['output_throughput']:.0f} tok/s  TTFT p50/p99 {r['ttft_ms']['median']:.1f}/{r['ttft_ms']['p99']:.1f} ms"
              f"  TPOT p50/p99 {r['tpot_ms']['median']:.2f}/{r['tpot_ms']['p99']:.2f} ms  goodput {r['goodput']}")
EOF
