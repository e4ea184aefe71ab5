"""What bench-serving reads from servers: the benchmarked server's load
while a rate runs (``read_server_state``, ``poll_server``), and, against a
router, the workers behind it (``--worker-urls``), read before and after each rate, and their counters give a per-replica
breakdown: requests served, prompt tokens, prefix-cache hit rate.

The router's own figures cannot say this: sglang-router counts requests per
worker but knows nothing of the workers' caches. Each worker counts

- finished requests: ``*:num_requests_total`` in /metrics (radixserve's and
  SGLang's name, summed over finish reasons);
- prompt and cached tokens: ``prompt_tokens`` / ``cached_tokens`` of
  /get_server_info's ``internal_states`` (radixserve; summed over the
  replicas of a ``--dp-size`` server), else the
  ``*:prompt_tokens_total`` / ``*:cached_tokens_total`` counters of /metrics
  (SGLang with ``--enable-metrics``).
"""

from __future__ import annotations

import asyncio
import json

from radixserve.bench.serving_metrics import parse_prometheus_gauges

COUNTERS = ("requests", "prompt_tokens", "cached_tokens")
# what a --dp-size server reports per replica, and its whole is the sum of
SUMMED_STATES = ("prompt_tokens", "cached_tokens", "generated", "forward_ct", "retractions", "running", "waiting")
_METRIC_NAMES = {"num_requests_total": "requests", "prompt_tokens_total": "prompt_tokens",
                 "cached_tokens_total": "cached_tokens"}


def parse_prometheus_counters(text: str) -> dict:
    """``requests``, ``prompt_tokens``, ``cached_tokens`` from the counters of a
    /metrics page (any prefix, labels summed); the ones it lacks are absent. A
    counter declared (``# TYPE``) without samples yet, as a labelled one is
    before its first increment, counts 0."""
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            name = _METRIC_NAMES.get(line.split()[2].split(":")[-1].removesuffix("_total") + "_total")
            if name:
                out.setdefault(name, 0)
            continue
        if line.startswith("#") or " " not in line:
            continue
        metric, value = line.rsplit(" ", 1)
        name = _METRIC_NAMES.get(metric.split("{")[0].split(":")[-1])
        if name:
            out[name] = out.get(name, 0) + float(value)
    return {k: int(v) for k, v in out.items()}


def combine_states(states: list[dict]) -> dict:
    """One server's state from its ``internal_states``: a ``--dp-size``
    server reports one per replica; counters and request counts add up, the
    KV usage is the highest replica's."""
    if len(states) == 1:
        return states[0]
    out = dict(states[0])
    for key in SUMMED_STATES:
        if all(key in s for s in states):
            out[key] = sum(s[key] for s in states)
    if all("kv_usage" in s for s in states):
        out["kv_usage"] = max(s["kv_usage"] for s in states)
    return out


