"""What a grammar may cost: a compile over the memory or time limit is
refused with a 400 naming the field before anything is queued (the trial
runs in a child process, so the server keeps serving), and the scheduler's
cache of compiled grammars stays within its bytes and empties on
/flush_cache. SmolLM2's tokenizer (49,152 tokens); on it a schema of N
two-value enum properties takes about N / 20 MB to compile."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from server_harness import ServerProcess

COMPILE_MB = 48  # the servers' and sandboxes' --grammar-compile-max-mb here
CACHE_MB = 1


def enum_schema(n: int, tag: str = "") -> dict:
    """An object of ``n`` enum properties (cheap to check, costly to compile)."""
    return {"type": "object", "properties": {f"{tag}p{i}": {"enum": [f"v{i}a", f"v{i}b"]} for i in range(n)}}


def small_schema(i: int) -> dict:
    """A distinct everyday schema (about 75 KB compiled on this vocabulary)."""
    return {"type": "object", "properties": {f"field_{i}": {"type": "string", "maxLength": 8},
                                             "count": {"type": "integer"}}, "required": [f"field_{i}"]}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from radixserve.model_loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model(None).tokenizer_dir)


def sandbox(tokenizer, max_mb: int, timeout_s: float):
    from radixserve.sampling.grammar_sandbox import GrammarSandbox
    from radixserve.server_args import CompileLimits

    return GrammarSandbox(tokenizer, len(tokenizer), CompileLimits(max_mb, timeout_s))


# -- the sandbox --------------------------------------------------------------------------------


def test_a_compile_over_the_memory_limit_is_refused_and_remembered(tokenizer):
    box = sandbox(tokenizer, COMPILE_MB, 120)
    try:
        box.check("json_schema", json.dumps(small_schema(0)))
        bomb = json.dumps(enum_schema(3000))
        with pytest.raises(ValueError, match=rf"^json_schema: .*more than {COMPILE_MB} MB \(--grammar-compile-max-mb"):
            box.check("json_schema", bomb)
        assert box.refused == 1
        box.check("regex", r"\d{3}-\d{4}")  # a fresh worker takes over
        start = time.monotonic()
        with pytest.raises(ValueError, match="--grammar-compile-max-mb"):
            box.check("json_schema", bomb)
        assert time.monotonic() - start < 0.5 and box.refused == 1  # the verdict, not a second trial
        with pytest.raises(ValueError, match=r"^ebnf: invalid ebnf"):  # the compiler's own errors name the kind
            box.check("ebnf", 'root ::= "a" undefined_rule')
    finally:
        box.close()


def test_a_compile_over_the_time_limit_is_refused_and_its_worker_replaced(tokenizer):
    box = sandbox(tokenizer, 8192, 1.0)
    try:
        box.check("json_schema", json.dumps(small_schema(1)))  # the worker is up: the limit times the compile alone
        worker = box._worker.proc
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"^json_schema: .*more than 1 s \(--grammar-compile-timeout\)"):
            box.check("json_schema", json.dumps(enum_schema(8000)))
        assert time.monotonic() - start < 5
        assert worker.poll() is not None  # killed, not left compiling
        worker = None
        box.check("json_schema", json.dumps(small_schema(2)))
        box._worker.proc.kill()  # a worker that dies between trials is replaced too
        box._worker.proc.wait()
        box.check("json_schema", json.dumps(small_schema(3)))
    finally:
        box.close()


# -- the scheduler's cache of compiled grammars --------------------------------------------------


def test_the_compiled_grammar_cache_is_bounded_in_bytes_least_recently_used_out(tokenizer):
    from radixserve.sampling.grammar import GrammarBackend

    bound = 400_000
    backend = GrammarBackend(tokenizer, len(tokenizer), cache_max_bytes=bound)
    specs = [("json_schema", json.dumps(small_schema(i))) for i in range(12)]
    first = backend.submit(specs[0]).result()
    one = first.memory_size_bytes + len(specs[0][1])
    assert 3 * one < bound < 10 * one  # so that twelve do not fit
    for spec in specs[1:6]:
        backend.submit(spec).result()
    assert backend.submit(specs[0]) is not None  # used again: now the most recent
    for spec in specs[6:]:
        backend.submit(spec).result()
    stats = backend.cache_stats()
    assert 0 < stats["grammar_cache_bytes"] <= bound and stats["grammar_cache_entries"] < len(specs)
    cached = set(backend._cache)
    assert specs[-1] in cached and specs[1] not in cached  # the oldest went first
    backend.clear_cache()
    assert backend.cache_stats() == {"grammar_cache_bytes": 0, "grammar_cache_entries": 0} and not backend._cache
    assert backend.submit(specs[0]).result().memory_size_bytes == first.memory_size_bytes  # compiles again


# -- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--max-total-tokens", "8192", "--grammar-compile-max-mb", str(COMPILE_MB),
                        "--grammar-cache-max-mb", str(CACHE_MB))
    yield srv
    assert srv.stop() == 0


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"radixserve:{name} ")))


@pytest.mark.slow
def test_a_grammar_over_the_limit_is_a_400_while_the_server_serves(server):
    url = server.url
    done: dict = {}

    def long_request():
        body = {"text": "Count to fifty:", "sampling_params": {"max_new_tokens": 96, "ignore_eos": True}}
        done["long"] = httpx.post(url + "/generate", json=body, timeout=120)

    runner = threading.Thread(target=long_request)
    runner.start()
    healthy = []

    def watch_health():
        for _ in range(10):
            healthy.append(httpx.get(url + "/health", timeout=10).status_code)
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_health)
    watcher.start()
    bomb = enum_schema(3000, tag="native")
    r = httpx.post(url + "/generate", json={"text": "Fill it in:", "sampling_params": {
        "max_new_tokens": 8, "json_schema": json.dumps(bomb)}}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "sampling_params.json_schema" and "--grammar-compile-max-mb" in error["message"]
    runner.join()
    watcher.join()
    assert done["long"].status_code == 200 and done["long"].json()["meta_info"]["completion_tokens"] == 96
    assert healthy == [200] * 10

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Fill in the form."}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "form", "schema": enum_schema(3000, tag="openai")}})
    assert refused.value.body["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "fill", "parameters": enum_schema(3000, tag="tool")}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                       tools=[tool], tool_choice="required")
    assert refused.value.body["param"] == "tools" and "--grammar-compile-max-mb" in refused.value.body["message"]

    ok = httpx.post(url + "/generate", json={"text": "Fill it in:", "sampling_params": {
        "max_new_tokens": 24, "json_schema": json.dumps(small_schema(0))}}, timeout=120)
    assert ok.status_code == 200
    state = server.wait_idle()
    assert state["memory_check"] == "ok"


@pytest.mark.slow
def test_the_grammar_cache_stays_within_its_bytes_and_flush_cache_empties_it(server):
    n = 40  # about 3 MB compiled in all, three times the cache
    body = {"text": ["Fill it in:"] * n,
            "sampling_params": [{"max_new_tokens": 1, "json_schema": json.dumps(small_schema(100 + i))} for i in range(n)]}
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    server.wait_idle()
    time.sleep(1.5)  # the scheduler's figures reach /metrics once it is idle
    cached = metric(server, "grammar_cache_bytes")
    assert 0 < cached <= CACHE_MB << 20
    assert 0 < metric(server, "grammar_cache_entries") < n
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while metric(server, "grammar_cache_bytes") != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(server, "grammar_cache_bytes") == 0 and metric(server, "grammar_cache_entries") == 0
