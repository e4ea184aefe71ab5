"""Pure translations between the OpenAI API and the engine.

Requests become keyword arguments of ``GenerateReqInput`` (SGLang's names);
the dicts that ``TokenizerManager.generate_request`` yields become OpenAI
responses and stream chunks; errors become OpenAI's ``{"error": {...}}``.
Nothing here does I/O, so the HTTP server stays a thin loop around it.

An output dict is ``{"text", "output_ids", "meta_info", "index"?}``; ``index``
(absent for a single request) is ``prompt * n + sample``. Logprob entries are
``(logprob, token_id, text)`` tuples, the text present because the requests
built here ask for ``return_text_in_logprobs``.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any, Iterable

from jinja2 import TemplateError
from pydantic import BaseModel, ValidationError

from radixserve.entrypoints.openai.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatCompletionTokenLogprob,
    ChatMessage,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DeltaMessage,
    ErrorDetail,
    ErrorResponse,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from radixserve.entrypoints.openai.chat_parsing import ChatParsing, ChoiceOutput
from radixserve.entrypoints.openai.tool_calls import check_tool_schemas, offered_tools, tool_grammar
from radixserve.entrypoints.openai.tool_parser import ToolCallDelta
from radixserve.entrypoints.openai.tool_protocol import (
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCallResponse,
    ToolCallResponse,
)
from radixserve.validation import FIELD_PREFIX, error_path

SSE_DONE = "data: [DONE]\n\n"

# OpenAI request field -> SGLang sampling parameter, for fields copied as they are.
_SAMPLING_NAMES = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_new_tokens",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "stop_regex": "stop_regex",
    "ignore_eos": "ignore_eos",
    "skip_special_tokens": "skip_special_tokens",
    "no_stop_trim": "no_stop_trim",
    "n": "n",
    "seed": "sampling_seed",
}
# Roles chat templates know; OpenAI's "developer" is a system message to them.
_TEMPLATE_ROLES = {"developer": "system"}
_MAX_ERRORS = 3  # errors quoted in one message (a bad list can have thousands)


# -- requests ------------------------------------------------------------------------------


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_new_tokens: int | None) -> dict:
    """SGLang sampling params for ``req``: only what the client set, so the
    engine's defaults apply to the rest."""
    params = {sg: getattr(req, oa) for oa, sg in _SAMPLING_NAMES.items() if getattr(req, oa) is not None}
    if max_new_tokens is not None:
        params["max_new_tokens"] = max_new_tokens
    if req.logit_bias:
        params["logit_bias"] = {int(token): bias for token, bias in req.logit_bias.items()}
    grammar = req.grammar()
    if grammar is not None:
        params[grammar[0]] = grammar[1]
    return params


def completion_to_generate(req: CompletionRequest) -> dict:
    """Keyword arguments of ``GenerateReqInput`` for a completions request.
    ``echo`` with ``logprobs`` asks for input logprobs from the first token."""
    key = "text" if isinstance(req.prompt, str) or isinstance(req.prompt[0], str) else "input_ids"
    kwargs = {key: req.prompt, "sampling_params": sampling_params(req, req.max_tokens), "stream": req.stream,
              **_rid(req)}
    if req.logprobs is not None:
        kwargs.update(_logprob_args(req.logprobs, logprob_start_len=0 if req.echo else -1))
    return kwargs


def chat_to_generate(req: ChatCompletionRequest, tokenizer: Any, tool_call_parser: str | None = None) -> dict:
    """Keyword arguments of ``GenerateReqInput`` for a chat request: the chat
    template applied to the messages, as token ids; the grammar of forced or
    strict tool calls (``tool_calls.tool_grammar``).

    The rendered prompt is encoded without special tokens: templates write the
    BOS themselves, and a second one from ``encode`` would change the output.
    Raises ``ValueError("messages: ...")`` when the model has no chat template
    or the template rejects the conversation, ``ValueError("tools[i]...")``
    for a tool schema that does not build as a grammar.
    """
    check_tool_schemas(req.tools)
    prompt = render_chat(req, tokenizer)
    kwargs = {
        "input_ids": encode_chat_prompt(tokenizer, prompt, [m.text() for m in req.messages]),
        "sampling_params": sampling_params(req, req.max_new_tokens),
        "stream": req.stream,
        **_rid(req),
    }
    if offered_tools(req) and req.skip_special_tokens is None:
        kwargs["sampling_params"]["skip_special_tokens"] = False  # as SGLang: call markers may be special tokens
    grammar = tool_grammar(req, tool_call_parser)
    if grammar is not None:
        kwargs["sampling_params"][grammar[0]] = grammar[1]
    if req.logprobs:
        kwargs.update(_logprob_args(req.top_logprobs or 0, logprob_start_len=-1))
    return kwargs


