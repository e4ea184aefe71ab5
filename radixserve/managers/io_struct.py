"""Every message that crosses a process boundary, as dataclasses, and their
msgpack encoding (a type tag plus the fields). Nothing is pickled on a socket.

Flow: TokenizerManager --TokenizedGenerateReqInput/AbortReq/control--> Scheduler
--BatchTokenIDOut/control replies--> DetokenizerManager --BatchStrOut/control
replies--> TokenizerManager.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgpack



# -- front door (in-process only: never sent) ----------------------------------
@dataclass
class GenerateReqInput:
    """A /generate request as SGLang names it: one prompt or a batch."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict | list[dict] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False

    @property
    def is_single(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, str)
        return bool(self.input_ids) and isinstance(self.input_ids[0], int)


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
class GetInternalStateReq:
    pass


@dataclass
class GetInternalStateReqOutput:
    state: dict


@dataclass
class HealthCheckOutput:
    """Scheduler heartbeat, forwarded to the tokenizer manager."""

    forward_ct: int


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
        TokenizedGenerateReqInput, AbortReq, FlushCacheReq, FlushCacheReqOutput, GetInternalStateReq,
        GetInternalStateReqOutput, HealthCheckOutput, BatchTokenIDOut, BatchStrOut,
    )
}


def encode(obj: Any) -> bytes:
    """msgpack bytes of a message dataclass (tagged with its type name)."""
    name = type(obj).__name__
    if name not in _TYPES:
        raise TypeError(f"{name} is not a message type")
    return msgpack.packb([name, dataclasses.asdict(obj)], use_bin_type=True)


def decode(data: bytes) -> Any:
    name, fields = msgpack.unpackb(data, raw=False, strict_map_key=False)
    if name not in _TYPES:
        raise ValueError(f"unknown message type {name!r}")
    return _TYPES[name](**fields)


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
