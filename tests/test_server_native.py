"""The SGLang-native HTTP API against a real server (SmolLM2 on the CPU, in a
subprocess): every endpoint, every error case, streaming, disconnect-abort,
concurrency, metrics, and a clean shutdown."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from server_harness import ONE_THREAD, Prestarted, wait_for

pytestmark = pytest.mark.slow
PROMPT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = {"temperature": 0, "max_new_tokens": 16}


@pytest.fixture(scope="module")
def server(smollm2_keyed):
    return smollm2_keyed  # conftest.py: shared with test_hostile.py and test_server_openai.py


@pytest.fixture(scope="module", autouse=True)
def early(request):
    """The warm-up test's server (if it is selected), started in the
    background with the module's first test: it loads while the tests
    before that one run."""
    wanted = any(item.name == "test_the_server_warms_up_before_it_reports_healthy" for item in request.session.items)
    started = Prestarted({"warm": (("--model-path", "tiny-llama", "--max-total-tokens", "4096"),
                                   {"warmup": True, "env": ONE_THREAD})} if wanted else {})
    yield started
    started.stop()


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=120) as c:
        yield c


def sse_events(text: str) -> list:
    data = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_generate_text_and_meta(client):
    out = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
    assert out["text"].startswith("The capital of France is Paris.")
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": 2}
    assert meta["prompt_tokens"] > 10 and meta["completion_tokens"] == len(out["output_ids"])
    assert meta["e2e_latency"] > 0
    again = client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).json()
    assert again["meta_info"]["cached_tokens"] > 0 and again["text"] == out["text"]


def test_generate_batch_input_ids_and_n(client):
    ids = client.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 1}}).json()
    outs = client.post("/generate", json={"input_ids": [[1, 2, 3], [4, 5]],
                                          "sampling_params": {"temperature": 0, "max_new_tokens": 2}}).json()
    assert isinstance(outs, list) and len(outs) == 2 and [o["index"] for o in outs] == [0, 1]
    outs = client.post("/generate", json={"text": "Once upon a time", "sampling_params": {
        "n": 3, "temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 7}}).json()
    assert len(outs) == 3 and len({o["text"] for o in outs}) > 1
    assert ids["meta_info"]["completion_tokens"] == 1
    # one rid for a batch: each prompt's is rid_i, as SGLang names them (a shared one left the batch hanging)
    outs = client.post("/generate", json={"text": ["a", "b"], "rid": "batch-rid",
                                          "sampling_params": {"max_new_tokens": 1}}, timeout=30).json()
    assert [o["meta_info"]["id"] for o in outs] == ["batch-rid_0", "batch-rid_1"]


def test_stream_equals_non_stream(client):
    body = {"text": PROMPT, "sampling_params": GREEDY}
    whole = client.post("/generate", json=body).json()
    events = sse_events(client.post("/generate", json={**body, "stream": True}).text)
    assert events[-1]["text"] == whole["text"] and events[-1]["output_ids"] == whole["output_ids"]
    assert events[-1]["meta_info"]["finish_reason"] is not None
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])


def test_stop_strings_and_logprobs(client):
    out = client.post("/generate", json={"text": PROMPT, "sampling_params": {**GREEDY, "stop": ["France"]}}).json()
    assert out["text"] == "The capital of " and out["meta_info"]["finish_reason"]["matched"] == "France"
    out = client.post("/generate", json={"text": "The capital of France is",
                                         "sampling_params": {"temperature": 0, "max_new_tokens": 4},
                                         "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
                                         "return_text_in_logprobs": True}).json()
    meta = out["meta_info"]
    assert meta["input_token_logprobs"][0][0] is None and len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    assert len(meta["output_token_logprobs"]) == meta["completion_tokens"]
    lp, tok, text = meta["output_token_logprobs"][0]
    assert lp <= 0 and tok == out["output_ids"][0] and text == " Paris"
    assert len(meta["output_top_logprobs"][0]) == 2


def test_token_ids_logprob_in_sglangs_shape(client):
    """At each position scored, ``[logprob, id, text]`` for each id asked, in
    the order asked (repeats too); where the token there is one of them, its
    entry is the ``*_token_logprobs`` one. Per prompt in a batch; an id
    outside the vocabulary is a 400 naming it."""
    short = {"temperature": 0, "max_new_tokens": 4}  # two output tokens are asked for: a few positions suffice
    body = {"text": "The capital of France is", "sampling_params": short, "return_logprob": True,
            "logprob_start_len": 0, "return_text_in_logprobs": True}
    first = client.post("/generate", json=body).json()
    ask = [first["output_ids"][1], first["output_ids"][0], first["output_ids"][1]]
    out = client.post("/generate", json={**body, "token_ids_logprob": ask}).json()
    meta = out["meta_info"]
    assert out["output_ids"] == first["output_ids"] and meta["input_token_ids_logprobs"][0] is None
    pairs = [*zip(meta["input_token_logprobs"][1:], meta["input_token_ids_logprobs"][1:]),
             *zip(meta["output_token_logprobs"], meta["output_token_ids_logprobs"])]
    assert len(pairs) == meta["prompt_tokens"] - 1 + meta["completion_tokens"]
    for (lp, tok, text), entry in pairs:
        assert [t for _, t, _ in entry] == ask
        if tok in ask:
            assert entry[ask.index(tok)] == [pytest.approx(lp, abs=1e-5), tok, text]
    assert any(tok in ask for (_, tok, _), _ in pairs)
    batch = client.post("/generate", json={"text": ["Hello", "One, two,"], "sampling_params": short,
                                           "return_logprob": True, "token_ids_logprob": [[5], [6, 7]]}).json()
    assert [[t for _, t, _ in o["meta_info"]["output_token_ids_logprobs"][0]] for o in batch] == [[5], [6, 7]]
    bad = client.post("/generate", json={**body, "text": ["a", "b"], "token_ids_logprob": [[5], [99999999]]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "token_ids_logprob[1]", bad.text


@pytest.mark.parametrize("body,param,words", [
    ({}, "text", "exactly one"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "temperature"),
    ({"text": "hi", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p", "top_p"),
    ({"text": "hi", "sampling_params": {"max_tokens": 3}}, "sampling_params.max_tokens", "unknown"),
    ({"input_ids": [1, 99999999]}, "input_ids", "outside the vocabulary"),
    ({"input_ids": [1] * 9000}, "input_ids", "9000"),
    ({"text": "hi", "bogus": 1}, "bogus", "unknown field"),
    ({"text": 5}, "text", "string"),
    ({"text": ""}, "text", "the prompt is empty"),  # SmolLM2's tokenizer adds no BOS
    ({"text": ["a", ""]}, "text[1]", "the prompt is empty"),
])
def test_errors_are_400_with_the_field(client, body, param, words):
    r = client.post("/generate", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and words in err["message"]


def test_bad_json_and_auth(server, client):
    r = client.post("/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/generate", json={"text": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.url + "/health").status_code == 200


def test_info_endpoints(client):
    assert client.get("/health_generate").status_code == 200
    info = client.get("/get_model_info").json()
    assert info["is_generation"] and info["vocab_size"] == 49152 and info["context_length"] > 0
    srv = client.get("/get_server_info").json()
    assert srv["api_version"] == "v1" and srv["version"] and srv["max_total_tokens"] == 16384
    usage = srv["internal_states"][0]["memory_usage"]  # SGLang's: GiB of weights and of KV, and the slots
    assert usage["token_capacity"] == 16384
    kv_itemsize = usage["kvcache"] * 2**30 / (16384 + 1) / (30 * 2 * 3 * 64)  # SmolLM2-135M: 30 layers, 3 KV heads of 64
    weight_itemsize = usage["weight"] * 2**30 / 134.5e6
    assert round(kv_itemsize, 1) in (2.0, 4.0) and round(weight_itemsize, 1) in (2.0, 4.0), usage
    assert client.post("/flush_cache").status_code == 200


def test_flush_cache_while_a_request_runs_is_refused_or_waits_for_it(server, client):
    """As SGLang's /flush_cache (GET or POST): refused (400) while a request
    runs; with ``?timeout=`` it waits that long for the server to go idle,
    and flushes once it is."""
    body = {"text": "Go on forever", "rid": "flush-blocker", "stream": True,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as ac:
            async with ac.stream("POST", "/generate", json=body) as stream:
                events = stream.aiter_lines()
                await anext(events)  # its first token: it runs
                refused = [await ac.get("/flush_cache"), await ac.post("/flush_cache", params={"timeout": 0.3})]
                flush = asyncio.create_task(ac.post("/flush_cache", params={"timeout": 60}))
                for _ in range(10):  # tokens go on while the flush waits
                    await anext(events)
                assert not flush.done(), "the flush waits for the running request"
                assert (await ac.post("/abort_request", json={"rid": body["rid"]})).status_code == 200
                return refused, await flush

    refused, flushed = asyncio.run(run())
    assert [r.status_code for r in refused] == [400, 400]
    assert "?timeout=" in refused[0].json()["error"]["message"], refused[0].text
    assert "did not go idle within 0.3 s" in refused[1].json()["error"]["message"], refused[1].text
    assert flushed.status_code == 200, flushed.text
    assert client.post("/flush_cache", params={"timeout": -1}).json()["error"]["param"] == "timeout"
    assert client.get("/flush_cache").status_code == 200


def test_disconnect_aborts_and_memory_comes_back(server, client):
    with client.stream("POST", "/generate", json={"text": "Tell me a long story.", "stream": True,
                                                  "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
        lines = r.iter_lines()
        next(lines)
        next(lines)
    state = server.wait_idle()
    assert state["memory_check"] == "ok" and state["running"] == 0


def test_a_client_leaving_a_plain_request_aborts_it(server):
    body = {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes its connection
        httpx.post(server.url + "/generate", json=body, headers=server.headers(), timeout=httpx.Timeout(30, read=1.0))
    state = server.wait_idle(timeout=30)  # 2,000 tokens would take minutes on a CPU
    assert state["memory_check"] == "ok" and state["running"] == 0 and state["waiting"] == 0


def test_abort_request_endpoint(server, client):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as ac:
            task = asyncio.create_task(ac.post("/generate", json={"text": "Go on forever", "rid": "to-abort",
                                                                  "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}))
            await asyncio.to_thread(wait_for, lambda: server.state()["running"] == 1, 60, "the request's start")
            assert (await ac.post("/abort_request", json={"rid": "to-abort"})).status_code == 200
            return (await task).json()

    out = asyncio.run(run())
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and out["meta_info"]["completion_tokens"] < 3000
    assert server.wait_idle()["memory_check"] == "ok"


def test_64_concurrent_streams_match_sequential(server, client):
    """64 streams at once (the server's --max-running-requests) each end with
    text, and the first 8 equal the same prompts served one at a time. The
    concurrency is the point: 4 tokens each are enough to compare."""
    prompts = [f"Write number {i} in words:" for i in range(64)]
    params = {"temperature": 0, "max_new_tokens": 4}
    expected = [client.post("/generate", json={"text": p, "sampling_params": params}).json()["text"] for p in prompts[:8]]

    async def one(ac, p):
        r = await ac.post("/generate", json={"text": p, "sampling_params": params, "stream": True})
        return sse_events(r.text)[-1]["text"]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=300,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    got = asyncio.run(run())
    assert len(got) == 64 and all(isinstance(t, str) and t for t in got)
    assert got[:8] == expected
    assert server.wait_idle()["memory_check"] == "ok"


def test_metrics_change_as_requests_are_served(client):
    def value(text, name):
        for line in text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        return 0.0

    before = client.get("/metrics").text
    client.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}})
    after = client.get("/metrics").text
    assert value(after, "radixserve:generation_tokens_total") >= value(before, "radixserve:generation_tokens_total") + 4
    assert value(after, "radixserve:prompt_tokens_total") > value(before, "radixserve:prompt_tokens_total")
    assert "radixserve:time_to_first_token_seconds_bucket" in after and "radixserve:cache_hit_rate" in after


def test_the_server_warms_up_before_it_reports_healthy(early):
    """As SGLang's server: unless started with --skip-server-warmup (as every
    other test's server is, and starts with an empty cache), a short greedy
    request has gone through by the time /health answers 200: its tokens are
    in the radix cache. It is not counted in the metrics."""
    srv = early.get("warm")
    try:
        state = srv.wait_idle()
        assert state["kv_cached"] > 0 and state["memory_check"] == "ok"
        metrics = httpx.get(srv.url + "/metrics", timeout=10).text
        assert "radixserve:prompt_tokens_total 0.0" in metrics
        httpx.get(srv.url + "/health_generate", timeout=30).raise_for_status()
    finally:
        assert srv.stop() == 0


# SGLang's own clients send every field they know, most at a default or null.
SGLANG_BENCH_SERVING = {  # bench_serving --backend sglang
    "text": PROMPT, "sampling_params": {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True},
    "stream": True, "lora_path": None, "return_logprob": False, "return_routed_experts": False, "logprob_start_len": -1,
}
SGLANG_FRONTEND = {  # sgl.gen through RuntimeEndpoint
    "text": PROMPT, "sampling_params": {
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "max_new_tokens": 8, "min_new_tokens": 0,
        "n": 1, "stop": [], "stop_token_ids": [], "stop_regex": None, "temperature": 0, "top_p": 1.0, "top_k": -1,
        "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "ignore_eos": False, "regex": None,
        "json_schema": None}}


@pytest.mark.parametrize("body", [SGLANG_BENCH_SERVING, SGLANG_FRONTEND,
                                  {**SGLANG_FRONTEND, "background": False, "routed_dp_rank": None, "priority": 3,
                                   "session_id": "s1", "routing_key": "k", "image_data": None, "log_metrics": False}])
def test_sglang_clients_bodies_are_accepted(client, body):
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = sse_events(r.text)[-1] if body.get("stream") else r.json()
    assert out["text"].startswith("The capital of France is")


@pytest.mark.parametrize("body,param", [
    ({"text": "hi", "lora_path": "my-adapter"}, "lora_path"),
    ({"text": "hi", "image_data": "http://example.com/cat.png"}, "image_data"),
    ({"text": "hi", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "hi", "routed_dp_rank": 1}, "routed_dp_rank"),
    ({"text": "hi", "sampling_params": {"watermark": {"k": 1}}}, "sampling_params.watermark"),
    ({"text": "hi", "sampling_params": {"custom_params": {"k": 1}}}, "sampling_params.custom_params"),
])
def test_unsupported_fields_with_real_values_are_refused_by_name(client, body, param):
    r = client.post("/generate", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and "not supported" in err["message"]


def test_stop_regex_stops_trims_and_never_streams_the_match(client):
    body = {"text": PROMPT, "sampling_params": {**GREEDY, "stop_regex": [r"P\w+s"]}}
    out = client.post("/generate", json=body).json()
    assert out["text"] == "The capital of France is "
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"P\w+s"}
    events = sse_events(client.post("/generate", json={**body, "stream": True}).text)
    assert events[-1]["text"] == out["text"], "the stream never sent the start of the match"
    kept = client.post("/generate", json={**body, "sampling_params": {**body["sampling_params"], "no_stop_trim": True}})
    assert kept.json()["text"] == out["text"] + "Paris"


def test_a_stop_regex_too_slow_to_search_ends_only_its_request(client):
    """A 400 naming the field, as SGLang answers an abort the request caused
    (its finish_reason's status_code); streamed, the stream ends with that
    abort."""
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 64, "stop_regex": r"(.|..)*\d$"}}
    r = client.post("/generate", json=body)
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "sampling_params.stop_regex" and "took over" in err["message"]
    reason = sse_events(client.post("/generate", json={**body, "stream": True}).text)[-1]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status_code"] == 400
    assert reason["message"].startswith("sampling_params.stop_regex: ")
    assert client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).status_code == 200


@pytest.mark.parametrize("stop_regex,why", [("a(b", "invalid regular expression"), (["x"] * 33, "at most 32"),
                                            ("x" * 257, "at most 256 bytes"), ("", "non-empty")])
def test_bad_stop_regex_is_refused_by_name(client, stop_regex, why):
    r = client.post("/generate", json={"text": "hi", "sampling_params": {"stop_regex": stop_regex}})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "sampling_params.stop_regex" and why in err["message"]


def test_per_prompt_logprob_settings_and_stream_interval(client):
    outs = client.post("/generate", json={"text": [PROMPT, "Hello"], "return_logprob": [True, False],
                                          "top_logprobs_num": [2, 0],
                                          "sampling_params": {"temperature": 0, "max_new_tokens": 2}}).json()
    assert len(outs[0]["meta_info"]["output_top_logprobs"][0]) == 2
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    body = {"text": PROMPT, "stream": True, "sampling_params": {**GREEDY, "ignore_eos": True, "stream_interval": 4}}
    events = sse_events(client.post("/generate", json=body).text)
    assert [len(e["output_ids"]) for e in events] == [1, 5, 9, 13, 16]  # the first at once, as SGLang's


def test_profile_start_stop_writes_a_trace(client, tmp_path):
    """SGLang's /start_profile and /stop_profile: a trace per rank that
    holds the steps run in between; a second start, a stop with nothing
    running, and bad options are 400s naming the field."""
    assert client.post("/stop_profile").status_code == 400
    body = {"output_dir": str(tmp_path), "profile_id": "p", "record_shapes": True}
    assert client.post("/start_profile", json=body).status_code == 200
    again = client.post("/start_profile", json=body)
    assert again.status_code == 400 and "already in progress" in again.json()["error"]["message"]
    assert client.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY}).status_code == 200
    stopped = client.post("/stop_profile")
    assert stopped.status_code == 200 and "p-TP-0.trace.json.gz" in stopped.text
    import gzip

    trace = json.loads(gzip.open(tmp_path / "p-TP-0.trace.json.gz").read())
    names = {e.get("name", "") for e in trace["traceEvents"]}
    assert any("aten::" in n for n in names), "the forward's operators are in the trace"


def test_profile_num_steps_answers_once_the_trace_is_written(server, tmp_path):
    """As SGLang: a start with num_steps (here as its bench_serving sends it:
    steps as strings, unset options as null or []) returns when the profile
    has run its steps and written the trace."""
    body = {"output_dir": str(tmp_path), "profile_id": "n", "num_steps": "3", "start_step": "0", "activities": [],
            "profile_by_stage": None, "profile_stages": None, "profile_prefix": "pre-"}
    (tmp_path / "a-file").touch()  # a probe's output_dir below it cannot be made: the probe never starts a profile

    async def in_progress(ac):
        """Once the scheduler has the start, a probe is refused as one too many."""
        while "already in progress" not in (probe := await ac.post("/start_profile", json={
                "output_dir": str(tmp_path / "a-file" / "x")})).text:
            assert "cannot create" in probe.text, probe.text

    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as ac:
            started = asyncio.create_task(ac.post("/start_profile", json=body))
            await asyncio.wait_for(in_progress(ac), 60)
            assert not started.done(), "no step ran yet: the start is still waiting"
            assert (await ac.get("/get_server_info")).status_code == 200, "other control calls are not held up"
            await ac.post("/generate", json={"text": PROMPT, "sampling_params": GREEDY})
            return await started

    reply = asyncio.run(run())
    assert reply.status_code == 200 and (tmp_path / "pre-n-TP-0.trace.json.gz").exists(), reply.text
    assert "pre-n-TP-0.trace.json.gz" in reply.text


@pytest.mark.parametrize("body, param", [
    ({"activities": ["GPU"]}, "activities"),  # a CPU server
    ({"activities": ["CUDA_PROFILER"]}, "activities"),
    ({"activities": "CPU"}, "activities"),
    ({"num_steps": 0}, "num_steps"),
    ({"num_steps": "five"}, "num_steps"),
    ({"start_step": -1}, "start_step"),
    ({"profile_by_stage": True}, "profile_by_stage"),
    ({"with_stack": "yes"}, "with_stack"),
    ({"profile_id": "../x"}, "profile_id"),
])
def test_profile_bad_options_are_400_by_field(client, body, param):
    r = client.post("/start_profile", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert client.post("/stop_profile").status_code == 400, "nothing was started"


def test_stream_events_are_utf8_json_with_non_finite_floats_as_null():
    """The native stream's events (orjson, as SGLang's server writes them):
    UTF-8 text as is, tuples as arrays, and an infinite logprob as null,
    which every JSON parser reads (``json.dumps`` wrote ``-Infinity``)."""
    from radixserve.entrypoints.http_server import _json_events

    async def outputs():
        yield {"text": "héllo 🚀", "meta_info": {"output_token_logprobs": [(float("-inf"), 7, None)]}}

    async def collect():
        return [event async for event in _json_events(outputs())]

    [event] = asyncio.run(collect())
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and "héllo 🚀".encode() in event
    assert json.loads(event[6:], parse_constant=lambda c: pytest.fail(f"non-JSON constant {c}")) == {
        "text": "héllo 🚀", "meta_info": {"output_token_logprobs": [[None, 7, None]]}}


def test_incremental_streaming_output_sends_what_is_new():
    """SGLang's --incremental-streaming-output: each event of a native stream
    carries its prompt's new text, output_ids and output logprobs (input
    logprobs in its first event only); without the flag, events are
    cumulative. The route runs in-process over a tokenizer manager that
    yields cumulative outputs, as the real one does."""
    from radixserve.entrypoints.http_server import create_app
    from radixserve.server_args import ServerArgs

    def cumulative(index, n):
        lp = [[-0.5 * i, 10 + i, None] for i in range(n)]  # lists: JSON has no tuples
        return {"text": "ab" * n, "output_ids": [10 + i for i in range(n)], "index": index, "meta_info": {
            "completion_tokens": n, "output_token_logprobs": lp, "input_token_logprobs": [[None, 1, None]]}}

    class Manager:
        dead = None

        async def generate_request(self, obj, request=None):
            for n in (1, 3, 4):
                for index in (0, 1):
                    yield cumulative(index, n + index)

    async def events(flag):
        args = ServerArgs.from_kwargs(model_path="tiny-llama", incremental_streaming_output=flag)
        app = create_app(type("Engine", (), {"tokenizer_manager": Manager()})(), args)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as ac:
            reply = await ac.post("/generate", json={"text": ["a", "b"], "stream": True})
        return sse_events(reply.text)

    plain, new = asyncio.run(events(False)), asyncio.run(events(True))
    assert plain == [cumulative(i, n + i) for n in (1, 3, 4) for i in (0, 1)]
    for index in (0, 1):
        mine = [e for e in new if e["index"] == index]
        assert [len(e["output_ids"]) for e in mine] == [1 + index, 2, 1]
        assert "".join(e["text"] for e in mine) == "ab" * (4 + index)
        assert sum((e["output_ids"] for e in mine), []) == cumulative(index, 4 + index)["output_ids"]
        logprobs = sum((e["meta_info"]["output_token_logprobs"] for e in mine), [])
        assert logprobs == cumulative(index, 4 + index)["meta_info"]["output_token_logprobs"]
        assert [len(e["meta_info"]["input_token_logprobs"]) for e in mine] == [1, 0, 0]
        assert [e["meta_info"]["completion_tokens"] for e in mine] == [1 + index, 3 + index, 4 + index]
