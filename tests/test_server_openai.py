"""The OpenAI API against a real server (SmolLM2, CPU), driven by the
official ``openai`` client: completions and chat, streamed and not, n > 1,
stop, logprobs, usage with cached tokens, and the error cases."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from server_harness import wait_for

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(smollm2_keyed):
    return smollm2_keyed  # conftest.py: shared with test_hostile.py and test_server_native.py


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=120)


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]


def test_chat_answers_and_reports_cached_tokens(client):
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    assert first.choices[0].message.content.startswith("The capital of France is Paris.")
    assert first.choices[0].finish_reason == "stop" and first.choices[0].message.role == "assistant"
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    assert again.usage.prompt_tokens == first.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.usage.completion_tokens == first.usage.completion_tokens


def test_chat_stream_with_usage_equals_non_stream(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_chat_n_seed_and_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, temperature=1.0, seed=3,
                                         max_tokens=12, logprobs=True, top_logprobs=2)
    assert len(out.choices) == 3 and sorted(c.index for c in out.choices) == [0, 1, 2]
    lp = out.choices[0].logprobs.content
    assert 1 <= len(lp) <= 12
    assert all(t.logprob <= 0 and len(t.top_logprobs) == 2 for t in lp)
    again = client.chat.completions.create(model=MODEL, messages=QUESTION, n=3, temperature=1.0, seed=3, max_tokens=12)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]


def test_completions_stop_echo_logprobs(client):
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0,
                                    stop=["."])
    assert out.choices[0].text == " Paris" and out.choices[0].finish_reason == "stop"
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    choice = out.choices[0]
    assert choice.text.startswith("The capital of France is Paris")
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == out.usage.prompt_tokens + 3
    out = client.completions.create(model=MODEL, prompt=["Hello", "One, two,"], n=2, max_tokens=4, temperature=0.8)
    assert len(out.choices) == 4 and out.usage.completion_tokens == 16


def test_completions_stream_and_token_prompt(client):
    ids = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=ids, max_tokens=10, temperature=0, stream=True) if c.choices)
    assert text == whole.choices[0].text and text


@pytest.mark.parametrize("kwargs,param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": 0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"n": 1000}, "n"),
    ({"messages": []}, "messages"),
])
def test_chat_errors_name_the_field(client, kwargs, param):
    args = {"model": MODEL, "messages": QUESTION, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(**args)
    assert err.value.status_code == 400 and err.value.param == param


def test_completion_errors(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi " * 9000, max_tokens=4)
    assert "context window" in err.value.message and "8192" in err.value.message and err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=[1, 2, 999999], max_tokens=4)
    assert "vocabulary" in err.value.message and err.value.param == "prompt"
    with pytest.raises(openai.BadRequestError) as err:  # SmolLM2's tokenizer adds no BOS: no tokens at all
        client.completions.create(model=MODEL, prompt=["Hi", ""], max_tokens=4)
    assert "prompt[1]: the prompt is empty" in err.value.message and err.value.param == "prompt[1]"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 9000}])
    assert "context window" in err.value.message and err.value.param == "messages"
    with pytest.raises(openai.BadRequestError) as err:  # base:adapter names a LoRA adapter: none is served
        client.completions.create(model=f"{MODEL}:an-adapter", prompt="hi", max_tokens=4)
    assert err.value.param == "model" and "an-adapter" in err.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
    # the server keeps serving
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).usage.completion_tokens == 2


def test_any_model_name_is_served_as_sglang_serves_it(server, client):
    """The model path, or a name this server does not go by (sglang-router
    fills one in when the client gives none): the loaded model answers, and
    the reply echoes the name."""
    path = httpx.get(server.url + "/get_model_info", headers=server.headers()).json()["model_path"]
    for name in (path, "gpt-5"):
        out = client.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=8)
        assert out.choices[0].message.content.startswith("The capital of France is") and out.model == name


def test_continue_final_message_and_sglang_extensions(client):
    messages = QUESTION + [{"role": "assistant", "content": "The capital of France"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=6, extra_body={
        "continue_final_message": True, "rid": "chat-rid-1", "separate_reasoning": True, "lora_path": None,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.content.startswith(" is Paris")
    with pytest.raises(openai.BadRequestError, match="lora_path"):
        client.chat.completions.create(model=MODEL, messages=QUESTION, extra_body={"lora_path": "adapter"})


def test_stop_regex_on_both_routes(client):
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=20,
                                          extra_body={"stop_regex": [r"P\w+s"]})
    assert chat.choices[0].message.content == "The capital of France is "
    assert chat.choices[0].finish_reason == "stop" and chat.choices[0].matched_stop == r"P\w+s"
    done = client.completions.create(model=MODEL, prompt="1, 2, 3,", temperature=0, max_tokens=12,
                                     extra_body={"stop_regex": r"[5-9]"})
    assert not any(ch in done.choices[0].text for ch in "56789") and done.choices[0].finish_reason == "stop"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"stop_regex": "(unclosed"})
    assert err.value.param == "stop_regex" and "invalid regular expression" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:  # refused while it runs: a search that ran out of time
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=64,
                                       extra_body={"stop_regex": r"(.|..)*\d$"})
    assert err.value.param == "stop_regex" and "took over" in err.value.message


def test_a_request_aborted_by_its_rid_finishes_as_abort(server, client):
    """/abort_request ends an OpenAI request as SGLang does: a choice whose
    finish_reason is "abort" (not an error); the server serves on."""
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers(), timeout=120) as ac:
            body = {"model": MODEL, "prompt": "Go on forever", "max_tokens": 3000, "rid": "openai-to-abort",
                    "ignore_eos": True}
            task = asyncio.create_task(ac.post("/v1/completions", json=body))
            await asyncio.to_thread(wait_for, lambda: server.state()["running"] == 1, 60, "the request's start")
            assert (await ac.post("/abort_request", json={"rid": "openai-to-abort"})).status_code == 200
            return await task

    r = asyncio.run(run())
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "abort" and r.json()["usage"]["completion_tokens"] < 3000
    assert server.wait_idle()["memory_check"] == "ok"


# -- tool calls and reasoning (--tool-call-parser, --reasoning-parser) --------------------------------

WEATHER_PARAMS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
    "city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}
TIME_PARAMS = {"type": "object", "additionalProperties": False, "required": ["timezone"],
               "properties": {"timezone": {"type": "string", "maxLength": 20}}}
TOOLS = [  # strict, so that the client's stream helper parses the arguments
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER_PARAMS, "strict": True}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone",
                                      "parameters": TIME_PARAMS, "strict": True}},
]
WEATHER_Q = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def parsing_client(smollm2_parsers):
    """A server with both output parsers (conftest.py's: it starts in the
    background while the tests before run). SmolLM2's chat template ignores
    tools, so it never writes calls itself: forced calls come from the grammar."""
    return openai.OpenAI(base_url=smollm2_parsers.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.mark.parametrize("choice,names", [
    ("required", {"get_weather", "get_time"}),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
])
def test_forced_tool_calls_validate_streamed_or_not(parsing_client, choice, names):
    import jsonschema

    args = dict(model=MODEL, messages=WEATHER_Q, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=120)
    whole = parsing_client.chat.completions.create(**args)
    choice0 = whole.choices[0]
    assert choice0.finish_reason == "tool_calls" and choice0.message.content is None and choice0.message.tool_calls
    params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for call in choice0.message.tool_calls:
        assert call.function.name in names and call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), params[call.function.name])
    with parsing_client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.parsed_arguments) for c in final.message.tool_calls] == \
           [(c.function.name, json.loads(c.function.arguments)) for c in choice0.message.tool_calls]


def test_reasoning_parser_and_auto_tools(parsing_client):
    """SmolLM2 never closes a think block: with qwen3's parser forced into
    reasoning, all of its text is reasoning, unless thinking is off."""
    args = dict(model=MODEL, messages=QUESTION, temperature=0, max_tokens=8)
    forced = parsing_client.chat.completions.create(**args).choices[0].message
    assert forced.content is None and forced.reasoning_content.startswith("The capital of France")
    streamed = list(parsing_client.chat.completions.create(**args, stream=True))
    assert "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in streamed if c.choices) == \
           forced.reasoning_content
    off = parsing_client.chat.completions.create(**args, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert off.choices[0].message.content == forced.reasoning_content and off.choices[0].message.reasoning_content is None
    # auto: strict tools constrain only what follows <tool_call>, which SmolLM2 does not write
    auto = parsing_client.chat.completions.create(**args, tools=TOOLS, extra_body={"separate_reasoning": False})
    assert auto.choices[0].message.content == forced.reasoning_content and auto.choices[0].message.tool_calls is None


@pytest.mark.parametrize("kwargs,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_tool_errors_name_the_field_and_the_server_keeps_serving(parsing_client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        parsing_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **kwargs)
    assert err.value.status_code == 400 and err.value.param == param
    ok = parsing_client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, tools=TOOLS)
    assert ok.choices[0].finish_reason == "length"
