"""Tests of the OpenAI API's pure part, continued: engine outputs ->
responses and stream chunks, checked with the official ``openai`` package's
types (strict) and its client (as users run it) against a test-local app;
and the routes' model names. Requests and their validation:
``test_openai_protocol.py``, whose tokenizer these share."""

from __future__ import annotations

import json

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from fastapi.testclient import TestClient
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from test_openai_protocol import USER_HI, tokenizer  # noqa: F401 - a fixture the tests here take
from radixserve.entrypoints.openai import adapters
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from radixserve.entrypoints.openai.serving import add_openai_routes
from radixserve.entrypoints.http_server import add_error_handlers
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.managers.schedule_batch import FinishReason
from radixserve.managers.tokenizer_manager import raise_for_abort


class FakeTokenizerManager:
    """What the OpenAI routes use of a TokenizerManager, with ``fake_generate`` for the engine."""

    served_model_name, model_names, context_len = "tiny", {"tiny", "/models/tiny"}, 64
    lora_names, lora_adapters = None, {}  # started without --enable-lora

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def run_blocking(self, fn, *args):
        return fn(*args)

    async def generate_request(self, obj: GenerateReqInput, request=None):
        prompt = {"text": obj.text} if obj.text is not None else {"input_ids": obj.input_ids}
        for out in fake_generate({**prompt, "sampling_params": obj.sampling_params or {}}):
            yield out


