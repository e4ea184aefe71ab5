"""Structured output (xgrammar) with SmolLM2 on the CPU: JSON schemas, regular
expressions and EBNF grammars through the Engine and the HTTP server; every
output parses; constrained requests beside unconstrained ones, with chunked
prefill, retraction, overlap and abort; bad grammars are 400s naming the field."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import jsonschema
import openai
import pytest

import radixserve
from server_harness import wait_for
from test_grammar_limits import CACHE_MB, OVER_LIMIT, enum_schema, small_schema

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "color": {"type": "string", "enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                    "required": ["city"], "additionalProperties": False},
    },
    "required": ["name", "age", "color", "address"],
    "additionalProperties": False,
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
EXPR = """root ::= expr
expr ::= term (("+" | "-") term)*
term ::= num | "(" expr ")"
num ::= [1-9] [0-9]?"""
SAMPLED = {"temperature": 1.0, "max_new_tokens": 160}


def expr_ok(text: str) -> bool:
    """Whether ``text`` is in EXPR's language (balanced parentheses, numbers 1-99)."""
    while "(" in text:
        text, n = re.subn(r"\((\d+(?:[+-]\d+)*)\)", r"\1", text)
        if n == 0:
            return False
    return re.fullmatch(r"[1-9]\d?([+-][1-9]\d?)*", text) is not None


@pytest.fixture(scope="module")
def eng():
    with radixserve.Engine(max_total_tokens=8192, max_running_requests=16, check_invariants=True,
                           disable_tqdm=True, device="cpu") as e:
        yield e


def chat(eng, question: str) -> str:
    return eng.apply_chat_template([{"role": "user", "content": question}])


def test_json_schema_outputs_validate(eng):
    prompt = chat(eng, "Describe a person as JSON with name, age, favourite color, tags and address.")
    outs = eng.generate([prompt] * 8, [{**SAMPLED, "json_schema": json.dumps(PERSON), "sampling_seed": i}
                                       for i in range(8)])
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        jsonschema.validate(json.loads(out["text"]), PERSON)
    assert len({o["text"] for o in outs}) > 1, "sampling still varies within the grammar"


def test_regex_and_ebnf_outputs_match_in_full(eng):
    prompt = chat(eng, "Give me a phone number and an arithmetic expression.")
    phones = eng.generate([prompt] * 6, {**SAMPLED, "regex": PHONE})
    assert all(re.fullmatch(PHONE, o["text"]) for o in phones), [o["text"] for o in phones]
    exprs = eng.generate([prompt] * 6, {**SAMPLED, "ebnf": EXPR, "max_new_tokens": 40})
    for out in exprs:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert expr_ok(out["text"]), out["text"]
        else:  # cut by max_new_tokens: still a prefix of the language
            assert re.fullmatch(r"[0-9+\-()]*", out["text"]), out["text"]


