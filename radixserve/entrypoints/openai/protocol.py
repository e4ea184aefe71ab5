"""Pydantic models of the OpenAI HTTP API: requests (validated once, here) and
responses (shaped so that the official ``openai`` client parses them).

Requests ignore unknown fields, as OpenAI clients send some we have no use for
(``user``, ``metadata``, ...), but reject fields we know and do not support yet
(``functions``, ``audio``, ...) so that nobody silently gets unconstrained
output. Every validation error names its field: FastAPI reports it in ``loc``
and ``adapters.validation_error_to_openai`` turns it into OpenAI's ``param``.
Cross-field errors come from model validators, which have no ``loc``; their
messages start with ``"<field>: "`` instead.
"""

from __future__ import annotations

import json
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_serializer, model_validator

from radixserve.entrypoints.openai.tool_protocol import (
    ChatTool,
    DeltaToolCall,
    ToolCallParam,
    ToolCallResponse,
    ToolChoice,
    check_tool_choice_shape,
    check_tool_request,
)
from radixserve.managers.io_struct import MAX_RID_CHARS, MAX_TOP_LOGPROBS
from radixserve.sampling.sampling_params import MAX_N, check_stop_regex
from radixserve.validation import NoOpOnly

LOGIT_BIAS_LIMIT = 100.0  # OpenAI's bound on one bias
# reasoning_effort's levels, as SGLang takes them (OpenAI's, and SGLang's "max"), or a fraction of the most
ReasoningEffort = (Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
                   | Annotated[float, Field(ge=0, le=0.99)])

