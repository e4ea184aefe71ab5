"""bench-serving's PNG charts (matplotlib, imported only when plotting)."""

from __future__ import annotations

import math

import numpy as np

from radixserve.bench.serving_metrics import RequestRecord, e2e, itls, tpot, ttft


def _nan(v: float | None) -> float:
    """A run cut off before any request finished has no latencies: draw nothing."""
    return math.nan if v is None else v


def plot_latencies(runs: list[tuple[str, list[RequestRecord]]], path: str) -> None:
    """Distributions (CDFs) of TTFT, TPOT, ITL and E2E latency, one line per run;
    log-scaled where the values span more than a factor of 20."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(2, 2, figsize=(11, 7))
    for ax, (name, fn) in zip(axes.flat, (("TTFT", lambda r: [ttft(r)]), ("TPOT", lambda r: [tpot(r)]),
                                          ("ITL", itls), ("E2E latency", lambda r: [e2e(r)]))):
        lo, hi = math.inf, 0.0
        for label, records in runs:
            vals = np.sort([x * 1000 for r in records if r.success for x in fn(r) if x is not None])
            if len(vals):
                ax.step(vals, np.arange(1, len(vals) + 1) / len(vals), where="post", label=label)
                lo, hi = min(lo, vals[0]), max(hi, vals[-1])
        if 0 < lo and hi / lo > 20:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1, 2, 5) if hi / lo < 1000 else (1,)))
            ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
            ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        else:
            ax.ticklabel_format(axis="x", useOffset=False, style="plain")
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(6))
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("share of requests" if name != "ITL" else "share of tokens")
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_rates(results: list[dict], path: str) -> None:
    """Throughput and TTFT against request rate (categorical axis: inf is a rate)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [str(r["request_rate"]) for r in results]
    x = np.arange(len(results))
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.plot(x, [r["output_throughput"] for r in results], "o-", label="output tok/s")
    a.plot(x, [r["total_throughput"] for r in results], "s--", label="total tok/s")
    a.set_title("throughput")
    for stat in ("median", "p99"):
        b.plot(x, [_nan(r["ttft_ms"][stat]) for r in results], "o-", label=f"TTFT {stat}")
    b.set_title("TTFT (ms)")
    for ax in (a, b):
        ax.set_xticks(x, labels)
        ax.set_xlabel("request rate (req/s)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_compare(results: list[dict], path: str) -> None:
    """Bars over several result files' runs (e.g. radix cache on vs off):
    median / p99 TTFT, output throughput, cache hit rate against the ideal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r.get("label") or f"{r['backend']} @ {r['request_rate']}" for r in results]
    x = np.arange(len(results))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    w = 0.38
    axes[0].bar(x - w / 2, [_nan(r["ttft_ms"]["median"]) for r in results], w, label="median")
    axes[0].bar(x + w / 2, [_nan(r["ttft_ms"]["p99"]) for r in results], w, label="p99")
    axes[0].set_title("TTFT (ms)")
    axes[0].legend()
    axes[1].bar(x, [r["output_throughput"] for r in results], 0.6)
    axes[1].set_title("output throughput (tok/s)")
    axes[2].bar(x - w / 2, [r["cache_hit_rate"] or 0 for r in results], w, label="server counters")
    axes[2].bar(x + w / 2, [r["cache_hit_rate_requests"] or 0 for r in results], w, label="per request")
    axes[2].plot(x, [r["ideal_cache_hit_rate"] for r in results], "k_", markersize=40, mew=2, label="ideal")
    axes[2].set_ylim(0, 1)
    axes[2].set_title("cache hit rate")
    axes[2].legend(fontsize=8, markerscale=0.3)
    for ax in axes:
        ax.set_xticks(x, labels, rotation=15, ha="right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
