"""Whether a candidate server's latencies differ from a baseline's by more
than their run-to-run noise: TTFT and ITL percentiles of each, pooled over
every run in their files (``bench.serving --save-requests``), and a
bootstrap interval of each ratio, candidate over baseline (requests drawn
with replacement, each request's inter-token gaps kept together, since a
slow step delays every request running through it).

One run's p99 rests on a few slow steps: W8 with the same code gave TTFT
p99 +27% to +40% and ITL p99 +19% to +57% over the same baseline in four
calls (docs/lora.md). A goal such as "p99 within 20%" is met where the
interval's upper end is under 1.2, and missed where its lower end is over.

    python -m radixserve.bench.serving_compare --baseline OUT/w8-base-*.json --candidate OUT/w8-lora-*.json

Prints one JSON line per metric and percentile.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import numpy as np

from radixserve.bench.serving_metrics import RequestRecord, itls, ttft

METRICS = {"ttft_ms": lambda r: [ttft(r)], "itl_ms": itls}
PERCENTILES = (50, 99)


@dataclass
class Samples:
    """One server's values of a metric: every request's, in one array, and where each request's begin."""

    values: np.ndarray  # seconds
    starts: np.ndarray  # [requests + 1] offsets into ``values``

    @classmethod
    def of(cls, records: list[RequestRecord], metric: str) -> "Samples":
        groups = [np.asarray(METRICS[metric](r), dtype=np.float64) for r in records]
        lengths = np.array([len(g) for g in groups], dtype=np.int64)
        return cls(np.concatenate(groups) if groups else np.zeros(0), np.concatenate([[0], np.cumsum(lengths)]))

    @property
    def requests(self) -> int:
        return len(self.starts) - 1

    def resample(self, rng: np.random.Generator) -> np.ndarray:
        """The values of as many requests drawn with replacement."""
        picks = rng.integers(0, self.requests, self.requests)
        lengths = np.diff(self.starts)[picks]
        first = np.cumsum(lengths) - lengths  # where each pick's values go
        return self.values[np.arange(lengths.sum()) - np.repeat(first - self.starts[picks], lengths)]


def load_records(paths: list[str]) -> tuple[list[RequestRecord], int]:
    """The successful requests of every run in ``paths`` and the number of
    runs; ValueError for a run saved without its requests."""
    records, runs = [], 0
    for path in paths:
        with open(path, encoding="utf-8") as f:
            for run in json.load(f)["runs"]:
                if "requests" not in run:
                    raise ValueError(f"{path}: a run without its requests; run bench.serving with --save-requests")
                runs += 1
                records += [RequestRecord(**d) for d in run["requests"] if d["success"]]
    return records, runs


def compare(baseline: Samples, candidate: Samples, percentile: float, resamples: int = 1000,
            seed: int = 0) -> dict:
    """Each side's ``percentile`` (ms), their ratio and its 95% bootstrap interval."""
    if baseline.values.size == 0 or candidate.values.size == 0:
        raise ValueError("no values to compare: a side has no successful request with this metric")
    base, cand = (float(np.percentile(s.values, percentile)) for s in (baseline, candidate))
    rng = np.random.default_rng(seed)
    ratios = [np.percentile(candidate.resample(rng), percentile) / np.percentile(baseline.resample(rng), percentile)
              for _ in range(resamples)]
    lo, hi = np.percentile(ratios, [2.5, 97.5])
    return {"baseline": base * 1000, "candidate": cand * 1000, "ratio": cand / base,
            "ci95": [float(lo), float(hi)]}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", nargs="+", required=True, help="bench.serving JSON files (--save-requests)")
    p.add_argument("--candidate", nargs="+", required=True, help="bench.serving JSON files (--save-requests)")
    p.add_argument("--resamples", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    (base, base_runs), (cand, cand_runs) = load_records(args.baseline), load_records(args.candidate)
    lines = []
    for metric in METRICS:
        b, c = Samples.of(base, metric), Samples.of(cand, metric)
        for q in PERCENTILES:
            line = {"metric": metric, "percentile": q, **compare(b, c, q, args.resamples, args.seed),
                    "baseline_requests": b.requests, "candidate_requests": c.requests,
                    "baseline_runs": base_runs, "candidate_runs": cand_runs}
            print(json.dumps(line), flush=True)
            lines.append(line)
    return lines


if __name__ == "__main__":
    main()
