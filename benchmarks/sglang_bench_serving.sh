#!/usr/bin/env bash
# SGLang's own benchmark client against radixserve: starts a radixserve server,
# runs `python -m sglang.bench_serving --backend sglang` (SGLang's /generate
# client, unchanged) at each of RATES, and writes its JSON lines to
# $OUT/sglang-bench-serving.jsonl (one line per rate, SGLang's format).
#
#   OUT=/some/dir benchmarks/sglang_bench_serving.sh
#
# Needs `sglang` importable (installed with --no-deps, plus what
# sglang.bench_serving imports: pyproject's compat and compat-bench extras, and
# a torchvision that matches torch, since it imports sglang.srt.configs) and
# radixserve's dependencies. The client runs with no GPU visible: it needs
# none, and on a CUDA host sglang would otherwise import its own CUDA kernels
# (sgl-kernel). Defaults: llama-3.1-8b dummy weights with a
# real tokenizer (TOKENIZER), the random-ids dataset, 1024 in / 256 out.
set -uo pipefail

MODEL=${MODEL:-llama-3.1-8b} TOKENIZER=${TOKENIZER:?set TOKENIZER to a tokenizer folder} PORT=${PORT:-31000}
PROMPTS=${PROMPTS:-256} INPUT=${INPUT:-1024} OUTPUT=${OUTPUT:-256} RATES=${RATES:-16 inf}
START_TIMEOUT=${START_TIMEOUT:-240} SERVER_ARGS=${SERVER_ARGS:-}
PY=${PYTHON:-python3}
: "${OUT:?set OUT to the output folder}"
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
LOGDIR=$(mktemp -d)
source "$(dirname "$0")/server_lib.sh"

setsid "$PY" -m radixserve.launch_server --model-path "$MODEL" --load-format dummy --tokenizer-path "$TOKENIZER" \
    --port "$PORT" $SERVER_ARGS >"$LOGDIR/server.log" 2>&1 &
SERVER_PID=$!
wait_healthy "$LOGDIR/server.log" || exit 1

status=0
for rate in $RATES; do
    CUDA_VISIBLE_DEVICES= "$PY" -m sglang.bench_serving --backend sglang --host 127.0.0.1 --port "$PORT" --tokenizer "$TOKENIZER" \
        --dataset-name random-ids --num-prompts "$PROMPTS" --random-input-len "$INPUT" \
        --random-output-len "$OUTPUT" --random-range-ratio 1 --request-rate "$rate" --seed 1 --disable-tqdm \
        --output-file "$OUT/sglang-bench-serving.jsonl" >"$LOGDIR/bench-$rate.log" 2>&1 || status=1
    tail -25 "$LOGDIR/bench-$rate.log"
done
exit $status