def _rid(req: CompletionRequest | ChatCompletionRequest) -> dict:
    """The request id, the disaggregation fields and the LoRA adapter, where given."""
    fields = ("rid", "bootstrap_host", "bootstrap_port", "bootstrap_room", "lora_path")
    return {name: getattr(req, name) for name in fields if getattr(req, name) is not None}


def render_chat(req: ChatCompletionRequest, tokenizer: Any) -> str:
    """The prompt text of a chat request: the generation prompt appended, or
    with ``continue_final_message`` the last (assistant) message left open;
    ``req.template_kwargs()`` go to the template (``enable_thinking``,
    ``reasoning_effort`` ...), and so do the offered tools (a template that
    does not use them leaves them out of the prompt, as in SGLang)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("messages: this model has no chat template; use /v1/completions")
    messages = [_template_message(m) for m in req.messages]
    tools = [tool.template_dict() for tool in offered_tools(req)] or None
    try:
        return tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=not req.continue_final_message,
            continue_final_message=req.continue_final_message, **req.template_kwargs())
    except TemplateError as e:
        raise ValueError(f"messages: the chat template rejected them: {e}") from e


def encode_chat_prompt(tokenizer: Any, prompt: str, contents: list[str | None]) -> list[int]:
    """Token ids of a rendered chat prompt in which only the template's own
    special tokens are special: text in a message that spells a special token
    (``<|im_start|>system``) stays text, so a user cannot forge role markers.

    Raises ``ValueError("messages[i].content: ...")`` when such a message
    cannot be found in the prompt (the template rewrote it), rather than
    guess where it lies."""
    special = _special_texts(tokenizer)
    risky = [i for i, text in enumerate(contents) if text and any(tok in text for tok in special)]
    if not risky:
        return tokenizer.encode(prompt, add_special_tokens=False)
    ids, pos = [], 0
    for i in risky:
        text = contents[i].strip()
        start = prompt.find(text, pos)
        if start < 0:
            raise ValueError(f"messages[{i}].content: it contains special-token text, and the chat template "
                             "changed it in a way that cannot be tokenized as plain text")
        ids += tokenizer.encode(prompt[pos:start], add_special_tokens=False)
        ids += tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
        pos = start + len(text)
    return ids + tokenizer.encode(prompt[pos:], add_special_tokens=False)


def _special_texts(tokenizer: Any) -> list[str]:
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    texts = [tok.content for tok in added.values() if getattr(tok, "special", False)]
    return texts or list(getattr(tokenizer, "all_special_tokens", []))


def _template_message(msg: Any) -> dict:
    out = {"role": _TEMPLATE_ROLES.get(msg.role, msg.role), "content": msg.text() or ""}
    for key in ("name", "tool_call_id"):
        if getattr(msg, key) is not None:
            out[key] = getattr(msg, key)
    if msg.tool_calls is not None:
        out["tool_calls"] = [call.template_dict() for call in msg.tool_calls]
    return out


def _logprob_args(top_n: int, logprob_start_len: int) -> dict:
    return {
        "return_logprob": True,
        "top_logprobs_num": top_n,
        "logprob_start_len": logprob_start_len,
        "return_text_in_logprobs": True,
    }


# -- finish reasons and usage ------------------------------------------------------------------


def finish_reason_to_openai(finish_reason: dict | None) -> str | None:
    """``meta_info["finish_reason"]`` as OpenAI's string: ``"stop"``,
    ``"length"``, or SGLang's ``"abort"`` (a request aborted on purpose; one
    the request or the server failed is answered with an error instead, see
    ``FinishReason``); ``None`` while unfinished."""
    return None if finish_reason is None else finish_reason["type"]


def _matched_stop(finish_reason: dict | None) -> int | str | None:
    return (finish_reason or {}).get("matched")


def usage_info(outputs: Iterable[dict], n: int = 1) -> UsageInfo:
    """Usage of a whole response. A prompt's tokens count once however many
    samples it has; its cached tokens are the fewest any of its samples found
    cached (later samples may hit the KV that the first one just wrote)."""
    per_prompt: dict[int, list[dict]] = {}
    completion = 0
    for out in outputs:
        per_prompt.setdefault(_index(out) // n, []).append(out["meta_info"])
        completion += out["meta_info"]["completion_tokens"]
    prompt = sum(metas[0]["prompt_tokens"] for metas in per_prompt.values())
    cached = sum(min(m.get("cached_tokens", 0) for m in metas) for metas in per_prompt.values())
    return UsageInfo(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _index(out: dict) -> int:
    return out.get("index", 0)


# -- logprobs ------------------------------------------------------------------------------------


def completion_logprobs(
    token_logprobs: list[tuple], top_logprobs: list[list[tuple] | None] | None = None, offset: int = 0
) -> CompletionLogprobs:
    """Legacy-format logprobs of consecutive tokens; ``offset`` is the text
    offset of the first one (for stream chunks after the first).

    As OpenAI documents, each ``top_logprobs`` dict also holds the sampled
    token, so it has up to ``logprobs + 1`` entries.
    """
    tops = top_logprobs or [[]] * len(token_logprobs)
    result = CompletionLogprobs()
    for entry, top in zip(token_logprobs, tops):
        token = _token_text(entry)
        result.tokens.append(token)
        result.token_logprobs.append(entry[0])
        result.text_offset.append(offset)
        offset += len(token)
        if top is None or entry[0] is None:  # the first prompt token has no distribution
            result.top_logprobs.append(None)
        else:
            alternatives = {_token_text(alt): alt[0] for alt in reversed(top)}  # the best wins a text tie
            result.top_logprobs.append({token: entry[0], **alternatives})
    return result


def chat_logprobs(token_logprobs: list[tuple], top_logprobs: list[list[tuple]] | None = None) -> ChoiceLogprobs:
    """Chat-format logprobs of consecutive output tokens."""
    tops = top_logprobs or [[]] * len(token_logprobs)
    content = [
        ChatCompletionTokenLogprob(**_chat_token(entry), top_logprobs=[TopLogprob(**_chat_token(alt)) for alt in top])
        for entry, top in zip(token_logprobs, tops)
    ]
    return ChoiceLogprobs(content=content)


def _chat_token(entry: tuple) -> dict:
    text = _token_text(entry)
    return {"token": text, "logprob": entry[0], "bytes": list(text.encode("utf-8"))}


def _token_text(entry: tuple) -> str:
    """A logprob entry's token text; ``token_id:N`` when the engine sent none."""
    return entry[2] if len(entry) > 2 and entry[2] is not None else f"token_id:{entry[1]}"