def test_any_model_name_is_served_and_echoed_and_an_adapter_is_refused(tokenizer):
    """SGLang serves its model whatever ``model`` says (sglang-router fills
    one in) and echoes it; ``base:adapter`` asks for a LoRA adapter, which a
    server without LoRA refuses (400 naming ``model``)."""
    app = FastAPI()
    add_openai_routes(app, FakeTokenizerManager(tokenizer))
    http = TestClient(app)
    for name in ("tiny", "gpt-5", "default", "/models/tiny", "org/tiny:"):  # "x:" names no adapter
        reply = http.post("/v1/chat/completions", json={"model": name, "messages": USER_HI})
        assert reply.status_code == 200 and reply.json()["model"] == name, reply.text
    assert http.post("/v1/completions", json={"prompt": "hi"}).json()["model"] == "tiny"
    stream = http.post("/v1/completions", json={"model": "gpt-5", "prompt": "hi", "stream": True}).text
    chunks = [json.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: {")]
    assert chunks and all(c["model"] == "gpt-5" for c in chunks)
    for route, body in (("/v1/chat/completions", {"messages": USER_HI}), ("/v1/completions", {"prompt": "hi"})):
        reply = http.post(route, json={"model": "tiny:sql-adapter", **body})
        error = reply.json()["error"]
        assert reply.status_code == 400 and error["param"] == "model"
        assert "LoRA adapter 'sql-adapter'" in error["message"]


# -- outputs -> responses -------------------------------------------------------------------------


def output(index, text, prompt_tokens=3, completion_tokens=2, cached=0, finish=None, **meta) -> dict:
    finish = finish if finish is not None else {"type": "length", "length": completion_tokens}
    info = {"id": f"r{index}", "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
    info.update(cached_tokens=cached, finish_reason=finish, e2e_latency=0.1, **meta)
    return {"index": index, "text": text, "output_ids": [8] * completion_tokens, "meta_info": info}


class AbortingTokenizerManager(FakeTokenizerManager):
    """Every request ends in the abort ``reason``, as the TokenizerManager
    answers it (``raise_for_abort`` for a request not streamed)."""

    def __init__(self, tokenizer, reason: dict):
        super().__init__(tokenizer)
        self.reason = reason

    async def generate_request(self, obj: GenerateReqInput, request=None):
        if not obj.stream:
            raise_for_abort(self.reason)
        yield output(0, "p0", finish=self.reason)


@pytest.mark.parametrize("reason,status,param", [
    (FinishReason.refused("sampling_params.stop_regex: the search took over 0.05s").to_json(), 400, "stop_regex"),
    (FinishReason.refused("sampling_params.json_schema: it does not compile").to_json(), 400, "json_schema"),
    (FinishReason.failed("KV transfer of bootstrap room 7 failed").to_json(), 500, None),
    (FinishReason.aborted("aborted by request").to_json(), 200, None),
])
def test_an_abort_is_answered_by_its_status(tokenizer, reason, status, param):
    """As SGLang: 400 naming the OpenAI request's field, 500 for a server's
    failure, and a choice finished as "abort" for an abort asked for; a
    stream has answered 200 already and ends with the abort's reason."""
    app = FastAPI()
    add_error_handlers(app)
    add_openai_routes(app, AbortingTokenizerManager(tokenizer, reason))
    http = TestClient(app)
    body = {"model": "tiny", "prompt": "hi", "json_schema": "{}"} if param == "json_schema" else {"prompt": "hi"}
    reply = http.post("/v1/completions", json=body)
    assert reply.status_code == status, reply.text
    if status == 200:
        assert reply.json()["choices"][0]["finish_reason"] == "abort"
    else:
        error = reply.json()["error"]
        assert error["param"] == param and error["message"] == (f"{param}:" if param else "") + (
            reason["message"].split(":", 1)[1] if param else reason["message"])
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json={**body, "stream": True}).text
              .splitlines() if line.startswith("data: {")]
    assert chunks[-1]["choices"][0]["finish_reason"] == "abort"


def test_finish_reasons():
    assert adapters.finish_reason_to_openai(None) is None
    assert adapters.finish_reason_to_openai({"type": "stop", "matched": 2}) == "stop"
    assert adapters.finish_reason_to_openai({"type": "length", "length": 4}) == "length"
    assert adapters.finish_reason_to_openai({"type": "abort", "message": "x"}) == "abort"


def test_completion_response_usage_counts_each_prompt_once():
    req = CompletionRequest(prompt=["hello", "hello world"], n=2)
    outs = [
        output(3, "d", prompt_tokens=5, completion_tokens=1, cached=5, finish={"type": "stop", "matched": "!"}),
        output(0, "a", prompt_tokens=3, completion_tokens=2, cached=0),
        output(2, "c", prompt_tokens=5, completion_tokens=4, cached=2),
        output(1, "b", prompt_tokens=3, completion_tokens=3, cached=3, finish={"type": "stop", "matched": 2}),
    ]
    resp = adapters.build_completion_response(req, outs, "m", 1700000000, request_id="cmpl-1")
    parsed = Completion.model_validate(resp.model_dump(mode="json"))
    assert [c.text for c in parsed.choices] == ["a", "b", "c", "d"]
    assert [c.finish_reason for c in parsed.choices] == ["length", "stop", "length", "stop"]
    assert [c.matched_stop for c in resp.choices] == [None, 2, None, "!"]
    usage = parsed.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (8, 10, 18)
    assert usage.prompt_tokens_details.cached_tokens == 2  # min over samples: 0 for prompt 0, 2 for prompt 1
    assert (parsed.id, parsed.created, parsed.model, parsed.object) == ("cmpl-1", 1700000000, "m", "text_completion")


def test_completion_echo_with_logprobs(tokenizer):
    req = CompletionRequest(prompt=[[6, 7], [8]], echo=True, logprobs=1, max_tokens=1)
    first = output(
        0, " hi", prompt_tokens=2, completion_tokens=1,
        input_token_logprobs=[(None, 6, "hello"), (-1.0, 7, " world")],
        input_top_logprobs=[None, [(-0.5, 8, " hi")]],
        output_token_logprobs=[(-0.25, 8, " hi")],
        output_top_logprobs=[[(-0.25, 8, " hi")]],
    )  # fmt: skip
    second = output(
        1, "!", prompt_tokens=1, completion_tokens=1,
        input_token_logprobs=[(None, 8, "hi")], input_top_logprobs=[None],
        output_token_logprobs=[(-2.0, 10, "!")], output_top_logprobs=[[(-0.1, 9, None)]],
    )  # fmt: skip
    prompts = adapters.prompt_texts(req, tokenizer)
    assert prompts == ["hello world", "hi"]
    resp = adapters.build_completion_response(req, [first, second], "m", 0, prompts=prompts)
    a, b = resp.choices
    assert (a.text, b.text) == ("hello world hi", "hi!")
    assert a.logprobs.model_dump() == {
        "tokens": ["hello", " world", " hi"],
        "token_logprobs": [None, -1.0, -0.25],
        "top_logprobs": [None, {" world": -1.0, " hi": -0.5}, {" hi": -0.25}],
        "text_offset": [0, 5, 11],
    }
    # The sampled token joins its alternatives (up to logprobs + 1 entries); a token without text gets its id.
    assert b.logprobs.top_logprobs == [None, {"!": -2.0, "token_id:9": -0.1}]
    client_view = openai.types.Completion.construct(**resp.model_dump(mode="json"))
    assert client_view.choices[0].logprobs.token_logprobs[0] is None  # how the client parses it


def test_completion_logprobs_without_echo_start_at_choice_text():
    req = CompletionRequest(prompt="hello", logprobs=0)
    out = output(0, " hi!", output_token_logprobs=[(-0.5, 8, " hi"), (-1.5, 10, "!")])
    resp = adapters.build_completion_response(req, [out], "m", 0)
    lp = Completion.model_validate(resp.model_dump(mode="json")).choices[0].logprobs
    assert (lp.tokens, lp.text_offset, lp.top_logprobs) == ([" hi", "!"], [0, 3], [{" hi": -0.5}, {"!": -1.5}])
    assert resp.id.startswith("cmpl-")


def test_completion_echo_logprobs_zero_with_empty_top_lists():
    """With top_logprobs_num = 0 the TokenizerManager sends empty top-logprob lists."""
    req = CompletionRequest(prompt="hello", echo=True, logprobs=0, max_tokens=1)
    out = output(
        0, " hi", input_token_logprobs=[(None, 6, "hello")], input_top_logprobs=[],
        output_token_logprobs=[(-0.5, 8, " hi")], output_top_logprobs=[],
    )  # fmt: skip
    lp = adapters.build_completion_response(req, [out], "m", 0, prompts=["hello"]).choices[0].logprobs
    assert (lp.token_logprobs, lp.top_logprobs, lp.text_offset) == ([None, -0.5], [None, {" hi": -0.5}], [0, 5])


def test_chat_response_with_logprobs():
    req = ChatCompletionRequest(messages=USER_HI, n=2, logprobs=True, top_logprobs=2)
    tops = [[(-0.1, 9, " there"), (-2.5, 8, " hi")], [(-0.2, 10, "é")]]
    outs = [
        output(1, "x", output_token_logprobs=[(-0.1, 9, " there"), (-0.2, 10, "é")], output_top_logprobs=tops),
        output(0, "y", cached=3, finish={"type": "stop", "matched": 2}, output_token_logprobs=[]),
    ]
    resp = adapters.build_chat_response(req, outs, "m", 5)
    parsed = ChatCompletion.model_validate(resp.model_dump(mode="json"))
    assert resp.id.startswith("chatcmpl-") and parsed.object == "chat.completion"
    assert [(c.index, c.message.role, c.message.content, c.finish_reason) for c in parsed.choices] == [
        (0, "assistant", "y", "stop"),
        (1, "assistant", "x", "length"),
    ]
    content = parsed.choices[1].logprobs.content
    assert [(t.token, t.logprob) for t in content] == [(" there", -0.1), ("é", -0.2)]
    assert content[1].bytes == [0xC3, 0xA9]
    assert [(t.token, t.logprob) for t in content[0].top_logprobs] == [(" there", -0.1), (" hi", -2.5)]
    assert parsed.choices[0].logprobs.content == []
    assert (parsed.usage.prompt_tokens, parsed.usage.completion_tokens) == (3, 4)  # one prompt, two samples
    assert parsed.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_response_without_logprobs_has_none():
    resp = adapters.build_chat_response(ChatCompletionRequest(messages=USER_HI), [output(0, "ok")], "m", 0)
    assert resp.choices[0].logprobs is None and resp.usage.total_tokens == 5


# -- streaming ------------------------------------------------------------------------------------------


def test_chat_stream_chunks():
    first = adapters.chat_stream_chunk("id1", 7, "m", 1, role="assistant", content="")
    middle = adapters.chat_stream_chunk(
        "id1", 7, "m", 1, content="hi", logprobs=adapters.chat_logprobs([(-0.3, 8, "hi")], [[(-0.3, 8, "hi")]])
    )
    last = adapters.chat_stream_chunk("id1", 7, "m", 1, content="", finish_reason={"type": "stop", "matched": "!"})
    events = [adapters.sse_event(c) for c in (first, middle, last)]
    assert all(e.startswith("data: {") and e.endswith("}\n\n") for e in events)
    chunks = [ChatCompletionChunk.model_validate_json(e.removeprefix("data: ")) for e in events]
    assert [(c.choices[0].delta.role, c.choices[0].delta.content) for c in chunks] == [
        ("assistant", ""),
        (None, "hi"),
        (None, ""),
    ]
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "stop"]
    assert chunks[1].choices[0].logprobs.content[0].top_logprobs[0].token == "hi"
    assert {c.id for c in chunks} == {"id1"} and chunks[0].object == "chat.completion.chunk"