# chat_template_kwargs may not set what the server itself passes to the template
_TEMPLATE_RESERVED = {"conversation", "messages", "tokenize", "add_generation_prompt", "continue_final_message",
                      "return_dict", "return_tensors", "chat_template", "tools"}


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a final chunk with the usage."""

    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="ignore", strict=True)
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """``response_format``: ``text``; ``json_object`` (any JSON object);
    ``json_schema`` (one that validates against ``json_schema.schema``);
    ``structural_tag`` (SGLang's: ``structures`` and ``triggers``)."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema: required when type is json_schema")
        return self


class _GenerationRequest(BaseModel):
    """Sampling fields shared by completions and chat; ``None`` means the engine's default."""

    # strict: a bool must be a bool and an int an int ("false" never streams); ints are floats
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, strict=True)

    model: str | None = None
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=MAX_N)
    stop: list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions with SGLang's meaning.
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    no_stop_trim: bool | None = None
    stop_regex: str | list[str] | None = None
    rid: str | None = Field(None, min_length=1, max_length=MAX_RID_CHARS)
    # prefill/decode disaggregation (docs/disaggregation.md), as SGLang's router adds them
    bootstrap_host: str | None = None
    bootstrap_port: int | None = Field(None, ge=1, le=65535)
    bootstrap_room: int | None = Field(None, ge=0, lt=2**63)
    # --enable-lora: the LoRA adapter by name (so does a model "BASE:ADAPTER", docs/lora.md)
    lora_path: str | None = None
    # hints that never change the output
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    session_id: str | None = None
    priority: int | None = None
    custom_labels: dict[str, str] | None = None
    # structured output: OpenAI's response_format, or SGLang's grammar fields (at most one in all)
    response_format: ResponseFormat | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # not implemented: accepted only at their no-op values (validation.NO_OP_VALUES)
    custom_params: NoOpOnly = None
    custom_logit_processor: NoOpOnly = None
    watermark: NoOpOnly = None
    session_params: NoOpOnly = None
    extra_key: NoOpOnly = None
    cache_salt: NoOpOnly = None
    images_config: NoOpOnly = None
    mm_processor_kwargs: NoOpOnly = None
    return_hidden_states: NoOpOnly = False
    return_routed_experts: NoOpOnly = False
    routed_experts_start_len: NoOpOnly = 0
    return_cached_tokens_details: NoOpOnly = False
    return_spec_tokens_details: NoOpOnly = False
    return_token_ids: NoOpOnly = False
    routed_dp_rank: NoOpOnly = None
    data_parallel_rank: NoOpOnly = None
    disagg_prefill_dp_rank: NoOpOnly = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = [v]
        if v is not None and not (isinstance(v, list) and all(isinstance(s, str) and s for s in v)):
            raise ValueError("must be a non-empty string or a list of them")
        return v or None

    @field_validator("top_k")
    @classmethod
    def _top_k_range(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("must be -1 (no limit) or >= 1")
        return v

    _stop_regex = field_validator("stop_regex")(classmethod(lambda cls, v: check_stop_regex(v)))

    @field_validator("stop_token_ids")
    @classmethod
    def _token_ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {key!r}")
            if abs(bias) > LOGIT_BIAS_LIMIT:
                raise ValueError(f"biases must be in [-100, 100], got {bias} for token {key}")
        return v

    def grammar(self) -> tuple[str, str] | None:
        """The (sampling-param name, text) of the structured output asked for, if any."""
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            return "json_schema", '{"type": "object"}'
        if fmt is not None and fmt.type == "json_schema":
            return "json_schema", json.dumps(fmt.json_schema.schema_)
        if fmt is not None and fmt.type == "structural_tag":
            return "structural_tag", json.dumps(fmt.model_dump(exclude={"json_schema"}))
        given = [(name, getattr(self, name)) for name in ("json_schema", "regex", "ebnf") if getattr(self, name)]
        return given[0] if given else None

    def _check_shared(self, max_tokens: int | None) -> None:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        asked = [name for name in ("json_schema", "regex", "ebnf") if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            asked.insert(0, "response_format")
        if len(asked) > 1:
            raise ValueError(f"{asked[1]}: only one of response_format, json_schema, regex and ebnf may be set")
        if max_tokens is not None and self.min_tokens is not None and self.min_tokens > max_tokens:
            raise ValueError(f"min_tokens: must be <= the maximum number of tokens ({max_tokens})")


class CompletionRequest(_GenerationRequest):
    """``POST /v1/completions``. ``prompt`` is text, a list of texts, token ids,
    or a list of token-id lists. ``logprobs`` (legacy) is the number of
    alternatives per position; ``max_tokens=0`` is allowed with ``echo`` (scoring
    a prompt without generating)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    best_of: int | None = None
    suffix: NoOpOnly = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, v: Any) -> Any:
        if isinstance(v, str) or _is_token_list(v) or _is_list_of(v, str):
            return v
        if _is_list_of(v, list) and all(_is_token_list(p) for p in v):
            return v
        raise ValueError("must be a string, a non-empty list of strings, or non-empty lists of token ids >= 0")

    @model_validator(mode="after")
    def _cross_checks(self) -> CompletionRequest:
        self._check_shared(self.max_tokens)
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: must be >= 1 (0 is allowed only with echo)")
        if self.best_of is not None and self.best_of != (self.n or 1):
            raise ValueError("best_of: only best_of == n is supported")
        if self.echo and self.logprobs is not None and self.bootstrap_room is not None:
            # Both halves get this body: refused on both, the prefill half does not wait for its decode half.
            raise ValueError("logprobs: not with echo in a disaggregated request (bootstrap_room): the decode "
                             "server has no prompt logprobs, and SGLang's router merges the prefill server's only "
                             "into /generate's meta_info.input_token_logprobs (ask /generate with logprob_start_len)")
        return self


class TextContentPart(BaseModel):
    """One ``{"type": "text", "text": ...}`` part of a message's content."""

    model_config = ConfigDict(strict=True)

    type: Literal["text"]
    text: str


class ChatMessageParam(BaseModel):
    """One message of a chat request. ``developer`` is OpenAI's newer name for
    ``system``; content may be omitted only by an assistant (tool calls)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, v: Any, info: ValidationInfo) -> Any:
        if v is None and info.data.get("role", "assistant") != "assistant":
            raise ValueError(f"required for role '{info.data['role']}'")
        if v is None or isinstance(v, str):
            return v
        if not isinstance(v, list):
            raise ValueError("must be a string or a list of content parts")
        for i, part in enumerate(v):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"part {i}: only text content parts are supported, got type {kind!r}")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i}: a text part needs a string 'text'")
        return v

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


class ChatCompletionRequest(_GenerationRequest):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over the
    deprecated ``max_tokens``; with neither, the engine's limit applies.
    ``top_logprobs`` needs ``logprobs=true``."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None  # for the chat template (``template_kwargs``)
    # with --reasoning-parser: reasoning_content apart (streamed, or sent once it ends)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: ToolChoice | None = None  # "auto" with tools, "none" without
    parallel_tool_calls: bool = True  # false: at most one call
    return_flat_raw_top_logprobs_b64: bool = True  # meaningful with flat raw logprobs only
    # not implemented: accepted only at their no-op values (validation.NO_OP_VALUES)
    functions: NoOpOnly = None
    function_call: NoOpOnly = None
    audio: NoOpOnly = None
    prediction: NoOpOnly = None
    web_search_options: NoOpOnly = None
    modalities: NoOpOnly = None
    verbosity: NoOpOnly = None
    thinking: NoOpOnly = None
    task: NoOpOnly = None
    input_ids: NoOpOnly = None
    return_prompt_token_ids: NoOpOnly = False
    return_meta_info: NoOpOnly = False
    return_input_ids_in_sglext: NoOpOnly = False
    return_output_ids_in_sglext: NoOpOnly = False
    return_sampling_mask: NoOpOnly = False
    sampling_logprobs_mode: NoOpOnly = None
    return_flat_raw_output_top_logprobs: NoOpOnly = False
    max_dynamic_patch: NoOpOnly = None
    min_dynamic_patch: NoOpOnly = None
    use_audio_in_video: NoOpOnly = False
    video_config: NoOpOnly = None

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _tool_choice_shape(cls, v: Any) -> Any:
        return check_tool_choice_shape(v)

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_kwargs(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        taken = sorted(set(v or {}) & _TEMPLATE_RESERVED)
        if taken:
            raise ValueError(f"'{taken[0]}' is set by the server, not by chat_template_kwargs")
        return v

    @property
    def max_new_tokens(self) -> int | None:
        """The output limit asked for, if any."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def template_kwargs(self) -> dict[str, Any]:
        """What the chat template gets besides the messages and tools: as in
        SGLang, ``reasoning_effort`` when given (a template that does not
        read it ignores it), with ``thinking`` and ``enable_thinking``
        defaulting to whether it is not ``"none"``; ``chat_template_kwargs`` win."""
        kwargs: dict[str, Any] = {}
        if self.reasoning_effort is not None:
            thinking = self.reasoning_effort != "none"
            kwargs = {"reasoning_effort": self.reasoning_effort, "thinking": thinking, "enable_thinking": thinking}
        return {**kwargs, **(self.chat_template_kwargs or {})}

    @model_validator(mode="after")
    def _cross_checks(self) -> ChatCompletionRequest:
        self._check_shared(self.max_new_tokens)
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: requires logprobs to be true")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise ValueError("continue_final_message: the last message must be the assistant's")
        check_tool_request(self)
        return self


def _is_list_of(v: Any, kind: type) -> bool:
    return isinstance(v, list) and len(v) > 0 and all(isinstance(x, kind) for x in v)


def _is_token_list(v: Any) -> bool:
    return _is_list_of(v, int) and all(type(x) is int and x >= 0 for x in v)


# -- responses ---------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    """How many prompt tokens were served from the prefix cache."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts of one response (all its choices)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs, one entry per token. The first prompt token
    (with ``echo``) has no logprob: ``None`` there, as OpenAI sends it."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One choice; ``matched_stop`` (SGLang's extension) is the stop string or
    token id that ended it."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(BaseModel):
    """Reply of a non-streaming ``/v1/completions``."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    """One server-sent event of a streaming ``/v1/completions``: OpenAI uses the
    same shape as the full response, with ``usage`` only on the last event."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    """An alternative token at one position (chat format)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionTokenLogprob(TopLogprob):
    """A sampled token with its alternatives (chat format)."""

    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    """Chat logprobs of one choice."""

    content: list[ChatCompletionTokenLogprob] | None = None


class ChatMessage(BaseModel):
    """The assistant message of a chat choice: ``reasoning_content`` with a
    reasoning parser, ``tool_calls`` (left out when there are none) with tools."""

    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallResponse] | None = None

    @model_serializer(mode="wrap")
    def _calls_only_when_made(self, handler):
        data = handler(self)
        if self.tool_calls is None:
            data.pop("tool_calls", None)
        return data


class ChatCompletionChoice(BaseModel):
    """One choice of a chat reply."""

    index: int
    message: ChatMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    """Reply of a non-streaming ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """What one chat chunk adds to a choice: the role (first chunk), text,
    and with the output parsers reasoning and tool-call pieces (left out
    when there are none)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _parsed_fields_when_set(self, handler):
        data = handler(self)
        for key in ("reasoning_content", "tool_calls"):
            if data.get(key) is None:
                data.pop(key, None)
        return data


class ChatCompletionStreamChoice(BaseModel):
    """One choice's part of a chat chunk."""

    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    """One server-sent event of a streaming ``/v1/chat/completions``."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    """One entry of ``GET /v1/models``; ``max_model_len`` is the context length."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "radixserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    """Reply of ``GET /v1/models``."""

    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class ErrorDetail(BaseModel):
    """OpenAI's error body; ``code`` is the HTTP status."""

    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: int = 400


class ErrorResponse(BaseModel):
    """``{"error": {...}}``, the shape OpenAI clients raise ``APIError`` from."""

    error: ErrorDetail
