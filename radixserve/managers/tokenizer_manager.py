"""The TokenizerManager (main process): validates and tokenizes requests,
sends them to the scheduler, and turns the detokenizer's text deltas into
per-request results and streams. Aborts requests whose client went away."""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import zmq
import zmq.asyncio

from radixserve.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    FlushCacheReq,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    TokenizedGenerateReqInput,
    decode,
    encode,
    pipeline_sockets,
)
from radixserve.managers.metrics import ServerMetrics
from radixserve.sampling.sampling_params import SamplingParams

DISCONNECT_POLL_S = 0.5


@dataclass
class ReqState:
    """One sub-request's accumulated output."""

    rid: str
    index: int
    queue: asyncio.Queue
    created: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    meta: dict = field(default_factory=dict)
    finished: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    logprobs: dict = field(default_factory=lambda: {
        "input_token_logprobs": [], "input_top_logprobs": [], "output_token_logprobs": [], "output_top_logprobs": []})


class TokenizerManager:
    """The front of the engine in the HTTP process (see module docstring)."""

    def __init__(self, tokenizer, model_info: dict, served_model_name: str, send_addr: str, recv_addr: str):
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.context_len: int = model_info["context_len"]
        self.vocab_size: int = model_info["vocab_size"]
        self.served_model_name = served_model_name
        self.ctx = zmq.asyncio.Context(2)
        self.recv, self.send = pipeline_sockets(self.ctx, recv_addr, send_addr)
        self.states: dict[str, ReqState] = {}
        self.control: dict[type, asyncio.Future] = {}
        self._control_lock: asyncio.Lock | None = None
        self.metrics = ServerMetrics()
        self._loop_task: asyncio.Task | None = None

    def start(self) -> None:
        """Start receiving (call from inside the running event loop)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())

    # -- requests ------------------------------------------------------------------
    def _tokenize(self, obj: GenerateReqInput) -> list[list[int]]:
        if (obj.text is None) == (obj.input_ids is None):
            raise ValueError("text: give exactly one of text and input_ids")
        if obj.text is not None:
            if not isinstance(obj.text, (str, list)):
                raise ValueError("text: must be a string or a list of strings")
            texts = [obj.text] if isinstance(obj.text, str) else list(obj.text)
            if self.tokenizer is None:
                raise ValueError("text: this model has no tokenizer; send input_ids")
            if not all(isinstance(t, str) for t in texts):
                raise ValueError("text: must be a string or a list of strings")
            return [self.tokenizer.encode(t) for t in texts]
        ids = obj.input_ids
        if not isinstance(ids, list):
            raise ValueError("input_ids: must be a list of token ids or a list of such lists")
        batch = [ids] if obj.is_single else list(ids)
        if not batch:
            raise ValueError("input_ids: the prompt is empty")
        if not all(isinstance(x, list) and all(isinstance(t, int) for t in x) for x in batch):
            raise ValueError("input_ids: must be a list of token ids or a list of such lists")
        return batch

    def _validate_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("input_ids: the prompt is empty")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"input_ids: the prompt has {len(ids)} tokens but the context window is {self.context_len} tokens"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"input_ids: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _sampling(self, params: dict | None) -> SamplingParams:
        if params is not None and not isinstance(params, dict):
            raise ValueError("sampling_params: must be an object")
        try:
            sp = SamplingParams.from_dict(dict(params or {}))
            sp.verify(self.vocab_size)
        except TypeError as exc:
            raise ValueError(f"sampling_params: {exc}") from exc
        return sp

    def _expand(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Validate everything first, then one tokenized request per prompt and sample."""
        prompts = self._tokenize(obj)
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        rids = obj.rid if isinstance(obj.rid, list) else [obj.rid] * len(prompts)
        out = []
        for ids, p, rid in zip(prompts, params, rids):
            self._validate_ids(ids)
            sp = self._sampling(p)
            base = rid or uuid.uuid4().hex
            for j in range(sp.n):
                d = dataclasses.asdict(sp)
                d["n"] = 1
                if sp.sampling_seed is not None:
                    d["sampling_seed"] = sp.sampling_seed + j
                out.append(TokenizedGenerateReqInput(
                    base if sp.n == 1 else f"{base}-{j}", ids, d, obj.return_logprob, obj.logprob_start_len,
                    obj.top_logprobs_num, obj.stream,
                ))
        if len({r.rid for r in out} | set(self.states)) != len(out) + len(self.states):
            raise ValueError("rid: a request with this id is already running")
        return out

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[dict]:
        """Yield outputs (cumulative text) of one request or a batch; see io_struct.
        Raises ValueError naming the field before anything is sent."""
        self.start()
        reqs = self._expand(obj)
        queue: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        states = [ReqState(r.rid, i, queue, now) for i, r in enumerate(reqs)]
        for st, r in zip(states, reqs):
            self.states[st.rid] = st
            self.metrics.on_request(len(r.input_ids))
            await self.send.send(encode(r))
        single = len(states) == 1 and obj.is_single
        watcher = asyncio.ensure_future(self._watch_disconnect(request, states)) if request is not None else None
        try:
            pending = len(states)
            while pending:
                st = await queue.get()
                if st.finished:
                    pending -= 1
                if obj.stream or st.finished:
                    yield self._result(st, obj, None if single else st.index)
        finally:
            if watcher:
                watcher.cancel()
            for st in states:
                if not st.finished:
                    self.abort_request(st.rid)
                self.states.pop(st.rid, None)

    def _result(self, st: ReqState, obj: GenerateReqInput, index: int | None) -> dict:
        meta = {
            "id": st.rid,
            "prompt_tokens": st.meta.get("prompt_tokens", 0),
            "completion_tokens": st.meta.get("completion_tokens", 0),
            "cached_tokens": st.meta.get("cached_tokens", 0),
            "finish_reason": st.meta.get("finish_reason"),
            "e2e_latency": (st.last_token_time or time.perf_counter()) - st.created,
        }
        if obj.return_logprob:
            for key, entries in st.logprobs.items():
                meta[key] = self._logprob_entries(entries, key.endswith("top_logprobs"), obj.return_text_in_logprobs)
        out = {"text": st.text, "output_ids": list(st.output_ids), "meta_info": meta}
        if index is not None:
            out["index"] = index
        return out

    def _logprob_entries(self, entries: list, top: bool, with_text: bool) -> list:
        def one(lp, tok):
            text = self.tokenizer.decode([tok]) if with_text and self.tokenizer is not None else None
            return (lp, tok, text)

        if top:
            return [None if pos is None else [one(lp, tok) for lp, tok in pos] for pos in entries]
        return [one(lp, tok) for lp, tok in entries]

    async def _watch_disconnect(self, request, states: list[ReqState]) -> None:
        while not all(s.finished for s in states):
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await request.is_disconnected():
                for st in states:
                    if not st.finished:
                        self.abort_request(st.rid)
                return

    def abort_request(self, rid: str) -> None:
        self.send.send(encode(AbortReq(rid)))

    # -- receiving -----------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            msg = decode(await self.recv.recv())
            if isinstance(msg, BatchStrOut):
                self._on_outputs(msg)
            else:
                fut = self.control.pop(type(msg), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)

    def _on_outputs(self, out: BatchStrOut) -> None:
        now = time.perf_counter()
        for rid, delta, ids, meta in zip(out.rids, out.deltas, out.new_ids, out.meta):
            st = self.states.get(rid)
            if st is None:
                continue
            st.text += delta
            st.output_ids.extend(ids)
            for key in st.logprobs:
                st.logprobs[key].extend(meta.pop(key, []) or [])
            st.meta = meta
            if ids:
                self.metrics.on_tokens(st, len(ids), now)
            st.finished = meta.get("finish_reason") is not None
            if st.finished:
                self.metrics.on_finish(st, now)
            st.queue.put_nowait(st)

    async def _control(self, request, reply_type: type, timeout: float = 30.0):
        """Send a control request and await its reply (one at a time)."""
        self.start()
        self._control_lock = self._control_lock or asyncio.Lock()
        async with self._control_lock:
            fut = asyncio.get_running_loop().create_future()
            self.control[reply_type] = fut
            await self.send.send(encode(request))
            return await asyncio.wait_for(fut, timeout)

    async def flush_cache(self) -> bool:
        reply: FlushCacheReqOutput = await self._control(FlushCacheReq(), FlushCacheReqOutput)
        return reply.success

    async def get_internal_state(self) -> dict:
        reply: GetInternalStateReqOutput = await self._control(GetInternalStateReq(), GetInternalStateReqOutput)
        return reply.state

    def num_running_requests(self) -> int:
        return len(self.states)
