"""Every message that crosses a process boundary, as dataclasses, and their
msgpack encoding (a type tag plus the fields). Nothing is pickled on a socket.

Flow: TokenizerManager --TokenizedGenerateReqInput/AbortReq/control--> Scheduler
--BatchTokenIDOut/control replies--> DetokenizerManager --BatchStrOut/control
replies--> TokenizerManager.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
from pydantic import ConfigDict, Field, TypeAdapter, ValidationInfo, field_validator, model_validator
from pydantic.dataclasses import dataclass as pydantic_dataclass

from radixserve.sampling.sampling_params import MAX_INT32
from radixserve.validation import no_op_validator, shown

# -- front door (in-process only: never sent) ----------------------------------
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's limit for chat)
MAX_RID_CHARS = 512

_StartLen = Annotated[int, Field(ge=-1, le=MAX_INT32)]
_TopNum = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
_Port = Annotated[int, Field(ge=1, le=65535)]
_Room = Annotated[int, Field(ge=0, lt=2**63)]  # a 63-bit room, as SGLang's router picks

# SGLang's GenerateReqInput fields (v0.5) that this engine does not implement,
# with the values that ask for nothing: those are accepted and ignored, any
# other value is refused by name. A list of such values counts as one (a
# batch's per-prompt `lora_path: [null, null]`). (docs/api.md)
UNSUPPORTED_FIELDS: dict[str, tuple] = {
    "input_embeds": (None,), "image_data": (None, []), "video_data": (None, []), "audio_data": (None, []),
    "mm_hashes": (None,), "mm_content_hashes": (None,), "use_audio_in_video": (False,), "video_config": (None,),
    "watermark": (None,), "token_ids_logprob": (None, []), "return_sampling_mask": (None, False),
    "sampling_logprobs_mode": (None,), "return_flat_raw_top_logprobs": (False,),
    "return_flat_raw_output_top_logprobs": (False,), "return_flat_raw_top_logprobs_b64": (False,),
    "return_hidden_states": (False,), "return_routed_experts": (False,), "routed_experts_start_len": (0,),
    "return_indexer_topk": (False,), "modalities": (None, []), "session_params": (None,), "lora_path": (None,),
    "lora_id": (None,), "custom_logit_processor": (None,), "positional_embed_overrides": (None,),
    "bootstrap_pair_key": (None,),
    "decode_tp_size": (None,), "routed_dp_rank": (None, 0), "data_parallel_rank": (None, 0),
    "disagg_prefill_dp_rank": (None,), "http_worker_ipc": (None,), "background": (False,),
    "require_reasoning": (False,), "max_thinking_tokens": (None,), "extra_key": (None, ""), "return_bytes": (False,),
    "return_entropy": (False,), "return_prompt_token_ids": (False,), "need_wait_for_mm_inputs": (None, False),
    "num_items_assigned": (None,), "encoder_urls": (None, []), "max_dynamic_patch": (None,),
    "min_dynamic_patch": (None,), "image_max_dynamic_patch": (None,), "video_max_dynamic_patch": (None,),
    "images_config": (None,), "mm_processor_kwargs": (None,), "multi_item_delimiter_indices": (None,),
    "token_indices_to_pool": (None,), "cache_salt": (None, ""),
}


@pydantic_dataclass(config=ConfigDict(strict=True, extra="forbid", allow_inf_nan=False))
class GenerateReqInput:
    """A /generate request as SGLang names it (v0.5): one prompt or a batch.

    Built from the request body, it checks every field's type and range and
    that the fields agree (one of ``text`` / ``input_ids``; per-prompt lists
    as long as the batch), raising ``pydantic.ValidationError`` naming the
    field. What needs the model (token ids within the vocabulary, prompt
    lengths, the sampling params themselves) is checked by the
    TokenizerManager.

    ``return_logprob``, ``logprob_start_len`` and ``top_logprobs_num`` take
    one value or one per prompt; null means the default. Hints that cannot
    change the output (``session_id``, ``routing_key``, ``priority``, ...) are
    accepted and ignored, as SGLang ignores ``priority`` without priority
    scheduling; the fields of ``UNSUPPORTED_FIELDS`` only at their no-op value.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: _StartLen | list[_StartLen] | None = None
    top_logprobs_num: _TopNum | list[_TopNum] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    # hints for routers, tracing and bookkeeping: they never change the output
    session_id: str | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    priority: int | None = None
    no_logs: bool = False  # this engine never logs prompts or outputs
    custom_labels: dict[str, str] | None = None
    external_trace_header: dict | None = None
    received_time: float | None = None
    kv_hints: dict | list | None = None
    model: str | None = None  # sglang-router adds the model it routed to; SGLang ignores it too
    # prefill/decode disaggregation (docs/disaggregation.md): where the prompt's KV comes from or goes;
    # one value, or one per prompt; the router sends the same room to a prefill and a decode server
    bootstrap_host: str | list[str] | None = None
    bootstrap_port: _Port | list[_Port] | None = None
    bootstrap_room: _Room | list[_Room] | None = None
    # not implemented (see UNSUPPORTED_FIELDS)
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = False
    video_config: Any = None
    watermark: Any = None
    token_ids_logprob: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_output_top_logprobs: Any = False
    return_flat_raw_top_logprobs_b64: Any = False
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_indexer_topk: Any = False
    modalities: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    http_worker_ipc: Any = None
    background: Any = False
    require_reasoning: Any = False
    max_thinking_tokens: Any = None
    extra_key: Any = None
    return_bytes: Any = False
    return_entropy: Any = False
    return_prompt_token_ids: Any = False
    need_wait_for_mm_inputs: Any = None
    num_items_assigned: Any = None
    encoder_urls: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    images_config: Any = None
    mm_processor_kwargs: Any = None
    multi_item_delimiter_indices: Any = None
    token_indices_to_pool: Any = None
    cache_salt: Any = None

    _only_no_op = no_op_validator(UNSUPPORTED_FIELDS)

    # Shapes are checked by hand, in one pass with one message, before pydantic
    # would report each bad element of a million-token list on its own.
    @field_validator("text", "sampling_params", mode="before")
    @classmethod
    def _one_or_a_list(cls, v: Any, info: ValidationInfo) -> Any:
        kind, what = _ONE_OR_A_LIST[info.field_name]
        if v is None or isinstance(v, kind) or _non_empty_list_of(v, kind):
            return v
        raise ValueError(f"must be {what} or a non-empty list of them")

    @field_validator("input_ids", mode="before")
    @classmethod
    def _input_ids(cls, v: Any) -> Any:
        if v is None or _non_empty_list_of(v, int):
            return v
        if _non_empty_list_of(v, list) and all(_non_empty_list_of(ids, int) for ids in v):
            return v
        raise ValueError("must be a non-empty list of token ids or a non-empty list of such lists")

    @field_validator("rid", mode="before")
    @classmethod
    def _rid(cls, v: Any) -> Any:
        rids = [v] if isinstance(v, str) else v
        if v is not None and not (_non_empty_list_of(rids, str) and all(0 < len(r) <= MAX_RID_CHARS for r in rids)):
            raise ValueError(f"must be a request id (a string of 1 to {MAX_RID_CHARS} characters) or a list of them")
        if isinstance(v, list) and len(set(v)) != len(v):
            raise ValueError("request ids in a batch must be distinct")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "GenerateReqInput":
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("text: give exactly one of text and input_ids")
        n = self.batch_size
        for name in ("sampling_params", "rid", *_PER_PROMPT):
            value = getattr(self, name)
            if isinstance(value, list) and len(value) != n:
                raise ValueError(f"{name}: {len(value)} given for {n} prompts")
            if self.is_single and isinstance(value, list):
                raise ValueError(f"{name}: a list is for a batch of prompts; this request has one")
        return self

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return bool(self.input_ids) and isinstance(self.input_ids[0], int)

    @property
    def batch_size(self) -> int:
        """How many prompts the request holds."""
        if self.is_single:
            return 1
        return len(self.text if self.text is not None else self.input_ids)

    def per_prompt(self, name: str) -> list:
        """A per-prompt field as one value per prompt, defaults for nulls."""
        value = getattr(self, name)
        values = value if isinstance(value, list) else [value] * self.batch_size
        return [_PER_PROMPT[name] if v is None else v for v in values]


