"""Where the GPU's time went in a profile taken with ``/start_profile``.

    python -m radixserve.bench.trace_summary TRACE.trace.json.gz [--top 25]

Prints JSON: the window the kernels span, the fraction of it in which some
kernel ran (what is left is the GPU waiting on the host), kernel time by
kind (matrix multiplies, attention, norms and other fused elementwise
kernels, copies, sampling, the rest), the kernels that took the most time,
and the longest idle gaps with what the host was doing meanwhile (with
``CPU`` among the profile's activities). Works on any Chrome trace from the
torch profiler."""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict

# The first pattern that matches a kernel's name names its kind.
KINDS = (
    ("gemm", re.compile(r"gemm|gemv|nvjet|xmma|cutlass|cublas|sm\d+_.*(tensorop|s16816|hmma)", re.I)),
    ("attention", re.compile(r"_decode_(split|merge)_kernel|_extend_kernel|_attend|flash|attention|sdpa", re.I)),
    ("kv_store", re.compile(r"_store_kv_kernel", re.I)),
    ("norm_rope_act", re.compile(r"rms_norm|rope|rotate|silu|gelu|layer_norm", re.I)),
    ("sampling", re.compile(r"softmax|topk|top_k|sort|argmax|multinomial|exponential|cumsum|radix", re.I)),
    ("copy_index", re.compile(r"memcpy|memset|copy|index|gather|scatter|cat|fill", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|reduce", re.I)),
)


HOST_CATEGORIES = ("user_annotation", "cpu_op", "python_function", "cuda_runtime")


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def idle_gaps(kernels: list[dict], host: list[dict], min_us: float = 200.0, top: int = 10) -> dict:
    """Where the GPU waited: the gaps of at least ``min_us`` between one
    kernel's end (the latest so far) and the next kernel's start, their total,
    and the longest ones with the kernels around them and the host events
    (annotations, operators) that cover at least half of each."""
    order = sorted(kernels, key=lambda e: float(e["ts"]))
    gaps, end, before = [], float("-inf"), None
    for e in order:
        start = float(e["ts"])
        if before is not None and start - end >= min_us:
            gaps.append((start - end, end, start, before["name"], e["name"]))
        if start + float(e.get("dur", 0)) > end:
            end, before = start + float(e.get("dur", 0)), e
    gaps.sort(reverse=True)

    def spanning(lo: float, hi: float) -> list[str]:
        """The host events covering at least half the gap, the most specific (shortest) first."""
        def overlap(h: dict) -> float:
            return min(hi, float(h["ts"]) + float(h.get("dur", 0))) - max(lo, float(h["ts"]))

        covering = [h for h in host if overlap(h) >= (hi - lo) / 2]
        return [h["name"][:80] for h in sorted(covering, key=lambda h: float(h.get("dur", 0)))[:4]]

    return {
        "min_gap_us": min_us,
        "count": len(gaps),
        "total_ms": round(sum(g[0] for g in gaps) / 1e3, 2),
        "longest": [{"us": round(g[0]), "after": g[3][:60], "before": g[4][:60], "host": spanning(g[1], g[2])}
                    for g in gaps[:top]],
    }


def summarize(trace: dict, top: int = 25) -> dict:
    kernels = [e for e in trace.get("traceEvents", []) if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
               and e.get("ph") == "X"]
    if not kernels:
        return {"kernels": 0}
    spans = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in kernels]
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_name[e["name"]]
        entry[0] += float(e.get("dur", 0))
        entry[1] += 1
    by_kind: dict[str, float] = defaultdict(float)
    for name, (dur, _) in by_name.items():
        by_kind[kind_of(name)] += dur
    kernel_time = sum(by_kind.values())
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])[:top]
    host = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in HOST_CATEGORIES]
    return {
        "kernels": len(kernels),
        "window_ms": round(window / 1e3, 2),
        "gpu_busy_fraction": round(busy_time(spans) / window, 4) if window else None,
        "kernel_ms": round(kernel_time / 1e3, 2),
        "by_kind_fraction": {k: round(v / kernel_time, 4) for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": name[:120], "kind": kind_of(name), "ms": round(dur / 1e3, 2), "count": count}
                        for name, (dur, count) in ranked],
        "idle_gaps": idle_gaps(kernels, host),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Chrome trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=25, help="how many kernels to list")
    args = parser.parse_args(argv)
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        trace = json.load(f)
    print(json.dumps({"trace": args.trace.rsplit("/", 1)[-1], **summarize(trace, args.top)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
