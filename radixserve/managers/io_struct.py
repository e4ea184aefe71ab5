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
from radixserve.validation import NoOpOnly, shown

# -- front door (in-process only: never sent) ----------------------------------
MAX_TOP_LOGPROBS = 20  # alternatives per position (OpenAI's limit for chat)
MAX_TOKEN_IDS_LOGPROB = 1024  # token_ids_logprob's ids per prompt: every scored position returns each one's logprob
MAX_RID_CHARS = 512

_StartLen = Annotated[int, Field(ge=-1, le=MAX_INT32)]
_TopNum = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
_Port = Annotated[int, Field(ge=1, le=65535)]
_Room = Annotated[int, Field(ge=0, lt=2**63)]  # a 63-bit room, as SGLang's router picks


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
    one value or one per prompt; null means the default. ``token_ids_logprob``
    (with ``return_logprob``: the logprobs of these ids at every position
    scored) is one list of ids, or for a batch one per prompt. Hints that cannot
    change the output (``session_id``, ``routing_key``, ``priority``, ...) are
    accepted and ignored, as SGLang ignores ``priority`` without priority
    scheduling; the fields it does not implement only at their no-op value.
    """

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: _StartLen | list[_StartLen] | None = None
    top_logprobs_num: _TopNum | list[_TopNum] | None = None
    token_ids_logprob: list[int] | list[list[int]] | None = None
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
    # --enable-lora (docs/lora.md): the LoRA adapter by name, one for every prompt or one per prompt (null: the
    # base model); the TokenizerManager checks the names
    lora_path: str | list[str | None] | None = None
    # not implemented: accepted only at their no-op values (validation.NO_OP_VALUES)
    input_embeds: NoOpOnly = None
    image_data: NoOpOnly = None
    video_data: NoOpOnly = None
    audio_data: NoOpOnly = None
    mm_hashes: NoOpOnly = None
    mm_content_hashes: NoOpOnly = None
    use_audio_in_video: NoOpOnly = False
    video_config: NoOpOnly = None
    watermark: NoOpOnly = None
    return_sampling_mask: NoOpOnly = None
    sampling_logprobs_mode: NoOpOnly = None
    return_flat_raw_top_logprobs: NoOpOnly = False
    return_flat_raw_output_top_logprobs: NoOpOnly = False
    return_flat_raw_top_logprobs_b64: NoOpOnly = False
    return_hidden_states: NoOpOnly = False
    return_routed_experts: NoOpOnly = False
    routed_experts_start_len: NoOpOnly = 0
    return_indexer_topk: NoOpOnly = False
    modalities: NoOpOnly = None
    session_params: NoOpOnly = None
    lora_id: NoOpOnly = None
    custom_logit_processor: NoOpOnly = None
    positional_embed_overrides: NoOpOnly = None
    bootstrap_pair_key: NoOpOnly = None
    decode_tp_size: NoOpOnly = None
    routed_dp_rank: NoOpOnly = None
    data_parallel_rank: NoOpOnly = None
    disagg_prefill_dp_rank: NoOpOnly = None
    http_worker_ipc: NoOpOnly = None
    background: NoOpOnly = False
    require_reasoning: NoOpOnly = False
    max_thinking_tokens: NoOpOnly = None
    extra_key: NoOpOnly = None
    return_bytes: NoOpOnly = False
    return_entropy: NoOpOnly = False
    return_prompt_token_ids: NoOpOnly = False
    need_wait_for_mm_inputs: NoOpOnly = None
    num_items_assigned: NoOpOnly = None
    encoder_urls: NoOpOnly = None
    max_dynamic_patch: NoOpOnly = None
    min_dynamic_patch: NoOpOnly = None
    image_max_dynamic_patch: NoOpOnly = None
    video_max_dynamic_patch: NoOpOnly = None
    images_config: NoOpOnly = None
    mm_processor_kwargs: NoOpOnly = None
    multi_item_delimiter_indices: NoOpOnly = None
    token_indices_to_pool: NoOpOnly = None
    cache_salt: NoOpOnly = None

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

    @field_validator("token_ids_logprob", mode="before")
    @classmethod
    def _token_ids(cls, v: Any) -> Any:
        lists = [v] if v is None or _is_id_list(v) else v if _non_empty_list_of(v, list) else None
        if lists is None or not all(ids is None or _is_id_list(ids) for ids in lists):
            raise ValueError("must be a list of token ids, or for a batch one such list per prompt")
        if any(ids is not None and len(ids) > MAX_TOKEN_IDS_LOGPROB for ids in lists):
            raise ValueError(f"at most {MAX_TOKEN_IDS_LOGPROB} token ids per prompt")
        return v

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
        for name in ("sampling_params", "rid", *_PER_PROMPT, "token_ids_logprob"):
            value = getattr(self, name)
            if name == "token_ids_logprob" and (value is None or _is_id_list(value)):
                continue  # one list of ids, for every prompt
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
        if name == "token_ids_logprob":  # a list of ids is one value
            return [value] * self.batch_size if value is None or _is_id_list(value) else value
        values = value if isinstance(value, list) else [value] * self.batch_size
        return [_PER_PROMPT[name] if v is None else v for v in values]


_PER_PROMPT = {"return_logprob": False, "logprob_start_len": -1, "top_logprobs_num": 0,  # and their defaults
               "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "lora_path": None}
_ONE_OR_A_LIST = {"text": (str, "a string"), "sampling_params": (dict, "an object")}


def _is_id_list(v: Any) -> bool:
    """A list of token ids, maybe empty (bools are not ids)."""
    return isinstance(v, list) and all(type(x) is int for x in v)


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
    token_ids_logprob: list[int] | None = None
    lora_path: str | None = None  # --enable-lora: the adapter's name (None: the base model)


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
class LoadLoRAAdapterReqInput:
    """Read the PEFT adapter at ``lora_path`` as ``lora_name`` on every rank
    (``/load_lora_adapter``, docs/lora.md). SGLang's body also has ``pinned``,
    accepted at the edge and not sent (pinning is not built)."""

    lora_name: str
    lora_path: str


@dataclass
class UnloadLoRAAdapterReqInput:
    """Unload adapter ``lora_name`` on every rank (``/unload_lora_adapter``);
    its running requests finish first (docs/lora.md)."""

    lora_name: str


@dataclass
class LoRAUpdateOutput:
    """The answer to a load or an unload: SGLang's fields, ``loaded_adapters`` name -> folder."""

    success: bool
    error_message: str
    loaded_adapters: dict[str, str]


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


# SGLang's GPU_MEMORY_TYPE_KV_CACHE and GPU_MEMORY_TYPE_WEIGHTS, in the order they are released
MEMORY_TAGS = ("kv_cache", "weights")


@dataclass
class ReleaseMemoryOccupationReqInput:
    """Give back the device memory of ``tags`` (``MEMORY_TAGS``; None: all)
    on every rank (``/release_memory_occupation``, docs/elastic_kv.md)."""

    tags: list[str] | None = None


@dataclass
class ReleaseMemoryOccupationReqOutput:
    success: bool
    message: str
    state: dict  # Scheduler.memory_occupation()


@dataclass
class ResumeMemoryOccupationReqInput:
    """Take the memory of ``tags`` (None: all) back on every rank (``/resume_memory_occupation``)."""

    tags: list[str] | None = None


@dataclass
class ResumeMemoryOccupationReqOutput:
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
        ReleaseMemoryOccupationReqInput, ReleaseMemoryOccupationReqOutput, ResumeMemoryOccupationReqInput,
        ResumeMemoryOccupationReqOutput, LoadLoRAAdapterReqInput, UnloadLoRAAdapterReqInput, LoRAUpdateOutput,
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