def test_a_grammar_that_can_only_end_outranks_min_new_tokens(eng):
    prompt = chat(eng, "Give me a phone number.")
    out = eng.generate(prompt, {**SAMPLED, "regex": PHONE, "min_new_tokens": 100}, return_logprob=True)
    assert re.fullmatch(PHONE, out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
    assert out["meta_info"]["completion_tokens"] < 100
    assert all(lp > -1e9 for lp, *_ in out["meta_info"]["output_token_logprobs"]), "no token came from an empty row"


def test_structural_tags_in_both_formats(eng):
    prompt = chat(eng, "Say hello, then call get_weather for Paris.")
    xgrammar_format = {"type": "structural_tag", "format": {"type": "const_string", "value": "hello"}}
    out = eng.generate(prompt, {"structural_tag": json.dumps(xgrammar_format), "temperature": 0})
    assert out["text"] == "hello"
    sglang_format = {"structures": [{"begin": "<function=get_weather>", "end": "</function>", "schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}], "triggers": ["<function="]}
    prompt = chat(eng, "Reply with exactly: <function=get_weather>{\"city\": \"Paris\"}</function>")
    out = eng.generate(prompt, {"structural_tag": json.dumps(sglang_format), "temperature": 0, "max_new_tokens": 60})
    for call in re.findall(r"<function=get_weather>(.*?)</function>", out["text"], re.S):
        assert isinstance(json.loads(call)["city"], str)  # whatever is inside a tag follows its schema
    with pytest.raises(ValueError, match="^structural_tag: invalid structural tag: 'structures' must be"):
        eng.generate("hi", {"structural_tag": '{"structures": [{"begin": "<a>"}], "triggers": ["<"]}'})


def test_constrained_requests_leave_the_others_unchanged(eng):
    prompt = chat(eng, "What is the capital of France?")
    greedy = {"temperature": 0, "max_new_tokens": 24}
    alone = eng.generate(prompt, greedy)["text"]
    mixed = eng.generate([prompt, prompt, prompt], [{**greedy, "regex": "(yes|no)"}, greedy,
                                                    {**greedy, "json_schema": json.dumps(PERSON)}])
    assert mixed[1]["text"] == alone
    assert mixed[0]["text"] in ("yes", "no")


RETRACTED_SCHEMA = {"temperature": 0, "max_new_tokens": 48, "json_schema": json.dumps(PERSON)}  # ~45 tokens each


@pytest.fixture(scope="module")
def roomy_outputs(eng):
    """Six JSON requests' prompts and greedy outputs with room to spare: from
    the module's engine (8192 tokens for 6 requests of about 75), its cache
    flushed first, as a new engine's would be."""
    assert eng.flush_cache()
    prompts = [chat(eng, f"Describe person number {i} as JSON.") for i in range(6)]
    return prompts, [o["text"] for o in eng.generate(prompts, RETRACTED_SCHEMA)]


@pytest.mark.parametrize("overlap", [False, True])
def test_grammar_through_chunked_prefill_retraction_and_overlap(roomy_outputs, overlap):
    """A pool too small for every request at once retracts some; the greedy
    outputs are the same as with room to spare."""
    schema = RETRACTED_SCHEMA
    prompts, expected = roomy_outputs
    with radixserve.Engine(max_total_tokens=160, chunked_prefill_size=16, check_invariants=True,
                           disable_tqdm=True, device="cpu") as tight:
        tight.scheduler.overlap = overlap
        outs = tight.generate(prompts, schema)
        assert tight.scheduler.stats.retractions > 0, "the pool was small enough to retract"
    assert [o["text"] for o in outs] == expected
    for out in outs:
        jsonschema.validate(json.loads(out["text"]), PERSON)


def test_abort_while_compiling_and_while_decoding(eng):
    from radixserve.managers.schedule_batch import Req
    from radixserve.sampling.sampling_params import SamplingParams

    sched = eng.scheduler
    prompt = chat(eng, "Describe a person as JSON.")
    params = SamplingParams.from_dict({"json_schema": json.dumps({**PERSON, "title": "compiling"})})
    req = Req("compiling", eng.tokenizer.encode(prompt), params.normalize(sched.vocab_size))
    sched.add_request(req)
    assert sched.grammar_queue.reqs == [req] and not sched.is_idle()
    assert sched.abort_request("compiling")
    assert req in sched.step() and req.finished_reason.type == "abort"
    assert sched.is_idle()
    stream = eng.generate(prompt, {**SAMPLED, "json_schema": json.dumps({**PERSON, "title": "fresh"})}, stream=True)
    next(stream)
    stream.close()  # aborted mid-decode
    assert sched.is_idle() and not sched.grammar_queue
    sched.check_memory()


def test_a_bad_grammar_is_refused_offline(eng):
    for params, field in (({"regex": "(unclosed"}, "regex"), ({"json_schema": "{not json"}, "json_schema"),
                          ({"json_schema": '{"type": "objekt"}'}, "json_schema"), ({"ebnf": "root ::= ("}, "ebnf")):
        with pytest.raises(ValueError, match=rf"^{field}: invalid"):
            eng.generate("hi", params)


# -- over HTTP ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(smollm2_open):
    return smollm2_open  # conftest.py: test_grammar_limits.py's limits; shared with test_sglang_clients.py


def test_generate_with_grammars_and_bad_ones(server):
    body = {"text": ["My phone number is ", "Call me at "], "sampling_params": {**SAMPLED, "regex": PHONE}}
    outs = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    assert all(re.fullmatch(PHONE, o["text"]) for o in outs)
    for params, param in (({"regex": "(unclosed"}, "sampling_params.regex"),
                          ({"json_schema": '{"type": 3}'}, "sampling_params.json_schema"),
                          ({"ebnf": "root ::= ("}, "sampling_params.ebnf"),
                          ({"regex": "a", "ebnf": 'root ::= "a"'}, "sampling_params.ebnf")):
        r = httpx.post(server.url + "/generate", json={"text": "hi", "sampling_params": params}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    state = server.wait_idle()
    assert state["memory_check"] == "ok" and httpx.post(server.url + "/flush_cache").status_code == 200


def test_openai_response_format(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Describe a person as JSON."}]
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, max_tokens=160, n=3, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}})
    for choice in out.choices:
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # greedy, and a prompt this small model answers with a short object (22 tokens): sampled at temperature 1,
    # "Describe a person as JSON." sometimes ran on past max_tokens, unclosed
    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Describe a person as JSON, in one line."}],
        max_tokens=120, temperature=0, response_format={"type": "json_object"}, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)
    done = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Phone: ", max_tokens=20,
                                     extra_body={"regex": PHONE})
    assert re.fullmatch(PHONE, done.choices[0].text)
    with pytest.raises(openai.BadRequestError, match="response_format: invalid json schema") as bad:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "objekt"}}})
    assert bad.value.body["param"] == "response_format"  # the request's field, not the engine's


