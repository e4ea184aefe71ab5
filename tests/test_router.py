"""Two radixserve replicas behind SGLang's router (``sglang-router``, the
Rust load balancer, started as ``python -m sglang_router.launch_router``) on
the CPU: every request kind goes through it, both replicas serve, the
cache-aware policy keeps a prefix on one replica, ``bench.serving`` reports a
per-replica breakdown, and a replica killed mid-run loses only the streams
it was sending (the router retries its other requests on the survivor, and
sends new ones there). docs/router.md describes the set-up and what the
router does when a worker dies."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import os
import signal
import time

import httpx
import pytest

from radixserve.bench.serving_workers import (combine_states, format_breakdown, parse_prometheus_counters,
                                               total_counters, worker_breakdown)
from router_harness import (FAST_HEALTH, ONE_THREAD, RouterProcess, counters_delta, start_servers, stop_all,
                            worker_counters)
from server_harness import wait_for

MODEL = "SmolLM2-135M-Instruct"
POOL = 1024  # KV tokens per replica: the bench test's shared prefixes (8 x 128) do not fit in one
GREEDY = {"temperature": 0, "max_new_tokens": 16}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def needs_router() -> None:
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed (make test installs it)")


# -- bench.serving's per-replica breakdown, without servers ------------------------------------------
def test_worker_counters_come_from_metrics_and_every_replicas_state():
    metrics = ("# TYPE radixserve:num_requests_total counter\n"
               'radixserve:num_requests_total{finish_reason="length"} 5.0\n'
               'radixserve:num_requests_total{finish_reason="stop"} 2.0\n'
               "radixserve:num_requests_created 1.7e9\nradixserve:prompt_tokens_total 700.0\n")
    assert parse_prometheus_counters(metrics) == {"requests": 7, "prompt_tokens": 700}
    # SGLang's names; a labelled counter declared but not incremented yet counts 0
    assert parse_prometheus_counters('sglang:cached_tokens_total{model_name="m"} 30.0\n'
                                     "# TYPE sglang:num_requests_total counter\n") == {
        "cached_tokens": 30, "requests": 0}
    # a --dp-size server reports each replica's state: counters add up, KV usage is the fullest's
    states = [{"dp_rank": 0, "prompt_tokens": 100, "cached_tokens": 40, "running": 2, "waiting": 0, "kv_usage": 0.5},
              {"dp_rank": 1, "prompt_tokens": 60, "cached_tokens": 0, "running": 1, "waiting": 3, "kv_usage": 0.25}]
    assert {k: v for k, v in combine_states(states).items() if k != "dp_rank"} == {
        "prompt_tokens": 160, "cached_tokens": 40, "running": 3, "waiting": 3, "kv_usage": 0.5}
    assert combine_states(states[:1]) is states[0]


def test_breakdown_rows_add_up_and_a_silent_worker_shows_as_unknown():
    before = {"w1": {"requests": 3, "prompt_tokens": 100, "cached_tokens": 10},
              "w2": {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0}, "w3": None}
    after = {"w1": {"requests": 9, "prompt_tokens": 700, "cached_tokens": 460},
             "w2": {"requests": 2, "prompt_tokens": 200, "cached_tokens": 0},
             "w3": {"requests": 1, "prompt_tokens": 10, "cached_tokens": 0}}
    rows = worker_breakdown(before, after)
    assert rows == [
        {"url": "w1", "requests": 6, "prompt_tokens": 600, "cached_tokens": 450, "cache_hit_rate": 0.75,
         "request_share": 0.75},
        {"url": "w2", "requests": 2, "prompt_tokens": 200, "cached_tokens": 0, "cache_hit_rate": 0.0,
         "request_share": 0.25},
        {"url": "w3", "requests": None, "prompt_tokens": None, "cached_tokens": None, "cache_hit_rate": None,
         "request_share": None}]
    assert total_counters(after) == {"prompt_tokens": 910, "cached_tokens": 460}
    assert total_counters(before) is None  # a worker that did not answer: no total
    lines = format_breakdown(rows)
    assert "Per replica" in lines[0] and lines[2].split() == ["w1", "6", "75%", "75.0%"]
    assert lines[4].split() == ["w3", "n/a", "n/a", "n/a"]


# -- two SmolLM2 replicas behind a cache-aware router -----------------------------------------------
@pytest.fixture(scope="module")
def replicas():
    needs_router()
    servers = start_servers(2, "--max-total-tokens", str(POOL), env=ONE_THREAD)
    yield servers
    stop_all(*servers)
    survivors = [s for s in servers if not getattr(s, "killed", False)]  # the module's last test kills one
    assert [s.proc.returncode for s in survivors] == [0] * len(survivors)


@pytest.fixture(scope="module")
def router(replicas, tmp_path_factory):
    rt = RouterProcess([s.url for s in replicas], *FAST_HEALTH, policy="cache_aware",
                       log_path=tmp_path_factory.mktemp("router") / "router.log")
    yield rt
    rt.stop()


@pytest.fixture(scope="module")
def routed(router):
    with httpx.Client(base_url=router.url, timeout=120) as c:
        yield c


def direct_text(replica, text: str) -> str:
    out = httpx.post(replica.url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=120)
    assert out.status_code == 200, out.text
    return out.json()["text"]


def sse_events(response: httpx.Response) -> list:
    data = [line[len("data: "):] for line in response.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


@pytest.mark.slow
def test_the_router_registers_both_replicas(router, replicas, routed):
    """It read /server_info and /model_info of each, finds them healthy, and
    reads their load (/get_load; -1 would mean it could not)."""
    workers = routed.get("/workers").json()["workers"]
    assert sorted((w["url"], w["model_id"], w["is_healthy"]) for w in workers) == sorted(
        (s.url, MODEL, True) for s in replicas)
    assert [m["id"] for m in routed.get("/v1/models").json()["data"]] == [MODEL]
    loads = routed.get("/get_loads").json()["workers"]
    assert sorted((w["worker"], w["load"]) for w in loads) == sorted((s.url, 0) for s in replicas)


@pytest.mark.slow
def test_generate_streamed_and_not_is_a_replicas_greedy_output(routed, replicas):
    body = {"text": "The capital of France is", "sampling_params": GREEDY}
    whole = routed.post("/generate", json=body)
    assert whole.status_code == 200, whole.text
    assert whole.json()["text"] == direct_text(replicas[0], body["text"]) == direct_text(replicas[1], body["text"])
    with routed.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert len(events) > 1 and events[-1]["text"] == whole.json()["text"]
    assert events[-1]["meta_info"]["finish_reason"] is not None


@pytest.mark.slow
def test_openai_completions_and_chat_through_the_sdk(router, replicas):
    from openai import OpenAI

    sdk = OpenAI(base_url=router.url + "/v1", api_key="none", timeout=120)
    ref = OpenAI(base_url=replicas[1].url + "/v1", api_key="none", timeout=120)
    prompt = "The capital of France is"
    done = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    chunks = sdk.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    expected = ref.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0).choices[0].text
    assert done.choices[0].text == streamed == expected and expected.startswith(" Paris")
    reply = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    chunks = sdk.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = ref.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    assert reply.choices[0].message.content == streamed == expected.choices[0].message.content
    assert "Paris" in streamed and reply.usage.prompt_tokens == expected.usage.prompt_tokens


async def _open_stream(stack: contextlib.AsyncExitStack, ac: httpx.AsyncClient, body: dict):
    """A streamed /generate whose first event has arrived (so the router counts it in flight)."""
    r = await stack.enter_async_context(ac.stream("POST", "/generate", json={**body, "stream": True}))
    assert r.status_code == 200
    lines = r.aiter_lines()
    async for line in lines:
        if line.startswith("data: "):
            return lines
    raise AssertionError("the stream ended before its first event")


async def _drain(lines) -> list[str]:
    return [line async for line in lines if line.startswith("data: ")]


@pytest.mark.slow
def test_requests_in_flight_together_go_to_both_replicas(router, replicas):
    """Unrelated prompts: cache_aware sends each to the replica with the fewest
    requests in flight, as the router counts them."""
    openings = ["Alpha centauri is", "Bravo, said the crowd to", "Charlie went to the market and",
                "Delta rivers form where"]
    before = [worker_counters(s.url) for s in replicas]

    async def run():
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as ac, contextlib.AsyncExitStack() as stack:
            streams = [await _open_stream(stack, ac, {"text": text, "sampling_params": {
                "max_new_tokens": 12, "ignore_eos": True}}) for text in openings]
            return [await _drain(lines) for lines in streams]

    tails = asyncio.run(run())
    assert all(tail[-1] == "data: [DONE]" for tail in tails)
    served = [counters_delta(b, worker_counters(s.url))["requests"] for b, s in zip(before, replicas)]
    assert sorted(served) == [2, 2], served


PREFIXES = {  # two long shared prompts whose opening characters differ (the router matches characters)
    "A": "You are a careful assistant for a shipping company. " + " ".join(
        f"Rule {i}: parcels of class {i} leave from dock {i % 7} before noon." for i in range(14)),
    "B": "Welcome to the city library help desk. " + " ".join(
        f"Note {i}: books on shelf {i} may be borrowed for {i + 3} days." for i in range(14)),
}


def _served_by(replicas, before: list[dict]) -> int:
    """The index of the one replica that served one request since ``before``."""
    served = [counters_delta(b, worker_counters(s.url))["requests"] for b, s in zip(before, replicas)]
    assert sorted(served) == [0, 1], served
    return served.index(1)


@pytest.mark.slow
def test_cache_aware_keeps_each_shared_prefix_on_one_replica(router, replicas, routed):
    """Each prefix's first request lands on the less busy replica (A's is in
    flight when B's arrives, so they part); every later request sharing it goes
    to the same replica and finds it cached there."""

    def body(group: str, question: str, n: int = 2) -> dict:
        return {"text": PREFIXES[group] + f"\nQuestion: {question}?", "sampling_params": {
            "max_new_tokens": n, "ignore_eos": True}}

    before = [worker_counters(s.url) for s in replicas]

    async def seed():
        async with httpx.AsyncClient(base_url=router.url, timeout=120) as ac, contextlib.AsyncExitStack() as stack:
            first_a = await _open_stream(stack, ac, body("A", "which dock", 12))
            first_b = await ac.post("/generate", json=body("B", "how long"))
            assert first_b.status_code == 200
            assert (await _drain(first_a))[-1] == "data: [DONE]"

    asyncio.run(seed())
    seeded = [counters_delta(b, worker_counters(s.url))["requests"] for b, s in zip(before, replicas)]
    assert seeded == [1, 1], "the two first requests went to different replicas"
    home: dict[str, set[int]] = {"A": set(), "B": set()}
    for group, question in [("A", "when"), ("B", "which shelf"), ("A", "which class"), ("B", "may I renew")]:
        before = [worker_counters(s.url) for s in replicas]
        out = routed.post("/generate", json=body(group, question))
        assert out.status_code == 200, out.text
        home[group].add(_served_by(replicas, before))
        meta = out.json()["meta_info"]
        assert meta["cached_tokens"] >= 0.9 * meta["prompt_tokens"], f"{group}'s prefix was not cached there: {meta}"
    assert len(home["A"]) == len(home["B"]) == 1 and home["A"] != home["B"], home


# -- bench.serving through the router --------------------------------------------------------------
@pytest.mark.slow
def test_bench_serving_reports_each_replica(router, replicas, tmp_path, capsys):
    """W4 scaled down: 8 groups of 128-token system prompts (1024 tokens, the
    whole pool of one replica) through the router; --worker-urls reads each
    worker's counters, and the breakdown adds up to the run."""
    from radixserve.bench import serving

    assert 8 * 128 >= POOL, "more shared prefix than one replica's pool holds"
    out = tmp_path / "gsp.json"
    rc = serving.main(["--base-url", router.url, "--worker-urls", *(s.url for s in replicas), "--disable-tqdm",
                       "--output-json", str(out), "--no-tokenizer", "--dataset-name", "generated-shared-prefix",
                       "--gsp-num-groups", "8", "--gsp-prompts-per-group", "4", "--gsp-system-prompt-len", "128",
                       "--gsp-question-len", "8", "--gsp-output-len", "2", "--max-concurrency", "4"])
    run = json.loads(out.read_text())["runs"][0]
    assert rc == 0 and (run["completed"], run["failed"]) == (32, 0)
    rows = run["workers"]
    assert [r["url"] for r in rows] == [s.url for s in replicas]
    assert sum(r["requests"] for r in rows) == 32 and all(r["requests"] > 0 for r in rows)
    assert sum(r["request_share"] for r in rows) == pytest.approx(1)
    assert sum(r["prompt_tokens"] for r in rows) == run["total_input_tokens"] == 32 * 136
    for r in rows:
        assert r["cache_hit_rate"] == pytest.approx(r["cached_tokens"] / r["prompt_tokens"])
    # the router has no counters of its own: the run's hit rate is the workers' together, and agrees
    # with what each reply said it found cached
    cached = sum(r["cached_tokens"] for r in rows)
    assert run["cache_hit_rate"] == pytest.approx(cached / run["total_input_tokens"])
    assert run["cache_hit_rate"] == pytest.approx(run["cache_hit_rate_requests"])
    # each group stays on one replica, whose pool holds its half of the groups: near the ideal
    assert run["cache_hit_rate"] >= 0.8 * run["ideal_cache_hit_rate"], (run["cache_hit_rate"], rows)
    assert run["peak_running_requests"] is not None  # polled from the workers, the router has none
    table = capsys.readouterr().err
    assert "Per replica" in table and all(s.url.removeprefix("http://") in table for s in replicas)