# -- complete responses -----------------------------------------------------------------------------


def prompt_texts(req: CompletionRequest, tokenizer: Any = None) -> list[str]:
    """The text of each prompt, for ``echo``: token-id prompts are decoded
    with ``tokenizer``."""
    prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
    return [p if isinstance(p, str) else tokenizer.decode(p) for p in prompts]


def build_completion_response(
    req: CompletionRequest,
    outputs: list[dict],
    model_name: str,
    created: int,
    *,
    request_id: str | None = None,
    prompts: list[str] | None = None,
) -> CompletionResponse:
    """The reply to a non-streaming completions request from its final outputs
    (any order). With ``echo``, ``prompts`` (see ``prompt_texts``) gives the
    text to put before each choice."""
    n = req.n or 1
    choices = []
    for out in sorted(outputs, key=_index):
        echoed = prompts[_index(out) // n] if req.echo else ""
        meta = out["meta_info"]
        choices.append(
            CompletionChoice(
                index=_index(out),
                text=echoed + out["text"],
                logprobs=_completion_choice_logprobs(meta, req.echo) if req.logprobs is not None else None,
                finish_reason=finish_reason_to_openai(meta["finish_reason"]),
                matched_stop=_matched_stop(meta["finish_reason"]),
            )
        )
    return CompletionResponse(
        id=request_id or new_request_id("cmpl"),
        created=created,
        model=model_name,
        choices=choices,
        usage=usage_info(outputs, n),
    )


def _completion_choice_logprobs(meta: dict, echo: bool) -> CompletionLogprobs:
    tokens, tops = meta["output_token_logprobs"], meta.get("output_top_logprobs")
    if echo:
        tokens = meta["input_token_logprobs"] + tokens
        tops = meta["input_top_logprobs"] + tops if tops is not None else None
    return completion_logprobs(tokens, tops)


def build_chat_response(
    req: ChatCompletionRequest, outputs: list[dict], model_name: str, created: int, *, request_id: str | None = None,
    parsing: ChatParsing | None = None,
) -> ChatCompletionResponse:
    """The reply to a non-streaming chat request from its final outputs (any
    order); ``parsing`` splits each text into reasoning, content and calls."""
    choices = []
    for out in sorted(outputs, key=_index):
        meta = out["meta_info"]
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(meta["output_token_logprobs"], meta.get("output_top_logprobs"))
        message = ChatMessage(content=out["text"])
        if parsing is not None and parsing.active:
            message = _parsed_message(parsing.parse(out["text"]))
        finish = tool_calls_finish(meta["finish_reason"], bool(message.tool_calls))
        choices.append(
            ChatCompletionChoice(
                index=_index(out),
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason_to_openai(finish),
                matched_stop=_matched_stop(finish),
            )
        )
    return ChatCompletionResponse(
        id=request_id or new_request_id("chatcmpl"),
        created=created,
        model=model_name,
        choices=choices,
        usage=usage_info(outputs, req.n or 1),
    )


def _parsed_message(out: ChoiceOutput) -> ChatMessage:
    """A parsed choice's message: empty content and reasoning are null."""
    calls = [ToolCallResponse(id=new_tool_call_id(), function=FunctionCallResponse(name=c.name, arguments=c.arguments))
             for c in out.calls]
    return ChatMessage(content=out.content or None, reasoning_content=out.reasoning or None, tool_calls=calls or None)


def tool_calls_finish(finish_reason: dict | None, made_calls: bool) -> dict | None:
    """A choice that made calls and stopped by itself finishes with
    ``"tool_calls"`` (its stop token no longer the matched stop), as in SGLang;
    one that hit the length limit keeps ``"length"``."""
    if made_calls and finish_reason is not None and finish_reason["type"] == "stop":
        return {"type": "tool_calls"}
    return finish_reason


def new_request_id(prefix: str) -> str:
    """A response id in OpenAI's style: ``cmpl-...``, ``chatcmpl-...``."""
    return f"{prefix}-{uuid.uuid4().hex}"


def new_tool_call_id() -> str:
    """A tool call id in OpenAI's style, ``call_`` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


# -- streaming ----------------------------------------------------------------------------------------


def completion_stream_chunk(
    request_id: str,
    created: int,
    model_name: str,
    index: int,
    text: str,
    *,
    finish_reason: dict | None = None,
    logprobs: CompletionLogprobs | None = None,
) -> CompletionStreamResponse:
    """One completions event: new ``text`` for choice ``index``, and on its
    last event the engine's ``finish_reason``. With ``echo`` the first event
    of each choice should carry the prompt before the new text."""
    choice = CompletionChoice(
        index=index,
        text=text,
        logprobs=logprobs,
        finish_reason=finish_reason_to_openai(finish_reason),
        matched_stop=_matched_stop(finish_reason),
    )
    return CompletionStreamResponse(id=request_id, created=created, model=model_name, choices=[choice])


def chat_stream_chunk(
    request_id: str,
    created: int,
    model_name: str,
    index: int,
    *,
    content: str | None = None,
    role: str | None = None,
    finish_reason: dict | None = None,
    logprobs: ChoiceLogprobs | None = None,
    reasoning_content: str | None = None,
    tool_calls: list[ToolCallDelta] | None = None,
) -> ChatCompletionStreamResponse:
    """One chat event for choice ``index``. OpenAI opens each choice with a
    chunk of ``role="assistant", content=""``; then chunks of new ``content``
    (or ``reasoning_content``, or call pieces: a call's first piece carries
    its id and name); the last one carries the ``finish_reason`` (see
    ``tool_calls_finish``)."""
    choice = ChatCompletionStreamChoice(
        index=index,
        delta=DeltaMessage(role=role, content=content, reasoning_content=reasoning_content,
                           tool_calls=[_delta_tool_call(piece) for piece in tool_calls] if tool_calls else None),
        logprobs=logprobs,
        finish_reason=finish_reason_to_openai(finish_reason),
        matched_stop=_matched_stop(finish_reason),
    )
    return ChatCompletionStreamResponse(id=request_id, created=created, model=model_name, choices=[choice])


def _delta_tool_call(piece: ToolCallDelta) -> DeltaToolCall:
    if piece.name is None:
        return DeltaToolCall(index=piece.index, function=DeltaFunctionCall(arguments=piece.arguments))
    return DeltaToolCall(index=piece.index, id=new_tool_call_id(), type="function",
                         function=DeltaFunctionCall(name=piece.name, arguments=piece.arguments))


def usage_chunk(
    request_id: str, created: int, model_name: str, outputs: list[dict], n: int = 1, *, chat: bool = True
) -> ChatCompletionStreamResponse | CompletionStreamResponse:
    """The last event when ``stream_options.include_usage`` is set: no
    choices, the usage of the final ``outputs`` (one per choice)."""
    cls = ChatCompletionStreamResponse if chat else CompletionStreamResponse
    return cls(id=request_id, created=created, model=model_name, choices=[], usage=usage_info(outputs, n))


def sse_event(payload: BaseModel | dict) -> str:
    """One server-sent event carrying ``payload`` as JSON; end a stream with ``SSE_DONE``."""
    data = payload.model_dump_json() if isinstance(payload, BaseModel) else json.dumps(payload)
    return f"data: {data}\n\n"


# -- errors -------------------------------------------------------------------------------------------


def openai_error(message: str, type: str = "invalid_request_error", param: str | None = None, code: int = 400) -> dict:
    """OpenAI's error body ``{"error": {"message", "type", "param", "code"}}``;
    ``code`` is the HTTP status to send it with."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def validation_error_to_openai(errors: list[dict]) -> dict:
    """A 400 body from pydantic's ``errors()`` (of a ``ValidationError`` or
    FastAPI's ``RequestValidationError``). ``param`` is the first error's
    field, e.g. ``messages[0].content``; the message lists the first few errors."""
    parts = [_describe(err) for err in errors[:_MAX_ERRORS]]
    params = [p for p, _ in parts if p]
    more = f" (and {len(errors) - _MAX_ERRORS} more errors)" if len(errors) > _MAX_ERRORS else ""
    return openai_error("; ".join(msg for _, msg in parts) + more, param=params[0] if params else None)


_GRAMMAR_ERROR = re.compile(r"sampling_params\.(json_schema|regex|ebnf|structural_tag):")
_PROMPT_ERROR = re.compile(r"(?:text|input_ids)(\[\d+\])?:")
_SAMPLING_ERROR = re.compile(r"sampling_params\.(\w+):")
_OPENAI_NAMES = {sglang: openai for openai, sglang in _SAMPLING_NAMES.items()}


def name_request_error(exc: ValueError, req: CompletionRequest | ChatCompletionRequest) -> ValueError:
    """The engine's error renamed after the request's own field. A refused
    grammar (``sampling_params.json_schema: ...``): ``response_format``, SGLang's
    ``json_schema``, ``regex`` or ``ebnf``, or else ``tools`` (forced or strict
    calls). A refused prompt (``text[1]: ...``, ``input_ids: ...``): ``prompt[1]``,
    ``prompt``, or ``messages`` for a chat. A sampling parameter the request
    copies (``sampling_params.stop_regex: ...``, a search that ran out of time):
    its OpenAI name."""
    message = str(exc)
    if _PROMPT_ERROR.match(message):
        field = "messages" if isinstance(req, ChatCompletionRequest) else r"prompt\1"
        return ValueError(_PROMPT_ERROR.sub(f"{field}:", message, count=1))
    sampling = _SAMPLING_ERROR.match(message)
    if sampling and sampling.group(1) in _OPENAI_NAMES:
        return ValueError(f"{_OPENAI_NAMES[sampling.group(1)]}:{message[sampling.end():]}")
    if not _GRAMMAR_ERROR.match(message):
        return exc
    fmt = req.response_format
    own = req.grammar()
    field = "response_format" if fmt is not None and fmt.type != "text" else own[0] if own is not None else "tools"
    return ValueError(_GRAMMAR_ERROR.sub(f"{field}:", message, count=1))


def value_error_to_openai(exc: ValueError) -> dict:
    """A 400 body from a ``ValueError("<field>: <message>")`` raised by the
    engine or a model validator (or a pydantic ``ValidationError``); ``param``
    is the field."""
    if isinstance(exc, ValidationError):
        return validation_error_to_openai(exc.errors(include_url=False))
    message = str(exc)
    match = FIELD_PREFIX.match(message)
    return openai_error(message, param=match.group(1) if match else None)


def _describe(err: dict) -> tuple[str | None, str]:
    loc = [part for part in err.get("loc", ()) if part not in ("body", "query")]  # FastAPI's: where the field was
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    param = error_path(loc) or None
    if param is None:
        match = FIELD_PREFIX.match(msg)
        return (match.group(1) if match else None), msg
    return param, f"{param}: {msg}"