def test_usage_chunks():
    outs = [output(0, "a", completion_tokens=2, cached=1), output(1, "b", completion_tokens=5, cached=3)]
    chat = ChatCompletionChunk.model_validate(adapters.usage_chunk("c", 1, "m", outs, n=2).model_dump(mode="json"))
    assert chat.choices == [] and (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (3, 7)
    assert chat.usage.prompt_tokens_details.cached_tokens == 1
    plain = adapters.usage_chunk("c", 1, "m", outs, n=1, chat=False)
    assert plain.object == "text_completion" and plain.usage.prompt_tokens == 6


def test_completion_stream_chunk_and_logprob_offsets():
    lp = adapters.completion_logprobs([(-1.0, 9, " there")], [[(-1.0, 9, " there")]], offset=3)
    finish = {"type": "length", "length": 2}
    chunk = adapters.completion_stream_chunk("s", 1, "m", 2, " there", finish_reason=finish, logprobs=lp)
    parsed = Completion.model_validate(chunk.model_dump(mode="json"))
    assert (parsed.choices[0].index, parsed.choices[0].text, parsed.choices[0].finish_reason) == (2, " there", "length")
    assert parsed.choices[0].logprobs.text_offset == [3] and parsed.usage is None
    assert adapters.completion_stream_chunk("s", 1, "m", 0, "x").choices[0].finish_reason is None


# -- the real client against a test-local app ----------------------------------------------------------


def fake_generate(kwargs: dict) -> list[dict]:
    """What the TokenizerManager would return: sample j of prompt i says 'p{i}s{j}'."""
    prompts = kwargs.get("text", kwargs.get("input_ids"))
    prompts = [prompts] if isinstance(prompts, str) or isinstance(prompts[0], int) else prompts
    n = kwargs["sampling_params"].get("n", 1)
    lp = {"output_token_logprobs": [(-0.5, 8, "p")], "input_token_logprobs": [(None, 1, "<s>")]}
    lp.update(output_top_logprobs=[[(-0.5, 8, "p")]], input_top_logprobs=[None])
    extra = lp if kwargs.get("return_logprob") else {}
    return [output(i * n + j, f"p{i}s{j}", cached=j, **extra) for i in range(len(prompts)) for j in range(n)]


def build_app(tokenizer) -> FastAPI:
    app = FastAPI()
    add_error_handlers(app)  # the server's own

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        outs = fake_generate(adapters.completion_to_generate(req))
        prompts = adapters.prompt_texts(req, tokenizer)
        return adapters.build_completion_response(req, outs, "tiny", 1, prompts=prompts)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest):
        outs = fake_generate(adapters.chat_to_generate(req, tokenizer))
        if not req.stream:
            return adapters.build_chat_response(req, outs, "tiny", 1)
        return StreamingResponse(chat_events(req, outs), media_type="text/event-stream")

    return app