@pytest.mark.slow
def test_the_router_flushes_both_replicas(routed, replicas):
    out = routed.post("/flush_cache").json()
    assert out["workers_flushed"] == 2 and out["total_http_workers"] == 2
    assert [s.wait_idle()["kv_cached"] for s in replicas] == [0, 0]


# -- one replica killed mid-run ----------------------------------------------------------------------
# A request that fails on a dead worker is sent again after 50-200 ms. The circuit breaker opens at the
# first failure, so that retry and every new request go to the survivor at once; without it the router
# keeps choosing the dead worker (cache_aware: it has the prefix, or the least load) until a health check
# fails, up to a second later here, and those requests end with 500s (docs/router.md).
KILL_ROUTER_ARGS = (*FAST_HEALTH, "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
                    "--retry-max-backoff-ms", "200", "--cb-failure-threshold", "1")
PROMPT_LENS = (4, 8, 16, 32, 64, 128)  # powers of two: a replica's prompt-token count says which it holds
STREAMED = {0, 1, 2}  # the router alternates replicas: each holds streamed and plain requests
# SmolLM2 decodes slowly enough on the CPU that every request is surely still running when the victim
# dies (tiny-llama finishes 2,000 tokens, its context, in about a second), and these few complete soon after
LONG_TOKENS = 64


