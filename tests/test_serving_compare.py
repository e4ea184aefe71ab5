"""``bench.serving_compare``: percentiles of two servers' saved requests,
pooled over runs, and the bootstrap interval of their ratio, on hand-made
timelines whose answer is known."""

from __future__ import annotations

import json

import numpy as np
import pytest

from radixserve.bench.serving_compare import METRICS, Samples, compare, main
from radixserve.bench.serving_metrics import RequestRecord, record_to_json


def _records(n: int, ttft_s, gap_s, seed: int, tokens: int = 20) -> list[RequestRecord]:
    """``n`` requests a second apart; ``ttft_s`` and ``gap_s`` are functions of a generator."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        first = i + ttft_s(rng)
        times = list(first + np.cumsum([0.0] + [gap_s(rng) for _ in range(tokens - 1)]))
        out.append(RequestRecord(0, 0, float(i), times[-1], times, list(range(1, tokens + 1)), 100, tokens,
                                 success=True))
    return out


def _save(path, *runs: list[RequestRecord]) -> str:
    path.write_text(json.dumps({"runs": [{"label": "x", "requests": [record_to_json(r, 0.0) for r in run]}
                                         for run in runs]}))
    return str(path)


def _by_key(lines):
    return {(r["metric"], r["percentile"]): r for r in lines}


def test_a_slower_candidate_is_told_apart_and_runs_are_pooled(tmp_path):
    base = [_save(tmp_path / f"b{i}.json", _records(150, lambda g: g.uniform(0.09, 0.11), lambda g: g.uniform(0.009, 0.011), i))
            for i in range(2)]
    cand = _save(tmp_path / "c.json", _records(150, lambda g: g.uniform(0.12, 0.14), lambda g: g.uniform(0.0115, 0.0125), 7),
                 _records(150, lambda g: g.uniform(0.12, 0.14), lambda g: g.uniform(0.0115, 0.0125), 8))
    got = _by_key(main(["--baseline", *base, "--candidate", cand, "--resamples", "300"]))
    ttft = got[("ttft_ms", 50)]
    assert ttft["baseline_runs"] == 2 and ttft["candidate_runs"] == 2 and ttft["baseline_requests"] == 300
    assert ttft["baseline"] == pytest.approx(100, abs=2) and ttft["candidate"] == pytest.approx(130, abs=2)
    assert 1.2 < ttft["ci95"][0] <= ttft["ratio"] <= ttft["ci95"][1] < 1.4
    itl = got[("itl_ms", 99)]
    assert 1.1 < itl["ci95"][0] <= itl["ratio"] <= itl["ci95"][1] < 1.35


def test_the_same_server_twice_mostly_gives_an_interval_around_one():
    """Pairs of runs of one server, whose p99s rest on a rare slow tail:
    each interval should hold 1 about 95% of the time (2 misses of 10
    pairs at most here), and be wide."""
    slow_tail = lambda g: 0.1 + (g.exponential(0.2) if g.random() < 0.05 else 0.0)  # noqa: E731
    gaps = lambda g: 0.01 + (g.exponential(0.05) if g.random() < 0.02 else 0.0)  # noqa: E731
    misses = {metric: 0 for metric in METRICS}
    for k in range(10):
        a, b = _records(200, slow_tail, gaps, 100 + 2 * k), _records(200, slow_tail, gaps, 101 + 2 * k)
        for metric in METRICS:
            line = compare(Samples.of(a, metric), Samples.of(b, metric), 99, resamples=200, seed=k)
            misses[metric] += not line["ci95"][0] <= 1.0 <= line["ci95"][1]
            assert line["ci95"][1] - line["ci95"][0] > 0.1, "a p99 of 200 requests with a rare slow tail is not that certain"
    assert all(m <= 2 for m in misses.values()), misses


def test_a_request_is_resampled_with_all_its_gaps():
    s = Samples(np.array([1.0, 1.0, 2.0, 2.0, 2.0]), np.array([0, 2, 5]))
    rng = np.random.default_rng(0)
    for _ in range(50):
        drawn = s.resample(rng)
        assert (drawn == 1.0).sum() % 2 == 0 and (drawn == 2.0).sum() % 3 == 0
        assert len(drawn) in (4, 5, 6)


def test_files_saved_without_requests_are_refused_by_flag(tmp_path):
    path = tmp_path / "plain.json"
    path.write_text(json.dumps({"runs": [{"label": "x", "completed": 3}]}))
    with pytest.raises(ValueError, match="--save-requests"):
        main(["--baseline", str(path), "--candidate", str(path)])