def chat_events(req: ChatCompletionRequest, outs: list[dict]):
    for out in outs:
        i, text, finish = out["index"], out["text"], out["meta_info"]["finish_reason"]
        yield adapters.sse_event(adapters.chat_stream_chunk("s1", 1, "tiny", i, role="assistant", content=""))
        yield adapters.sse_event(adapters.chat_stream_chunk("s1", 1, "tiny", i, content=text[:2]))
        yield adapters.sse_event(adapters.chat_stream_chunk("s1", 1, "tiny", i, content=text[2:], finish_reason=finish))
    if req.stream_options and req.stream_options.include_usage:
        yield adapters.sse_event(adapters.usage_chunk("s1", 1, "tiny", outs, req.n or 1))
    yield adapters.SSE_DONE


@pytest.fixture(scope="module")
def client(tokenizer):
    """The official client, its HTTP transport wired to the app in-process."""
    import openai._base_client as base

    http = getattr(base, "httpx2", None) or base.httpx  # newer clients ship their own httpx fork
    app_client = TestClient(build_app(tokenizer))

    def handle(request):
        body = request.read()
        headers = {"content-type": "application/json"}
        resp = app_client.request(request.method, request.url.path, content=body, headers=headers)
        headers = {"content-type": resp.headers["content-type"]}
        return http.Response(resp.status_code, headers=headers, content=resp.content)

    transport = http.Client(transport=http.MockTransport(handle))
    return openai.OpenAI(base_url="http://test/v1", api_key="none", max_retries=0, http_client=transport)