def metric(server, name: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(f"radixserve:{name} ")))


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
    bomb = enum_schema(OVER_LIMIT, tag="native")
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
                                           "name": "form", "schema": enum_schema(OVER_LIMIT, tag="openai")}})
    assert refused.value.body["param"] == "response_format"
    tool = {"type": "function", "function": {"name": "fill", "parameters": enum_schema(OVER_LIMIT, tag="tool")}}
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=8,
                                       tools=[tool], tool_choice="required")
    assert refused.value.body["param"] == "tools" and "--grammar-compile-max-mb" in refused.value.body["message"]

    ok = httpx.post(url + "/generate", json={"text": "Fill it in:", "sampling_params": {
        "max_new_tokens": 24, "json_schema": json.dumps(small_schema(0))}}, timeout=120)
    assert ok.status_code == 200
    state = server.wait_idle()
    assert state["memory_check"] == "ok"


def test_the_grammar_cache_stays_within_its_bytes_and_flush_cache_empties_it(server):
    n = 40  # about 3 MB compiled in all, three times the cache
    body = {"text": ["Fill it in:"] * n,
            "sampling_params": [{"max_new_tokens": 1, "json_schema": json.dumps(small_schema(100 + i))} for i in range(n)]}
    r = httpx.post(server.url + "/generate", json=body, timeout=300)
    assert r.status_code == 200, r.text
    state = server.wait_idle()
    assert 0 < state["grammar_cache_bytes"] <= CACHE_MB << 20
    assert 0 < state["grammar_cache_entries"] < n
    # the scheduler sends its figures as it goes idle: /metrics shows these
    wait_for(lambda: metric(server, "grammar_cache_bytes") == state["grammar_cache_bytes"]
             and metric(server, "grammar_cache_entries") == state["grammar_cache_entries"], 10,
             "the idle scheduler's grammar cache figures in /metrics")
    assert httpx.post(server.url + "/flush_cache", timeout=30).status_code == 200
    deadline = time.monotonic() + 10
    while metric(server, "grammar_cache_bytes") != 0 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert metric(server, "grammar_cache_bytes") == 0 and metric(server, "grammar_cache_entries") == 0
