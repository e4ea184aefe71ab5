#!/usr/bin/env bash
# E13: the elastic KV pool on one GPU, in one call. PARTS picks what runs, in this order:
#   tests   the elastic pool's GPU tests (and the memory-occupation ones) -> gpu-tests.txt
#   rates   bench.elastic_kv: map and unmap GB/s, an allocation's latency with and without
#           pages mapped ahead (llama-3.1-8b's KV geometry) -> rates.jsonl
#   fresh   benchmarks/elastic_vmm.py's fresh-or-reused rows, a launch-bound and a memory-bound
#           step: does growing cost the first mapping of a range, or of memory? -> fresh.jsonl
#   page-mb elastic_vmm.py's rates with 2, 8 and 32 MB pages per buffer (PAGE_MBS; 16 GB each way):
#           does an unmap cost per driver call or per byte? (an idle server's give-back) -> page_mb.jsonl
#   w1      W1 (qwen3-0.6b, bench.offline_throughput), static then elastic, W1_REPEATS times
#           each, alternating -> w1.jsonl (each line's "enable_elastic_kv" says which, "flags" the
#           whole set); W1_VARIANTS: other flag sets, ';'-separated (default ";--enable-elastic-kv")
#   w1-reuse  W1 elastic after a warm run whose pages were given back (--warm-give-back):
#           the timed run maps again memory the process had -> w1.jsonl ("warm_give_back": true)
#   lone | static-pair | elastic-pair   benchmarks/two_tenants.py's phases -> two_tenants.jsonl
#
#   OUT=/some/dir PARTS="tests rates w1" benchmarks/gpu_elastic.sh
#
# radixserve's dependencies must be importable (a wheelhouse installed with --target and
# PYTHONPATH set). CPU smoke test: PARTS=w1 W1_ARGS="--model-path tiny-llama --device cpu
# --num-prompts 4" OUT=elastic-smoke benchmarks/gpu_elastic.sh
set -uo pipefail

PARTS=${PARTS:-tests rates w1} W1_REPEATS=${W1_REPEATS:-2} W1_ARGS=${W1_ARGS:---model-path qwen3-0.6b}
TT_ARGS=${TT_ARGS:-} BUDGET=${BUDGET:-560} RESERVE=10
PY=${PYTHON:-python3}
# shellcheck source=benchmarks/script_lib.sh
source "$(dirname "$0")/script_lib.sh"  # OUT, LOGDIR, the checkout's root, FAILED, log, cap, fail, has

if has tests; then
    log "GPU tests"
    timeout "$(cap 240)" "$PY" -m pytest -q -x tests/test_gpu_elastic_kv.py $(ls tests/test_gpu_memory_occupation.py 2>/dev/null) \
        >"$OUT/gpu-tests.txt" 2>&1 || fail "tests" "$OUT/gpu-tests.txt"
    tail -n 3 "$OUT/gpu-tests.txt"
fi
if has rates; then
    log "map rates"
    timeout "$(cap 90)" "$PY" -m radixserve.bench.elastic_kv >"$OUT/rates.jsonl" 2>"$LOGDIR/rates.log" ||
        fail "rates" "$LOGDIR/rates.log"
    cat "$OUT/rates.jsonl"
fi
if has fresh; then
    for graph in "--graph-mb 0.25 --step-ms 1.6" "--graph-mb 256"; do
        log "fresh or reused: $graph"
        # shellcheck disable=SC2086
        timeout "$(cap 120)" "$PY" benchmarks/elastic_vmm.py --skip rates,interference $graph >>"$OUT/fresh.jsonl" \
            2>"$LOGDIR/fresh.log" || fail "fresh $graph" "$LOGDIR/fresh.log"
    done
    cut -c1-300 "$OUT/fresh.jsonl"
fi
if has page-mb; then
    for mb in ${PAGE_MBS:-2 8 32}; do
        log "rates, $mb MB pages"
        timeout "$(cap 90)" "$PY" benchmarks/elastic_vmm.py --skip interference,fresh --page-mb "$mb" --pages $((256 / mb)) \
            >>"$OUT/page_mb.jsonl" 2>"$LOGDIR/page_mb.log" || fail "page-mb $mb" "$LOGDIR/page_mb.log"
    done
    "$PY" -c "import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r['bench'] == 'elastic_vmm_rate':
        print(r['page_mb'], 'MB pages, runs of', r['run'], 'span', r['span'], 'map GB/s', r['map_gb_per_s'], 'unmap GB/s', r['unmap_gb_per_s'])
" "$OUT/page_mb.jsonl"
fi
w1_runs=()
if has w1; then
    IFS=';' read -ra w1_variants <<<"${W1_VARIANTS:-;--enable-elastic-kv}"
    for ((i = 0; i < W1_REPEATS; i++)); do w1_runs+=("${w1_variants[@]}"); done
fi
has w1-reuse && w1_runs+=("--enable-elastic-kv --warm-runs 1 --warm-give-back")
if ((${#w1_runs[@]})); then
    for flags in "${w1_runs[@]}"; do
        log "W1 ${flags:-static}"
        # shellcheck disable=SC2086  # flag lists
        timeout "$(cap 120)" "$PY" -m radixserve.bench.offline_throughput --workload W1 --load-format dummy \
            $W1_ARGS $flags >"$LOGDIR/w1.out" 2>"$LOGDIR/w1.log" || fail "W1 ${flags:-static}" "$LOGDIR/w1.log"
        grep '^{' "$LOGDIR/w1.out" | "$PY" -c "import json, sys
for line in sys.stdin:
    d = json.loads(line); d['enable_elastic_kv'] = 'elastic' in sys.argv[1]; d['flags'] = sys.argv[1]
    d['warm_give_back'] = 'give-back' in sys.argv[1]
    print(json.dumps(d))" "$flags" | tee -a "$OUT/w1.jsonl"
    done
fi
tt=()
for phase in lone static-pair elastic-pair; do has "$phase" && tt+=("$phase"); done
if ((${#tt[@]})); then
    log "two tenants: ${tt[*]}"
    # shellcheck disable=SC2086
    timeout "$(cap 560)" "$PY" benchmarks/two_tenants.py --out "$OUT" --phases "$(IFS=,; echo "${tt[*]}")" $TT_ARGS \
        >"$LOGDIR/tt.out" 2>"$LOGDIR/tt.log" || fail "two tenants" "$LOGDIR/tt.log"
    tail -c 6000 "$LOGDIR/tt.out"
fi
finish
