"""Tool calls and reasoning on /v1/chat/completions, the pure part: request
validation (each error names its field), what tools do to the prompt and the
sampling params (the forced-call grammar in SGLang's shape), and engine
outputs -> messages and stream chunks, checked with the official ``openai``
client (its types, and its stream accumulator against the real streaming loop
of the server on a test-local app)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from openai.types.chat import ChatCompletion
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from radixserve.entrypoints.http_server import add_error_handlers
from radixserve.entrypoints.openai import adapters, serving
from radixserve.entrypoints.openai.chat_parsing import chat_parsing
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.tool_calls import tool_call_schema
from radixserve.entrypoints.streaming import sse_stream
from radixserve.sampling.grammar import check_grammar

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                  "required": ["city"], "additionalProperties": False}
SEARCH_PARAMS = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER_PARAMS}},
    {"type": "function", "function": {"name": "search", "parameters": SEARCH_PARAMS, "strict": True}},
]
USER = [{"role": "user", "content": "hi"}]
# Renders tools, earlier calls (their arguments with tojson) and tool results, as tool-aware templates do.
TOOL_TEMPLATE = (
    "{% if tools %}TOOLS {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}> {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}"
    "{% endfor %}{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer():
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    hf.chat_template = TOOL_TEMPLATE
    return hf


def chat(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **body})


# -- validation --------------------------------------------------------------------------------------

TOOL_ERRORS = [
    ({"tools": [{"type": "custom", "function": {"name": "f"}}]}, "tools[0].type", "'function'"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "pattern"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name", "required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
     "tools[0].function.parameters", "dictionary"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name", "given twice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", '"none", "auto", "required"'),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice",
     "'launch' is not among the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot also follow response_format"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "search"}}, "regex": "a+"},
     "tool_choice", "cannot also follow regex"),
    ({"messages": USER + [{"role": "assistant", "tool_calls": [{"id": "c1", "function": {"arguments": "{}"}}]}]},
     "messages[1].tool_calls[0].function.name", "required"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"function_call": "required"}, "function_call", "not supported"),
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs", "set by the server"),
]


@pytest.mark.parametrize("body,param,text", TOOL_ERRORS)
def test_tool_errors_name_their_field(body, param, text):
    with pytest.raises(ValidationError) as exc:
        chat(**body)
    err = adapters.validation_error_to_openai(exc.value.errors())["error"]
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and text in err["message"]


def test_tool_requests_accepted():
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}},
               parallel_tool_calls=False, response_format={"type": "text"})
    assert req.tool_choice.function.name == "search" and req.tools[1].function.strict is True
    assert chat(tools=[], tool_choice="auto").tools == [] and chat(tool_choice="none").tool_choice == "none"


def test_a_schema_that_does_not_build_is_refused_naming_the_tool(tokenizer):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                        "properties": {"a": {"type": "strin"}}}}}
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.parameters: .*strin") as exc:
        adapters.chat_to_generate(chat(tools=[TOOLS[0], bad]), tokenizer)
    assert adapters.value_error_to_openai(exc.value)["error"]["param"] == "tools[1].function.parameters"


# -- the prompt and the sampling params --------------------------------------------------------------


def test_template_sees_the_offered_tools_and_earlier_calls_as_objects(tokenizer):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "cold"},
    ]
    prompt = adapters.render_chat(chat(messages=messages, tools=TOOLS), tokenizer)
    shown = json.loads(prompt.splitlines()[0].removeprefix("TOOLS "))
    assert shown == TOOLS  # OpenAI's shape, as given
    assert '<assistant>  CALL call_1 get_weather {"city": "Oslo"}\n' in prompt  # an object, not a JSON string
    assert "<tool> cold FOR call_1\n" in prompt
    named = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "search"}})
    assert json.loads(adapters.render_chat(named, tokenizer).splitlines()[0][6:]) == [TOOLS[1]]
    assert not adapters.render_chat(chat(tools=TOOLS, tool_choice="none"), tokenizer).startswith("TOOLS")


def test_required_constrains_to_sglangs_call_array(tokenizer):
    params = adapters.chat_to_generate(chat(tools=TOOLS, tool_choice="required"), tokenizer)["sampling_params"]
    schema = json.loads(params["json_schema"])
    assert schema == tool_call_schema(chat(tools=TOOLS).tools) and params["skip_special_tokens"] is False
    assert schema["minItems"] == 1 and "maxItems" not in schema
    assert [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]] == [["get_weather"], ["search"]]
    check_grammar("json_schema", params["json_schema"])
    jsonschema.validate([{"name": "search", "parameters": {"query": "x"}},
                         {"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}], schema)
    for bad in ([], [{"name": "launch", "parameters": {}}], [{"name": "get_weather", "parameters": {"days": 1}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)


def test_named_function_and_no_parallel_calls(tokenizer):
    req = chat(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}},
               parallel_tool_calls=False)
    schema = json.loads(adapters.chat_to_generate(req, tokenizer)["sampling_params"]["json_schema"])
    assert schema["items"]["properties"]["name"]["enum"] == ["get_weather"]
    assert schema["items"]["properties"]["parameters"] == WEATHER_PARAMS and schema["maxItems"] == 1


def test_defs_move_to_the_root_of_the_call_array():
    params = {"type": "object", "properties": {"p": {"$ref": "#/$defs/Point"}},
              "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "number"}}}}}
    tools = chat(tools=[{"type": "function", "function": {"name": "draw", "parameters": params}}]).tools
    schema = tool_call_schema(tools)
    assert schema["$defs"] == params["$defs"] and "$defs" not in schema["items"]["properties"]["parameters"]
    check_grammar("json_schema", json.dumps(schema))
    jsonschema.validate([{"name": "draw", "parameters": {"p": {"x": 1.5}}}], schema)


def test_auto_constrains_only_strict_tools_and_only_with_a_parser(tokenizer):
    plain = adapters.chat_to_generate(chat(tools=TOOLS), tokenizer)["sampling_params"]
    assert not {"json_schema", "structural_tag"} & set(plain) and plain["skip_special_tokens"] is False
    tag = json.loads(adapters.chat_to_generate(chat(tools=TOOLS), tokenizer, "qwen")["sampling_params"]["structural_tag"])
    assert tag["triggers"] == ["<tool_call>"]
    assert [(s["begin"], s["schema"]) for s in tag["structures"]] == [
        ('<tool_call>\n{"name": "get_weather", "arguments": ', {}),  # not strict: any JSON
        ('<tool_call>\n{"name": "search", "arguments": ', SEARCH_PARAMS)]
    check_grammar("structural_tag", json.dumps(tag))
    with pytest.raises(ValueError, match=r"^tools\[1\]\.function\.strict: "):
        adapters.chat_to_generate(chat(tools=TOOLS, response_format={"type": "json_object"}), tokenizer, "llama3")
    none = adapters.chat_to_generate(chat(tools=TOOLS, tool_choice="none"), tokenizer, "qwen")["sampling_params"]
    assert none == {}


# -- outputs -> messages -------------------------------------------------------------------------------


STOP = {"type": "stop", "matched": 1}


def output(text: str, finish: dict | None = STOP, index: int = 0) -> dict:
    meta = {"id": "r", "prompt_tokens": 3, "completion_tokens": 5, "cached_tokens": 0, "finish_reason": finish}
    return {"index": index, "text": text, "output_ids": [], "meta_info": meta}


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'


def respond(req, text, finish=STOP, tool_call_parser="qwen", reasoning_parser=None) -> ChatCompletion:
    parsing = chat_parsing(req, tool_call_parser, reasoning_parser)
    resp = adapters.build_chat_response(req, [output(text, finish)], "m", 0, parsing=parsing)
    return ChatCompletion.model_validate(resp.model_dump(mode="json"))


def test_calls_become_tool_calls_and_finish_with_tool_calls():
    resp = respond(chat(tools=TOOLS), "Let me look.\n" + CALL + "\n" + CALL.replace("Paris", "Rome"))
    msg, choice = resp.choices[0].message, resp.choices[0]
    assert msg.content == "Let me look." and choice.finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 3}), ("get_weather", {"city": "Rome", "days": 3})]
    assert all(c.id.startswith("call_") and c.type == "function" for c in msg.tool_calls)
    assert len({c.id for c in msg.tool_calls}) == 2 and choice.model_extra["matched_stop"] is None


def test_only_calls_gives_null_content_and_a_length_stop_stays_length():
    assert respond(chat(tools=TOOLS), CALL).choices[0].message.content is None
    cut = respond(chat(tools=TOOLS), CALL[:CALL.index("Paris") + 3], finish={"type": "length", "length": 5}).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls[0].function.arguments == '{"city": "Par'


def test_no_call_no_tool_calls_field():
    resp = respond(chat(tools=TOOLS), "It is sunny.")
    assert resp.choices[0].finish_reason == "stop" and resp.choices[0].message.content == "It is sunny."
    dumped = adapters.build_chat_response(chat(tools=TOOLS), [output("x")], "m", 0).model_dump()
    assert "tool_calls" not in dumped["choices"][0]["message"]


def test_auto_without_parser_and_none_leave_the_text_as_content():
    assert respond(chat(tools=TOOLS), CALL, tool_call_parser=None).choices[0].message.content == CALL
    assert respond(chat(tools=TOOLS, tool_choice="none"), CALL).choices[0].message.content == CALL


def test_forced_calls_parse_whatever_the_parser():
    text = '[{"name": "search", "parameters": {"query": "東京"}}]'
    for parser in (None, "llama3"):
        resp = respond(chat(tools=TOOLS, tool_choice="required"), text, tool_call_parser=parser, reasoning_parser="qwen3")
        calls = resp.choices[0].message.tool_calls
        assert [(c.function.name, c.function.arguments) for c in calls] == [("search", '{"query": "東京"}')]
        assert resp.choices[0].message.model_extra["reasoning_content"] is None  # the grammar leaves no room to think


def test_reasoning_then_call():
    resp = respond(chat(tools=TOOLS), "<think>Weather: use the tool.</think>\n\n" + CALL, reasoning_parser="qwen3")
    msg = resp.choices[0].message
    assert msg.model_extra["reasoning_content"] == "Weather: use the tool." and msg.content is None
    assert msg.tool_calls[0].function.name == "get_weather" and resp.choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("body,text,reasoning,content", [
    ({}, "opened by the template</think>Answer", "opened by the template", "Answer"),
    ({"chat_template_kwargs": {"enable_thinking": False}}, "Answer</think>", None, "Answer</think>"),
    ({"separate_reasoning": False}, "<think>r</think>Answer", None, "<think>r</think>Answer"),
    ({"response_format": {"type": "json_object"}}, '{"a": 1}', None, '{"a": 1}'),
    ({}, "<think>stopped mid-thought", "stopped mid-thought", None),
])
def test_reasoning_content(body, text, reasoning, content):
    msg = respond(chat(**body), text, tool_call_parser=None, reasoning_parser="qwen3").choices[0].message
    assert (msg.model_extra["reasoning_content"], msg.content) == (reasoning, content)


# -- streams, through the server's streaming loop and the client's accumulator ------------------------

SCRIPTS = {  # the last user message -> what the fake model writes
    "weather": "<think>I need the weather.</think>\n\nChecking.\n" + CALL + "\n"
               + '<tool_call>\n{"name": "search", "arguments": {"query": "a } </tool_call> b"}}\n</tool_call>',
    "forced": '[{"name": "search", "parameters": {"query": "Zürich"}}, '
              '{"name": "get_weather", "parameters": {"city": "Oslo"}}]',
    "plain": "<think>Easy.</think>Hello there!",
}


async def fake_outputs(text: str, piece: int):
    """Cumulative outputs, as the TokenizerManager yields them, ``piece`` characters at a time."""
    for end in range(piece, len(text) + piece, piece):
        yield output(text[:end], finish=None if end < len(text) else STOP)


def build_app(piece: int) -> FastAPI:
    app = FastAPI()
    add_error_handlers(app)  # the server's own

    @app.post("/v1/chat/completions")
    async def chat_route(req: ChatCompletionRequest):
        parsing = chat_parsing(req, "qwen", "qwen3")
        text = SCRIPTS[req.messages[-1].text()]
        if not req.stream:
            return adapters.build_chat_response(req, [output(text)], "tiny", 1, parsing=parsing).model_dump()
        events = serving._chat_events(req, "tiny", fake_outputs(text, piece), "chatcmpl-1", 1, parsing)
        return StreamingResponse(sse_stream(events), media_type="text/event-stream")

    return app


@pytest.fixture(scope="module", params=[1, 7])
def client(request):
    """The official client wired to the app in-process; the fake model
    streams 1 or 7 characters at a time."""
    import openai._base_client as base

    http = getattr(base, "httpx2", None) or base.httpx
    app_client = TestClient(build_app(request.param))

    def handle(req):
        resp = app_client.request(req.method, req.url.path, content=req.read(),
                                  headers={"content-type": "application/json"})
        return http.Response(resp.status_code, headers={"content-type": resp.headers["content-type"]},
                             content=resp.content)

    return openai.OpenAI(base_url="http://test/v1", api_key="none", max_retries=0,
                         http_client=http.Client(transport=http.MockTransport(handle)))


STRICT_TOOLS = [{"type": "function", "function": {**t["function"], "strict": True}} for t in TOOLS]


@pytest.mark.parametrize("script,body", [("weather", {}), ("forced", {"tool_choice": "required"}), ("plain", {})])
def test_the_clients_accumulated_stream_equals_the_response(client, script, body):
    args = {"model": "tiny", "messages": [{"role": "user", "content": script}], "tools": STRICT_TOOLS, **body}
    whole = client.chat.completions.create(**args)
    with client.chat.completions.stream(**args) as stream:
        final = stream.get_final_completion()
    got, want = final.choices[0], whole.choices[0]
    assert got.finish_reason == want.finish_reason
    assert got.message.content == want.message.content
    assert got.message.model_extra.get("reasoning_content") == want.message.model_extra["reasoning_content"]
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []] == \
           [(c.function.name, c.function.arguments) for c in want.message.tool_calls or []]
    for call in got.message.tool_calls or []:
        assert call.function.parsed_arguments == json.loads(call.function.arguments)  # the client parsed them


def test_stream_chunks_in_openais_shape(client):
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "weather"}], tools=TOOLS, stream=True))
    pieces = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    firsts = [p for p in pieces if p.id is not None]
    assert [(p.index, p.type, p.function.name) for p in firsts] == [(0, "function", "get_weather"),
                                                                     (1, "function", "search")]
    assert all(p.id.startswith("call_") for p in firsts)
    assert all(p.type is None and p.function.name is None for p in pieces if p.id is None)
    args = {i: "".join(p.function.arguments or "" for p in pieces if p.index == i) for i in (0, 1)}
    assert json.loads(args[1]) == {"query": "a } </tool_call> b"}
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning_content") or "" for c in chunks)
    assert reasoning == "I need the weather."
    assert [c.choices[0].finish_reason for c in chunks][-1] == "tool_calls"


def test_stream_loop_without_parsers_is_unchanged():
    req = chat(stream=True)
    events = serving._chat_events(req, "m", fake_outputs("<think>x", 3), "id", 1, chat_parsing(req))

    async def collect():
        return [e async for e in events]

    texts = [json.loads(e[6:])["choices"][0]["delta"].get("content") for e in asyncio.run(collect())]
    assert texts == ["", "<th", "ink", ">x"]