def test_client_completions_echo_logprobs(client):
    resp = client.completions.create(model="tiny", prompt=[[6, 7], [8]], n=2, echo=True, logprobs=1, max_tokens=2)
    assert [c.text for c in resp.choices] == ["hello worldp0s0", "hello worldp0s1", "hip1s0", "hip1s1"]
    assert resp.choices[0].logprobs.tokens == ["<s>", "p"] and resp.choices[0].logprobs.token_logprobs[0] is None
    assert (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (6, 8)


def test_client_chat_stream_with_usage(client):
    stream = client.chat.completions.create(
        model="tiny", messages=USER_HI, n=2, stream=True, stream_options={"include_usage": True}
    )
    texts, finish, usage = {}, {}, None
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finish[choice.index] = choice.finish_reason or finish.get(choice.index)
        usage = chunk.usage or usage
    assert texts == {0: "p0s0", 1: "p0s1"} and finish == {0: "length", 1: "length"}
    assert (usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens) == (3, 4, 0)


def test_client_chat_logprobs(client):
    resp = client.chat.completions.create(model="tiny", messages=USER_HI, logprobs=True, top_logprobs=1)
    assert resp.choices[0].message.content == "p0s0"
    assert resp.choices[0].logprobs.content[0].top_logprobs[0].token == "p"


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"temperature": 3}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
        ({"top_logprobs": 3}, "top_logprobs"),
    ],
)
def test_client_sees_bad_request_with_param(client, kwargs, param):
    body = {"model": "tiny", "messages": USER_HI, **kwargs}
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(**body)
    assert exc.value.status_code == 400 and exc.value.param == param
    assert exc.value.type == "invalid_request_error" and param in exc.value.message
