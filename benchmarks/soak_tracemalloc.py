"""Where a scheduler's Python memory goes over a long run: the offline Engine
(the same Scheduler in this process) serves batches of mixed requests under
``tracemalloc``, and the allocation sites whose memory grew between a
snapshot taken once the KV pool is full and one at the end are printed, with
the heap in use and kept free (glibc) at both. A leak of Python objects
shows as a site that grows with the requests; a flat report says the
growth lies elsewhere (benchmarks/soak.py measures the server).

    python benchmarks/soak_tracemalloc.py --requests 3000 [--max-total-tokens 32768]

The mix is soak.py's without HTTP: plain, ``n`` = 2, stop strings, logprobs,
JSON schemas (half of them new), regular expressions. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import time
import tracemalloc

import radixserve
from radixserve.model_executor.cpu_malloc import heap_figures

LOGPROBS = {"return_logprob": True, "top_logprobs_num": 3, "logprob_start_len": 0}
KINDS = {"generate": 40, "n2": 8, "stop": 8, "logprobs": 8, "json": 10, "regex": 6}


def params_for(rng: random.Random, kind: str, i: int) -> tuple[dict, dict]:
    """(sampling params, generate() keyword arguments) of one request of ``kind``."""
    sp = {"max_new_tokens": rng.randint(1, 16), "temperature": rng.choice([0.0, 0.7])}
    if kind == "n2":
        return {**sp, "n": 2, "temperature": 0.8}, {}
    if kind == "stop":
        return {**sp, "stop": ["the", "."]}, {}
    if kind == "logprobs":
        return sp, LOGPROBS
    if kind == "json":
        from soak import schema  # the same schemas as the server soak

        return {"max_new_tokens": 24, "json_schema": schema(rng, i)}, {}
    if kind == "regex":
        return {"max_new_tokens": 12, "regex": r"(yes|no), \d{1,3}"}, {}
    return sp, {}


def top_growth(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, n: int) -> list[dict]:
    stats = after.compare_to(before, "lineno")
    return [{"site": str(s.traceback), "grew_kb": round(s.size_diff / 1024, 1), "count_diff": s.count_diff}
            for s in stats[:n]]


def main() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from soak import prompt

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--max-total-tokens", type=int, default=32768)
    parser.add_argument("--warmup-fraction", type=float, default=0.2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    plan = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
    with radixserve.Engine(max_total_tokens=args.max_total_tokens, disable_tqdm=True) as eng:
        tracemalloc.start(1)
        start, first, figures = time.monotonic(), None, {}
        for lo in range(0, args.requests, args.batch):
            if first is None and lo >= args.warmup_fraction * args.requests:
                first, figures["heap_at_warmup"] = tracemalloc.take_snapshot(), heap_figures()
            groups: dict[bool, tuple[list, list]] = {False: ([], []), True: ([], [])}  # by logprobs asked
            for i in range(lo, min(lo + args.batch, args.requests)):
                sp, extra = params_for(rng, plan[i], i)
                texts, params = groups[bool(extra)]
                texts.append(prompt(rng))
                params.append(sp)
            for logprobs, (texts, params) in groups.items():
                if texts:
                    eng.generate(texts, params, **(LOGPROBS if logprobs else {}))
        last = tracemalloc.take_snapshot()
        figures["heap_at_end"] = heap_figures()
        traced, peak = tracemalloc.get_traced_memory()
    print(json.dumps({"requests": args.requests, "seconds": round(time.monotonic() - start, 1),
                      "traced_mb": round(traced / 2**20, 1), "traced_peak_mb": round(peak / 2**20, 1),
                      **{k: {f.replace("_bytes", "_mb"): round(v / 2**20, 1) if f.endswith("_bytes") else v
                             for f, v in h.items()} for k, h in figures.items()},
                      "top_growth_after_warmup": top_growth(first, last, 15)}))


if __name__ == "__main__":
    main()
