"""bench.serving's output: the result table and the JSON file, and one line
per run of saved JSON files, for the benchmark scripts' summaries:

    python -m radixserve.bench.serving_report OUT/w5-*.json
"""

from __future__ import annotations

import json
import os
import re
import sys

from radixserve.bench.serving_workers import format_breakdown


def format_table(res: dict) -> str:
    def f(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v)

    rows = [("Backend", res["backend"]), ("Dataset", res["dataset"]), ("Request rate (req/s)", res["request_rate"]),
            ("Max concurrency", res["max_concurrency"] or "-"), ("Successful requests", res["completed"]),
            ("Failed requests", res["failed"]), ("Duration (s)", f(res["duration_s"])),
            ("Total input tokens", res["total_input_tokens"]), ("Total output tokens", res["total_output_tokens"]),
            ("Request throughput (req/s)", f(res["request_throughput"])),
            ("Input token throughput (tok/s)", f(res["input_throughput"])),
            ("Output token throughput (tok/s)", f(res["output_throughput"])),
            ("Total token throughput (tok/s)", f(res["total_throughput"]))]
    if res["slo_ttft_ms"] is not None or res["slo_tpot_ms"] is not None:
        rows += [("Goodput (req/s)", f(res["goodput"])), ("SLO attainment", f(res["slo_attainment"], "{:.1%}"))]
    rows += [("Cache hit rate (server counters)", f(res["cache_hit_rate"], "{:.1%}")),
             ("Cache hit rate (per request)", f(res["cache_hit_rate_requests"], "{:.1%}")),
             ("Ideal cache hit rate", f(res["ideal_cache_hit_rate"], "{:.1%}")),
             ("Peak running requests", f(res["peak_running_requests"], "{}"))]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E latency")):
        for stat in ("mean", "median", "p90", "p99"):
            rows.append((f"{stat.capitalize()} {name} (ms)", f(res[key][stat])))
    pacing = res.get("stream_pacing") or {}
    rows += [("Tokens in coalesced events", f(pacing.get("coalesced_tokens"), "{:.1%}")),
             ("Events read together", f(pacing.get("bunched_events"), "{:.1%}"))]
    for turn, stats in (res.get("ttft_ms_by_turn") or {}).items():
        rows.append((f"TTFT median / p99, turn {turn} (ms)", f"{f(stats['median'])} / {f(stats['p99'])}"))
    title = " Serving Benchmark Result " + ("(interrupted) " if res["interrupted"] else "")
    lines = [f"{title:=^56}"] + [f"{k:<38}{v!s:>18}" for k, v in rows]
    lines += (format_breakdown(res["workers"]) if res.get("workers") else []) + ["=" * 56]
    if res["interrupted"]:
        lines.insert(1, f"{'Unfinished requests (cut off)':<38}{res['unfinished']:>18}")
    server, per_request = res["cache_hit_rate"], res["cache_hit_rate_requests"]
    if server is not None and per_request is not None and abs(server - per_request) > 0.02:
        lines.append("note: the server's cache counters disagree with the cached_tokens of its replies")
    return "\n".join(lines)


def write_json(path: str, output: dict) -> None:
    """Indented, except that each saved request record takes a single line."""
    compact: list[str] = []

    def marker(record: dict) -> str:  # stands for the record's one-line JSON until the end
        compact.append(json.dumps(record))
        return f"@@record{len(compact) - 1}@@"

    shown = {**output, "runs": [{**r, "requests": [marker(d) for d in r["requests"]]} if "requests" in r else r
                                for r in output["runs"]]}
    text = json.dumps(shown, indent=2)
    text = re.sub(r'"@@record(\d+)@@"', lambda m: compact[int(m.group(1))], text)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


def format_run_line(name: str, run: dict) -> str:
    """One run of a saved file: rate, completion, throughput, SLO, latency
    medians and p99s, cache hits."""
    def f(v, scale=1):
        return "n/a" if v is None else f"{v * scale:.3g}"

    def q(key):
        return f"{f(run[key]['median'])}/{f(run[key]['p99'])}"

    total = run["completed"] + run["failed"] + run["unfinished"]
    return (f"{name:18} {str(run.get('label') or '')[:24]:24} rate {run['request_rate']!s:>4}  ok {run['completed']}/{total}"
            f"  {run['duration_s']:.1f} s  {run['request_throughput']:.2f} req/s  out {run['output_throughput']:.0f} tok/s"
            f"  goodput {f(run['goodput'])}  in SLO {f(run['slo_attainment'])}  TTFT p50/p99 {q('ttft_ms')} ms  ITL p50/p99 {q('itl_ms')} ms"
            f"  TPOT p50 {f(run['tpot_ms']['median'])} ms  hit {f(run['cache_hit_rate_requests'], 100)}%"
            f" (ideal {f(run['ideal_cache_hit_rate'], 100)}%)" + ("  INTERRUPTED" if run["interrupted"] else ""))


def main(paths: list[str]) -> None:
    for path in sorted(paths):
        with open(path, encoding="utf-8") as f:
            runs = json.load(f)["runs"]
        for run in runs:
            print(format_run_line(os.path.basename(path), run))


if __name__ == "__main__":
    main(sys.argv[1:])
