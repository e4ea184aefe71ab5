"""Tests of the OpenAI API's pure part: request validation (each error names its
param), requests -> GenerateReqInput arguments, engine outputs -> responses and
stream chunks. Responses are checked with the official ``openai`` package: its
types (strict) and its client (as users run it) against a test-local app."""

from __future__ import annotations


import pytest
from pydantic import ValidationError
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from radixserve.entrypoints.openai import adapters
from radixserve.entrypoints.openai.protocol import MAX_N, ChatCompletionRequest, CompletionRequest
from radixserve.managers.io_struct import GenerateReqInput
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.validation import NO_OP_VALUES, NoOpOnly

WORDS = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "hello", "world", "hi", "there", "!"]
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer():
    """A word-level tokenizer that adds a BOS on encode, as Llama's does."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    hf.add_special_tokens({"additional_special_tokens": ["<|system|>", "<|user|>", "<|assistant|>"]})
    hf.chat_template = TEMPLATE
    return hf


def error_of(cls, body: dict) -> dict:
    with pytest.raises(ValidationError) as exc:
        cls.model_validate(body)
    return adapters.validation_error_to_openai(exc.value.errors())["error"]


# -- validation ------------------------------------------------------------------------------------

COMPLETION_ERRORS = [
    ({"temperature": 2.5}, "temperature", "less than or equal to 2"),
    ({"temperature": -0.1}, "temperature", "greater than or equal to 0"),
    ({"temperature": float("nan")}, "temperature", "finite"),
    ({"top_p": 0}, "top_p", "greater than 0"),
    ({"top_p": 1.5}, "top_p", "less than or equal to 1"),
    ({"max_tokens": 0}, "max_tokens", "only with echo"),
    ({"max_tokens": -1}, "max_tokens", "greater than or equal to 0"),
    ({"n": 0}, "n", "greater than or equal to 1"),
    ({"n": MAX_N + 1}, "n", f"less than or equal to {MAX_N}"),
    ({"stop": [""]}, "stop", "non-empty string"),
    ({"stop": [1]}, "stop", "non-empty string"),
    ({"logprobs": 21}, "logprobs", "less than or equal to 20"),
    ({"logit_bias": {"abc": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"top_k": 0}, "top_k", "-1 (no limit) or >= 1"),
    ({"min_p": 2}, "min_p", "less than or equal to 1"),
    ({"repetition_penalty": 0}, "repetition_penalty", "greater than 0"),
    ({"presence_penalty": 3}, "presence_penalty", "less than or equal to 2"),
    ({"stop_token_ids": [-1]}, "stop_token_ids", ">= 0"),
    ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "<= the maximum"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream is true"),
    ({"best_of": 3}, "best_of", "best_of == n"),
    ({"suffix": "tail"}, "suffix", "not supported"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "'json_object'"),
    ({"regex": "a+", "ebnf": "root ::= \"a\""}, "ebnf", "only one of"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "regex", "only one of"),
    ({"stop_regex": "a(+"}, "stop_regex", "invalid regular expression"),
    ({"prompt": []}, "prompt", "must be a string"),
    ({"prompt": [[]]}, "prompt", "must be a string"),
    ({"prompt": [1, -2]}, "prompt", "token ids >= 0"),
    ({"prompt": ["a", 1]}, "prompt", "must be a string"),
]


@pytest.mark.parametrize("body,param,text", COMPLETION_ERRORS)
def test_completion_errors_name_their_param(body, param, text):
    err = error_of(CompletionRequest, {"model": "m", "prompt": "hi", **body})
    assert (err["param"], err["type"], err["code"]) == (param, "invalid_request_error", 400)
    assert err["message"].startswith(f"{param}: ") and text in err["message"]


CHAT_ERRORS = [
    ({"messages": []}, "messages", "at least 1 item"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role", "'user'"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "required for role 'user'"),
    (
        {"messages": USER_HI + [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        "messages[1].content",
        "only text content parts",
    ),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "a string or a list"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ({"max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"max_completion_tokens": 0}, "max_completion_tokens", "greater than or equal to 1"),
    ({"max_completion_tokens": 4, "min_tokens": 5}, "min_tokens", "<= the maximum number of tokens (4)"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name", "pattern"),
    ({"tool_choice": "required"}, "tool_choice", "needs at least one tool"),
    ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema: required"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": []}}}, "response_format.json_schema.schema",
     "dictionary"),
    ({"modalities": ["text", "audio"]}, "modalities", "not supported"),
    ({"n": MAX_N + 1}, "n", "less than or equal to"),
]


@pytest.mark.parametrize("body,param,text", CHAT_ERRORS)
def test_chat_errors_name_their_param(body, param, text):
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": USER_HI, **body})
    assert err["param"] == param
    assert err["message"].startswith(f"{param}: ") and text in err["message"]


def test_unknown_fields_ignored_and_neutral_unsupported_values_accepted():
    req = ChatCompletionRequest.model_validate(
        {
            "messages": USER_HI,
            "user": "u1",
            "metadata": {"k": "v"},
            "store": False,
            "tools": [],
            "tool_choice": "none",
            "response_format": {"type": "text"},
            "modalities": ["text"],
            "temperature": None,
            "some_vendor_field": 1,
            "lora_path": None,
            "return_hidden_states": False,
            "separate_reasoning": True,
        }
    )
    assert req.user == "u1" and req.store is False and req.temperature is None
    assert not hasattr(req, "some_vendor_field")


NO_OP_MODELS = [(GenerateReqInput, {"text": "hi"}), (SamplingParams, {}), (CompletionRequest, {"prompt": "x"}),
                (ChatCompletionRequest, {"messages": USER_HI})]


@pytest.mark.parametrize("cls,body", NO_OP_MODELS, ids=lambda v: getattr(v, "__name__", ""))
def test_fields_not_implemented_take_their_no_op_values_and_refuse_others_by_name(cls, body):
    fields = [name for name, f in cls.__pydantic_fields__.items() if f.metadata == list(NoOpOnly.__metadata__)]
    assert len(fields) >= 4
    for name in fields:
        for value in NO_OP_VALUES[name]:
            assert getattr(cls(**body, **{name: value}), name) == value
        with pytest.raises(ValidationError, match=f"'{name}' is not supported by this server"):
            cls(**body, **{name: {"asks": "for something"}})


def test_prompt_shapes_accepted():
    for prompt in ["", "hi", ["a", "b"], [1, 2], [[1], [2, 3]]]:
        assert CompletionRequest(prompt=prompt).prompt == prompt
    assert CompletionRequest(prompt="x", echo=True, max_tokens=0).max_tokens == 0


def test_fastapi_loc_is_stripped_of_body():
    errors = [{"loc": ("body", "messages", 2, "role"), "msg": "Input should be 'user'", "type": "literal_error"}]
    assert adapters.validation_error_to_openai(errors)["error"]["param"] == "messages[2].role"
    json_error = [{"loc": ("body", 1), "msg": "JSON decode error", "type": "json_invalid"}]
    assert adapters.validation_error_to_openai(json_error)["error"]["param"] == "[1]"


def test_several_errors_are_all_reported_first_param_wins():
    err = error_of(CompletionRequest, {"prompt": "x", "temperature": 9, "top_p": 9})
    assert err["param"] == "temperature" and "top_p: " in err["message"]


def test_openai_error_shape_and_value_errors():
    assert adapters.openai_error("gone", type="not_found_error", code=404) == {
        "error": {"message": "gone", "type": "not_found_error", "param": None, "code": 404}
    }
    err = adapters.value_error_to_openai(ValueError("input_ids: prompt has 5000 tokens, context is 4096"))["error"]
    assert err["param"] == "input_ids" and "5000" in err["message"]
    assert adapters.value_error_to_openai(ValueError("something odd"))["error"]["param"] is None


# -- requests -> GenerateReqInput ---------------------------------------------------------------------


def test_completion_to_generate_maps_names():
    req = CompletionRequest(
        prompt="hello",
        max_tokens=7,
        min_tokens=2,
        temperature=0.5,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        n=3,
        stop="!",
        seed=42,
        stream=True,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        logit_bias={"6": -100, "7": 2.5},
        ignore_eos=True,
        skip_special_tokens=False,
        stop_token_ids=[2],
        no_stop_trim=True,
    )
    kwargs = adapters.completion_to_generate(req)
    assert kwargs == {
        "text": "hello",
        "stream": True,
        "sampling_params": {
            "max_new_tokens": 7,
            "min_new_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.1,
            "n": 3,
            "stop": ["!"],
            "sampling_seed": 42,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.5,
            "repetition_penalty": 1.1,
            "logit_bias": {6: -100.0, 7: 2.5},
            "ignore_eos": True,
            "skip_special_tokens": False,
            "stop_token_ids": [2],
            "no_stop_trim": True,
        },
    }
    SamplingParams.from_dict(kwargs["sampling_params"]).verify(vocab_size=len(WORDS))  # real field names


def test_completion_to_generate_defaults_and_token_prompts():
    assert adapters.completion_to_generate(CompletionRequest(prompt="x")) == {
        "text": "x",
        "sampling_params": {"max_new_tokens": 16},
        "stream": False,
    }
    assert adapters.completion_to_generate(CompletionRequest(prompt=[5, 6]))["input_ids"] == [5, 6]
    assert adapters.completion_to_generate(CompletionRequest(prompt=[[5], [6, 7]]))["input_ids"] == [[5], [6, 7]]
    assert adapters.completion_to_generate(CompletionRequest(prompt=["a", "b"]))["text"] == ["a", "b"]


@pytest.mark.parametrize("echo,start", [(False, -1), (True, 0)])
def test_completion_logprobs_request_input_logprobs_only_with_echo(echo, start):
    kwargs = adapters.completion_to_generate(CompletionRequest(prompt="x", logprobs=3, echo=echo))
    GenerateReqInput(**kwargs)  # the engine's request type takes these arguments
    assert (kwargs["return_logprob"], kwargs["top_logprobs_num"], kwargs["logprob_start_len"]) == (True, 3, start)
    assert kwargs["return_text_in_logprobs"] is True


def test_chat_to_generate_applies_template_with_one_bos(tokenizer):
    req = ChatCompletionRequest(
        messages=[
            {"role": "developer", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
        ],
        max_tokens=9,
        max_completion_tokens=4,
        temperature=0,
    )
    assert adapters.render_chat(req, tokenizer) == "<s><|system|> hello <|user|> hi\nthere <|assistant|>"
    kwargs = adapters.chat_to_generate(req, tokenizer)
    ids = kwargs.pop("input_ids")
    assert ids == [1, 3, 6, 4, 8, 9, 5] and ids.count(tokenizer.bos_token_id) == 1
    assert kwargs == {"sampling_params": {"max_new_tokens": 4, "temperature": 0.0}, "stream": False}


def test_chat_to_generate_logprobs_and_no_limit(tokenizer):
    req = ChatCompletionRequest(messages=USER_HI, logprobs=True, top_logprobs=2)
    kwargs = adapters.chat_to_generate(req, tokenizer)
    GenerateReqInput(**kwargs)
    assert "max_new_tokens" not in kwargs["sampling_params"]  # the engine's limit applies
    assert (kwargs["return_logprob"], kwargs["top_logprobs_num"], kwargs["logprob_start_len"]) == (True, 2, -1)
    kwargs = adapters.chat_to_generate(ChatCompletionRequest(messages=USER_HI, logprobs=True), tokenizer)
    assert kwargs["top_logprobs_num"] == 0
    assert "return_logprob" not in adapters.chat_to_generate(ChatCompletionRequest(messages=USER_HI), tokenizer)


def test_chat_without_template_or_rejected_by_it(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    with pytest.raises(ValueError, match="^messages: this model has no chat template") as exc:
        adapters.chat_to_generate(ChatCompletionRequest(messages=USER_HI), bare)
    assert adapters.value_error_to_openai(exc.value)["error"]["param"] == "messages"
    strict = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    strict.chat_template = "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    with pytest.raises(ValueError, match="^messages: .*user first"):
        adapters.render_chat(ChatCompletionRequest(messages=[{"role": "assistant", "content": "x"}]), strict)


def test_reasoning_effort_reaches_a_template_that_takes_it(tokenizer):
    """As SGLang: the level is a template variable, with ``thinking`` and
    ``enable_thinking`` defaulting to whether it is not "none"; a template
    that does not read it renders as without it."""
    effort = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer)
    effort.chat_template = "{{ reasoning_effort }}|{{ enable_thinking }}|{{ thinking }}"

    def render(tok, **fields):
        return adapters.render_chat(ChatCompletionRequest(messages=USER_HI, **fields), tok)

    assert render(effort, reasoning_effort="high") == "high|True|True"
    assert render(effort, reasoning_effort="none") == "none|False|False"
    assert render(effort, reasoning_effort=0.25) == "0.25|True|True"
    assert render(effort, reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}) == "low|False|True"
    assert render(effort) == "||"
    assert render(tokenizer, reasoning_effort="medium") == render(tokenizer)
    for bad in ("extreme", 1.5, True):
        err = error_of(ChatCompletionRequest, {"messages": USER_HI, "reasoning_effort": bad})
        assert err["param"] == "reasoning_effort"