@pytest.fixture
def fragile(replicas, tmp_path):
    """The two SmolLM2 replicas, idle, behind a router of their own; the
    router is stopped at the end, the replicas (one of which the test kills)
    with the module. The test that uses it comes last in the module."""
    rt = RouterProcess([s.url for s in replicas], *KILL_ROUTER_ARGS, log_path=tmp_path / "router.log")
    try:
        yield rt, replicas
    finally:
        rt.stop()


def _body(i: int, max_new_tokens: int = LONG_TOKENS) -> dict:
    start = 10 + 200 * i  # no two prompts share a prefix
    return {"input_ids": list(range(start, start + PROMPT_LENS[i])), "stream": i in STREAMED,
            "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}}


async def _outcome(ac: httpx.AsyncClient, body: dict) -> dict:
    """How a request ended: HTTP status, error (body or event), whether a
    stream reached [DONE], tokens, and when (time.monotonic())."""
    out = {"status": None, "error": None, "done": False, "tokens": None}
    try:
        async with ac.stream("POST", "/generate", json=body) as r:
            out["status"] = r.status_code
            if not body["stream"]:
                data = json.loads(await r.aread())
                out["error"] = data.get("error")
                out["tokens"] = (data.get("meta_info") or {}).get("completion_tokens")
                out["done"] = r.status_code == 200
            else:
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        out["done"] = True
                    elif line.startswith("data: "):
                        event = json.loads(line[len("data: "):])
                        out["error"] = event.get("error", out["error"])
                        out["tokens"] = event.get("meta_info", {}).get("completion_tokens", out["tokens"])
    except httpx.HTTPError as exc:  # the router cut the connection
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["at"] = time.monotonic()
    return out


def _kill_with_children(srv) -> None:
    srv.killed = True
    for pid in [srv.proc.pid, *srv.children().values()]:
        os.kill(pid, signal.SIGKILL)


async def _kill_mid_run(rt, servers) -> tuple[set[int], float, list[dict], list[dict]]:
    """Start the long requests one at a time (so the router counts each in
    flight and alternates), SIGKILL the first replica and its children, and
    at once send new requests. Returns the indices the victim held, the time
    of the kill, how the long requests ended and how the new ones did."""
    async with httpx.AsyncClient(base_url=rt.url, timeout=60) as ac:
        before = [worker_counters(s.url) for s in servers]

        def arrived(i: int) -> bool:
            return sum(worker_counters(s.url)["prompt_tokens"] - b["prompt_tokens"]
                       for s, b in zip(servers, before)) == sum(PROMPT_LENS[:i + 1])

        tasks = []
        for i in range(len(PROMPT_LENS)):
            tasks.append(asyncio.create_task(_outcome(ac, _body(i))))
            await asyncio.to_thread(wait_for, lambda: arrived(i), 10, f"request {i} reaching a replica", 0.05)
        counts = [worker_counters(s.url) for s in servers]
        held = [counters_delta(b, c)["prompt_tokens"] for b, c in zip(before, counts)]
        on_victim = {i for i, n in enumerate(PROMPT_LENS) if held[0] & n}
        assert STREAMED & on_victim and on_victim - STREAMED and on_victim != set(range(6)), held
        assert counts[1]["running"] + counts[1]["waiting"] == len(PROMPT_LENS) - len(on_victim), \
            "the survivor's requests are all in flight"
        t0 = time.monotonic()
        _kill_with_children(servers[0])
        # the prompt of one of the victim's requests (the router's tree places it on the dead replica),
        # and unrelated ones, streamed and not
        again = {**_body(min(on_victim), 8), "stream": False}
        fresh = [{"input_ids": [3, 4, 5 + k], "stream": k % 2 == 0,
                  "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}} for k in range(4)]
        later = [asyncio.create_task(_outcome(ac, b)) for b in [again, *fresh]]
        return on_victim, t0, await asyncio.gather(*tasks), await asyncio.gather(*later)


@pytest.mark.slow
def test_a_killed_replica_loses_only_its_streams_in_flight(fragile):
    """SIGKILL one replica (server and children) with six long requests in
    flight over both: the victim's streams are cut before its plain requests,
    retried on the survivor, complete, the survivor's own
    complete, and requests sent right after the kill succeed."""
    rt, (victim, survivor) = fragile
    survivor_before = worker_counters(survivor.url)
    on_victim, t0, ended, after = asyncio.run(_kill_mid_run(rt, (victim, survivor)))
    complete = {"status": 200, "done": True, "error": None, "tokens": LONG_TOKENS}
    for i, out in enumerate(ended):
        outcome = {k: out[k] for k in complete}
        if i in on_victim and i in STREAMED:
            # the router ends the chunked reply without its last chunk: no [DONE], no error event
            assert out["status"] == 200 and not out["done"] and "incomplete chunked read" in out["error"], out
        else:  # the survivor's, and the victim's plain ones (nothing was sent back yet: the router retried)
            assert outcome == complete, (i, i in on_victim, out)
            assert out["at"] - t0 < 30
    # The router learns of the death once, from the broken connections: it cuts the victim's
    # streams then, and only then retries its plain requests, which generate all their
    # tokens again on the survivor. A stream cut late (on a timeout, say) would end after them.
    cut_last = max(ended[i]["at"] for i in on_victim & STREAMED)
    retried_first = min(ended[i]["at"] for i in on_victim - STREAMED)
    assert cut_last < retried_first, "the victim's streams were cut when its plain requests were retried"
    for out in after:
        assert {k: out[k] for k in complete} == {**complete, "tokens": 8}, out
    wait_for(lambda: not next(w for w in httpx.get(rt.url + "/workers").json()["workers"]
                              if w["url"] == victim.url)["is_healthy"], 10, "the router marking the victim unhealthy")
    # the survivor finished all of those (the victim's plain ones once more), and nothing else
    served = counters_delta(survivor_before, worker_counters(survivor.url))["requests"]
    assert served == len(PROMPT_LENS) - len(on_victim & STREAMED) + len(after)