_PER_PROMPT = {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,  # and their defaults
               "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None}
_ONE_OR_A_LIST = {"text": (str, "a string"), "sampling_params": (dict, "an object")}


def _non_empty_list_of(v: Any, kind: type) -> bool:
    """A non-empty list whose items are all of ``kind`` (bools are not ints)."""
    if not isinstance(v, list) or not v:
        return False
    if kind is int:
        return all(type(x) is int for x in v)
    return all(isinstance(x, kind) for x in v)


# -- tokenizer manager -> scheduler ------------------------------------------------
@dataclass
class TokenizedGenerateReqInput:
    rid: str
    input_ids: list[int]
    sampling_params: dict
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    stream: bool = False
    # disaggregation: the prefill server's bootstrap address (host:port) and the room pairing the two halves
    bootstrap_addr: str | None = None
    bootstrap_room: int | None = None


@dataclass
class AbortReq:
    rid: str


@dataclass
class FlushCacheReq:
    pass


@dataclass
class FlushCacheReqOutput:
    success: bool


@dataclass
class CloseReq:
    """The engine is stopping: close the scheduler (the cache tiers' writes
    land, KV events go out) and exit. The server's TokenizerManager sends it
    to each replica's rank 0, which passes it on to its other ranks with the
    step's messages; an offline TP engine's rank 0 broadcasts it."""


@dataclass
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    state: dict


@dataclass
class ProfileReq:
    """Start (with the options of ``/start_profile``) or stop the profiler on
    every rank; the reply carries ``req_id`` (a start with ``num_steps`` is
    answered when its profile ends, possibly after later requests)."""

    req_id: int
    action: str  # "start" or "stop"
    options: dict


@dataclass
class ProfileReqOutput:
    req_id: int
    success: bool
    message: str


@dataclass
class KVLimitReq:
    """Read, or set (``apply``), the elastic KV pool's run-time limit
    (``/get_kv_limit``, ``/set_kv_limit``, ``radixserve kvctl``);
    ``limit_bytes`` None is the pool's whole size."""

    apply: bool
    limit_bytes: int | None = None


@dataclass
class KVLimitReqOutput:
    success: bool
    message: str
    state: dict


@dataclass
class GiveKVReq:
    """Rank 0 saw other servers on its device ask for memory: every rank
    evicts cached KV and unmaps down to ``epages`` elastic pages (the
    leader adds it to the messages it broadcasts, so the ranks stay alike)."""

    epages: int


@dataclass
class SchedulerStats:
    """The scheduler's load and cache figures, sent every so often while it
    works and when it goes idle; ``/metrics`` and ``/get_load`` serve the latest."""

    state: dict


# -- scheduler -> detokenizer ---------------------------------------------------------
@dataclass
class BatchTokenIDOut:
    """New output tokens of some requests since the last message. ``meta[i]``
    holds prompt/completion/cached token counts, finish reason (None while
    running), new logprob entries, and the decode options of request i."""

    rids: list[str]
    new_ids: list[list[int]]
    meta: list[dict]


# -- detokenizer -> tokenizer manager -----------------------------------------------------
@dataclass
class BatchStrOut:
    """New text (``deltas[i]``, safe to append: whole UTF-8 characters, and
    never a prefix of a stop string that may still be trimmed)."""

    rids: list[str]
    deltas: list[str]
    new_ids: list[list[int]]
    meta: list[dict]


_TYPES = {
    cls.__name__: cls
    for cls in (
        TokenizedGenerateReqInput, AbortReq, FlushCacheReq, FlushCacheReqOutput, CloseReq, GetInternalStateReq,
        GetInternalStateReqOutput, ProfileReq, ProfileReqOutput, KVLimitReq, KVLimitReqOutput, GiveKVReq, SchedulerStats,
        BatchTokenIDOut, BatchStrOut,
    )
}


def encode(obj: Any) -> bytes:
    """msgpack bytes of a message dataclass (tagged with its type name)."""
    name = type(obj).__name__
    if name not in _TYPES:
        raise TypeError(f"{name} is not a message type")
    # A shallow dict: msgpack walks the nested lists and dicts itself, and
    # dataclasses.asdict's deep copy cost milliseconds a step at batch 256.
    fields = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return msgpack.packb([name, fields], use_bin_type=True)


_ADAPTERS = {name: TypeAdapter(cls) for name, cls in _TYPES.items()}


def decode(data: bytes) -> Any:
    """The message dataclass encoded in ``data``, its fields type-checked.
    Raises ``ValueError`` for anything that is not a well-formed message."""
    try:
        name, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types, and unpacking a non-pair too
        raise ValueError(f"not a message: {type(exc).__name__}") from None
    if not isinstance(name, str) or name not in _TYPES or not isinstance(fields, dict):
        raise ValueError(f"unknown message type {shown(name)}")
    return _ADAPTERS[name].validate_python(fields)  # pydantic's ValidationError is a ValueError


def pipeline_sockets(ctx, recv_addr: str, send_addr: str):
    """A stage of the process pipeline: PULL bound at ``recv_addr`` (its
    inbox) and PUSH connected to the next stage's inbox at ``send_addr``.
    Works with ``zmq.Context`` and ``zmq.asyncio.Context``."""
    import zmq

    recv = ctx.socket(zmq.PULL)
    recv.bind(recv_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(send_addr)
    return recv, send