async def http_call(client, method: str, url: str, headers: dict, timeout: float) -> tuple[int, str]:
    """One short request on bench-serving's ``aiohttp.ClientSession``: its
    status and body."""
    import aiohttp

    async with client.request(method, url, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
        return resp.status, await resp.text()


async def read_worker_counters(client, url: str, headers: dict) -> dict | None:
    """One worker's cumulative counters (see the module's docstring); None if
    it does not answer or reports no token counts."""
    counters: dict = {}
    try:
        status, text = await http_call(client, "GET", url + "/metrics", headers, 10)
        if status == 200:
            counters.update(parse_prometheus_counters(text))
        status, text = await http_call(client, "GET", url + "/get_server_info", headers, 10)
        if status == 200:
            state = combine_states(json.loads(text).get("internal_states") or [{}])
            counters.update({k: state[k] for k in ("prompt_tokens", "cached_tokens") if k in state})
    except Exception:  # noqa: BLE001 - a worker that does not answer is reported as such
        return None
    return counters if "prompt_tokens" in counters else None


async def read_workers(client, urls: list[str], headers: dict) -> dict[str, dict | None]:
    states = await asyncio.gather(*(read_worker_counters(client, url, headers) for url in urls))
    return dict(zip(urls, states))


def total_counters(states: dict[str, dict | None]) -> dict | None:
    """The workers' counters summed (what a single server would report); None
    unless every worker answered with token counts."""
    if not states or any(s is None or "cached_tokens" not in s for s in states.values()):
        return None
    return {k: sum(s[k] for s in states.values()) for k in ("prompt_tokens", "cached_tokens")}


def worker_breakdown(before: dict[str, dict | None], after: dict[str, dict | None]) -> list[dict]:
    """One row per worker: what it counted between ``before`` and ``after``
    (None where it did not answer either time), its hit rate and its share of
    the requests."""
    rows = []
    for url in after:
        b, a = before.get(url), after.get(url)
        row: dict = {"url": url}
        for k in COUNTERS:
            row[k] = a[k] - b[k] if a and b and k in a and k in b else None
        prompt, cached = row["prompt_tokens"], row["cached_tokens"]
        row["cache_hit_rate"] = cached / prompt if prompt and cached is not None else None
        rows.append(row)
    served = sum(r["requests"] or 0 for r in rows)
    for row in rows:
        row["request_share"] = row["requests"] / served if served and row["requests"] is not None else None
    return rows


def format_breakdown(rows: list[dict]) -> list[str]:
    """Lines for the result table: requests, share and hit rate per worker."""
    def f(v, fmt):
        return "n/a" if v is None else fmt.format(v)

    lines = [f"{' Per replica ':-^56}", f"{'worker':<30}{'requests':>9}{'share':>8}{'hit rate':>9}"]
    for r in rows:
        url = r["url"].removeprefix("http://")
        lines.append(f"{url[-30:]:<30}{f(r['requests'], '{}'):>9}{f(r['request_share'], '{:.0%}'):>8}"
                     f"{f(r['cache_hit_rate'], '{:.1%}'):>9}")
    return lines


# -- the benchmarked server's load while a rate runs ----------------------------------------
async def read_server_state(client, cfg, url: str | None = None) -> dict | None:
    """The scheduler's counters from /get_server_info, or the running / waiting
    gauges from /metrics for servers without it; None if neither answers.
    ``url``: another server than the one benchmarked (a worker behind it)."""
    url = url or cfg.base_url
    try:
        status, text = await http_call(client, "GET", url + "/get_server_info", cfg.headers(), 10)
        if status == 200:
            state = combine_states(json.loads(text).get("internal_states") or [{}])  # --dp-size: one per replica
            if "running" in state:
                return state
        status, text = await http_call(client, "GET", url + "/metrics", cfg.headers(), 10)
        if status == 200:
            return parse_prometheus_gauges(text)
    except Exception:  # noqa: BLE001 - server statistics are optional
        pass
    return None


async def poll_server(client, cfg, state, interval: float,
                      worker_urls: list[str] | None = None) -> None:
    """Peak running / waiting requests and KV usage; behind a router, the
    workers' running and waiting summed (the router reports neither)."""
    while True:
        if worker_urls:
            states = await asyncio.gather(*(read_server_state(client, cfg, url) for url in worker_urls))
            s = _sum_gauges([x for x in states if x])
        else:
            s = await read_server_state(client, cfg)
        if s:
            if "running" in s:
                state.peak_running = max(state.peak_running or 0, int(s["running"]))
            if "waiting" in s:
                state.peak_waiting = max(state.peak_waiting or 0, int(s["waiting"]))
            if "kv_usage" in s:
                state.peak_kv_usage = max(state.peak_kv_usage or 0.0, float(s["kv_usage"]))
        await asyncio.sleep(interval)


def _sum_gauges(states: list[dict]) -> dict | None:
    """Running and waiting requests summed over servers, the highest KV usage."""
    out: dict = {}
    for s in states:
        for key in ("running", "waiting"):
            if key in s:
                out[key] = out.get(key, 0) + int(s[key])
        if "kv_usage" in s:
            out["kv_usage"] = max(out.get("kv_usage", 0.0), float(s["kv_usage"]))
    return out or None
