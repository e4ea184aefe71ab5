"""bench-serving's per-request records and the metrics computed from them:
pure functions, testable on a hand-made timeline (see ``serving.py``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestRecord:
    """What the client saw of one request; times are ``time.perf_counter()`` seconds."""

    conversation: int
    turn: int
    start: float
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk that brought tokens
    chunk_tokens: list[int | None] = field(default_factory=list)  # tokens so far at that chunk (None: unknown)
    prompt_len: int = 0
    output_len: int = 0
    cached_tokens: int | None = None  # as the server reported it for this request
    success: bool = False
    error: str = ""


def ttft(r: RequestRecord) -> float:
    return r.chunk_times[0] - r.start


def e2e(r: RequestRecord) -> float:
    return r.end - r.start


def tpot(r: RequestRecord) -> float | None:
    """Mean time per output token after the first; None for a one-token reply."""
    if r.output_len < 2:
        return None
    return (e2e(r) - ttft(r)) / (r.output_len - 1)


def itls(r: RequestRecord) -> list[float]:
    """Inter-token latencies: a chunk bringing n tokens after gap g counts n times g / n.
    Without token counts (OpenAI text streams) each chunk counts as one token."""
    out = []
    for i in range(1, len(r.chunk_times)):
        gap = r.chunk_times[i] - r.chunk_times[i - 1]
        prev, cur = r.chunk_tokens[i - 1], r.chunk_tokens[i]
        n = cur - prev if prev is not None and cur is not None else 1
        out.extend([gap / n] * n if n > 0 else [])
    return out


def stream_pacing(records: list[RequestRecord]) -> dict[str, float | None]:
    """Whether the streams kept pace with the server's steps, over the events
    after each request's first: ``coalesced_tokens``, the share of tokens
    that came in an event bringing several (the server's front end sent
    several steps at once); ``bunched_events``, the share of events that
    arrived with the one before (the client read them in one go). A step
    makes one token per request, so both are 0 when everything keeps pace."""
    tokens = coalesced = events = bunched = 0
    for r in records:
        for i in range(1, len(r.chunk_times)):
            events += 1
            bunched += r.chunk_times[i] == r.chunk_times[i - 1]
            prev, cur = r.chunk_tokens[i - 1], r.chunk_tokens[i]
            n = cur - prev if prev is not None and cur is not None else 1
            tokens += n
            coalesced += n if n > 1 else 0
    return {"coalesced_tokens": coalesced / tokens if tokens else None,
            "bunched_events": bunched / events if events else None}


def summarize(values: list[float], scale: float = 1000.0) -> dict[str, float | None]:
    """mean, median, p90, p99 (linear interpolation, as numpy), scaled (default: s to ms)."""
    if not values:
        return {"mean": None, "median": None, "p90": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)),
            "p90": float(np.percentile(a, 90)), "p99": float(np.percentile(a, 99))}


def meets_slo(r: RequestRecord, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    if slo_ttft_ms is not None and ttft(r) * 1000 > slo_ttft_ms:
        return False
    t = tpot(r)
    return slo_tpot_ms is None or t is None or t * 1000 <= slo_tpot_ms


def compute_metrics(records: list[RequestRecord], duration: float, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Aggregate figures over one run of ``duration`` seconds (first send to last reply)."""
    ok = [r for r in records if r.success]
    prompt = sum(r.prompt_len for r in ok)
    output = sum(r.output_len for r in ok)
    known = [r for r in ok if r.cached_tokens is not None]
    dur = max(duration, 1e-9)
    good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in ok)
    turns = sorted({r.turn for r in ok})
    return {
        "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
        "total_input_tokens": prompt, "total_output_tokens": output,
        "request_throughput": len(ok) / dur, "input_throughput": prompt / dur,
        "output_throughput": output / dur, "total_throughput": (prompt + output) / dur,
        "ttft_ms": summarize([ttft(r) for r in ok]),
        # a multi-turn run's TTFT by turn: a policy that favours cache hits (lpm) makes first turns wait
        "ttft_ms_by_turn": ({str(t): summarize([ttft(r) for r in ok if r.turn == t]) for t in turns}
                            if len(turns) > 1 else None),
        "tpot_ms": summarize([t for r in ok if (t := tpot(r)) is not None]),
        "itl_ms": summarize([x for r in ok for x in itls(r)]),
        "e2e_ms": summarize([e2e(r) for r in ok]),
        "stream_pacing": stream_pacing(ok),
        "slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms,
        "goodput": good / dur, "slo_attainment": good / len(ok) if ok else None,
        "cache_hit_rate_requests": (sum(r.cached_tokens for r in known) / max(sum(r.prompt_len for r in known), 1)
                                    if known else None),
    }


def record_to_json(r: RequestRecord, t0: float) -> dict:
    """A record with times in seconds from ``t0`` (the run's start), to 0.1 ms."""
    d = asdict(r)
    for key in ("start", "end"):
        d[key] = round(d[key] - t0, 4)
    d["chunk_times"] = [round(t - t0, 4) for t in r.chunk_times]
    return d


def counters_hit_rate(before: dict | None, after: dict | None) -> float | None:
    """Prefix-cache hit rate over a run from the server's cumulative counters."""
    if not before or not after or "prompt_tokens" not in after or "cached_tokens" not in after:
        return None
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return (after["cached_tokens"] - before["cached_tokens"]) / prompt if prompt > 0 else None


def parse_prometheus_gauges(text: str) -> dict | None:
    """running / waiting requests from ``*:num_running_reqs`` / ``*:num_queue_reqs`` lines."""
    names = {"num_running_reqs": "running", "num_queue_reqs": "waiting", "token_usage": "kv_usage"}
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        metric, value = line.rsplit(" ", 1)
        short = metric.split("{")[0].split(":")[-1]
        if short in names:
            out[names[short]] = out.get(names[short], 0) + float(value)
    return out or None
