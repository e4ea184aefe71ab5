"""The TokenizerManager (main process): validates and tokenizes requests,
sends them to the scheduler, and turns the detokenizer's text deltas into
per-request results and streams. Aborts requests whose client went away,
refuses work beyond the server's limits, and ends every request with an
error when the engine's processes die."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import zmq
import zmq.asyncio

from radixserve.feature_args import CompileLimits
from radixserve.managers.data_parallel_controller import DataParallelController
from radixserve.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    CloseReq,
    GenerateReqInput,
    SchedulerStats,
    TokenizedGenerateReqInput,
    decode,
    encode,
    pipeline_sockets,
)
from radixserve.managers.metrics import ServerMetrics
from radixserve.managers.tokenizer_communicator_mixin import TokenizerCommunicatorMixin, _control_key
from radixserve.sampling.grammar import check_grammar, grammar_spec
from radixserve.sampling.grammar_sandbox import GrammarSandbox
from radixserve.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

INLINE_TOKENIZE_CHARS = 8192  # shorter texts are tokenized on the event loop (faster than a thread hop)
TOKENIZER_THREADS = 2


def _prompt_rids(obj: GenerateReqInput) -> list[str | None]:
    """Each prompt's request id: a list as given; one id for a batch becomes
    ``rid_0``, ``rid_1``, ... (as SGLang names them), so that no two share one."""
    if isinstance(obj.rid, list):
        return obj.rid
    if obj.rid is not None and not obj.is_single:
        return [f"{obj.rid}_{i}" for i in range(obj.batch_size)]
    return [obj.rid] * obj.batch_size


class EngineDeadError(RuntimeError):
    """The scheduler or the detokenizer is gone: nothing can be served (HTTP 503)."""


class ServerBusyError(RuntimeError):
    """More requests are waiting than the server takes (HTTP 429)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past ``--request-timeout`` and was aborted (HTTP 504)."""


class RequestFailedError(RuntimeError):
    """The server failed the request (an abort with a 5xx ``status_code``,
    such as a failed KV transfer); answered with that status."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


def raise_for_abort(finish_reason: dict | None) -> None:
    """As SGLang answers a non-streamed request that ended in an abort with a
    ``status_code``: ``ValueError`` (HTTP 400, the message names the field)
    when the request was at fault, ``RequestFailedError`` when the server
    was. An abort without one (the client's) is a finished request."""
    reason = finish_reason or {}
    status = reason.get("status_code") if reason.get("type") == "abort" else None
    if status is None:
        return
    message = reason.get("message") or "the request was aborted"
    if status == 400:
        raise ValueError(message)
    raise RequestFailedError(message, status)


@dataclass(frozen=True)
class RequestLimits:
    """What one request, and all of them together, may ask of the engine.
    ``max_in_flight`` counts sub-requests (prompts x samples); None: no limit."""

    max_prompt_chars: int
    max_in_flight: int | None = None
    request_timeout: float | None = None
    grammar: CompileLimits = CompileLimits()


_ENGINE_DEAD = object()  # put on a request's queue when the engine dies


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
    return_logprob: bool = False
    log_metrics: bool = True
    streamed: int = 0  # output tokens when the last stream event went out
    finished: bool = False
    queued: bool = False  # on the queue already: later updates coalesce into that entry
    first_token_time: float | None = None
    last_token_time: float | None = None
    logprobs: dict = field(default_factory=lambda: {
        "input_token_logprobs": [], "input_top_logprobs": [], "output_token_logprobs": [], "output_top_logprobs": []})


class TokenizerManager(TokenizerCommunicatorMixin):
    """The front of the engine in the HTTP process (see module docstring);
    the control requests to every replica come from :class:`TokenizerCommunicatorMixin`."""

    def __init__(self, tokenizer, model_info: dict, served_model_name: str, send_addrs: str | list[str],
                 recv_addr: str, limits: RequestLimits, model_names: set[str] = frozenset(),
                 load_balance_method: str = "round_robin", disaggregation_mode: str = "null",
                 default_bootstrap_port: int = 8998, lora_adapters: dict[str, str] | None = None):
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.context_len: int = model_info["context_len"]
        self.vocab_size: int = model_info["vocab_size"]
        self.served_model_name = served_model_name
        self.disaggregation_mode = disaggregation_mode  # "null", "prefill" or "decode"
        self.default_bootstrap_port = default_bootstrap_port  # for a request that names no bootstrap_port
        self.model_names = {served_model_name, *model_names}  # the names it goes by: never read as base:adapter
        self.lora_enabled = lora_adapters is not None  # --enable-lora
        self.lora_adapters: dict[str, str] = dict(lora_adapters or {})  # the adapters loaded: name -> path
        self.limits = limits
        self.ctx = zmq.asyncio.Context(2)
        self.ctx.setsockopt(zmq.LINGER, 0)
        # Sends never block: admission bounds what can queue up in the socket.
        self.ctx.setsockopt(zmq.SNDHWM, 0)
        send_addrs = [send_addrs] if isinstance(send_addrs, str) else list(send_addrs)
        self.recv, first = pipeline_sockets(self.ctx, recv_addr, send_addrs[0])
        self.sends = [first] + [self._connect(addr) for addr in send_addrs[1:]]  # one per data-parallel replica
        # a prefill server sends a request with a room to replica room % dp_size, where the decode side looks
        self.dp = DataParallelController(len(self.sends), load_balance_method, by_room=disaggregation_mode == "prefill")
        self.states: dict[str, ReqState] = {}
        self.control: dict[type, tuple[asyncio.Future, list]] = {}  # reply type -> (future, replies so far)
        self._control_lock: asyncio.Lock | None = None
        self._profile_ids = 0
        self.metrics = ServerMetrics()
        self.replica_stats: dict[int, dict] = {}  # each replica's latest SchedulerStats, by dp rank
        self.dead: str | None = None  # why the engine stopped serving, once it has
        self._executor = ThreadPoolExecutor(TOKENIZER_THREADS, thread_name_prefix="tokenize")
        # every new grammar is compiled once in a bounded child before it is queued
        self.grammar_sandbox = GrammarSandbox(tokenizer, self.vocab_size, limits.grammar) if tokenizer else None
        self._loop_task: asyncio.Task | None = None

    def _connect(self, addr: str):
        sock = self.ctx.socket(zmq.PUSH)
        sock.connect(addr)
        return sock

    @property
    def last_stats(self) -> dict:
        """The replicas' latest figures added up (empty until a first report)."""
        return sum_replica_stats(list(self.replica_stats.values()))

    def start(self) -> None:
        """Start receiving (call from inside the running event loop)."""
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._recv_loop())

    async def run_blocking(self, fn: Callable, *args) -> Any:
        """``fn(*args)`` on the tokenizer threads, so that the event loop keeps serving."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    # -- requests ------------------------------------------------------------------
    async def _tokenize(self, obj: GenerateReqInput) -> list[list[int]]:
        if obj.input_ids is not None:
            return [obj.input_ids] if obj.is_single else obj.input_ids
        texts = [obj.text] if obj.is_single else obj.text
        if self.tokenizer is None:
            raise ValueError("text: this model has no tokenizer; send input_ids")
        limit = self.limits.max_prompt_chars
        for i, text in enumerate(texts):
            if len(text) > limit:
                where = "text" if obj.is_single else f"text[{i}]"
                raise ValueError(f"{where}: the prompt has {len(text)} characters; this server takes at most "
                                 f"{limit} (--max-prompt-chars)")
        if sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
            return self._encode(texts)
        return await self.run_blocking(self._encode, texts)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(t) for t in texts]

    def _validate_ids(self, ids: list[int], where: str) -> None:
        if not ids:  # text that encodes to no tokens ("" with a tokenizer that adds no BOS)
            raise ValueError(f"{where}: the prompt is empty (it encodes to no tokens)")
        if len(ids) >= self.context_len:
            raise ValueError(
                f"{where}: the prompt has {len(ids)} tokens but the context window is {self.context_len} tokens"
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    def _sampling(self, params: dict | None, where: str) -> SamplingParams:
        try:
            sp = SamplingParams.from_dict(params or {})
            sp.verify(self.vocab_size)
        except ValueError as exc:
            raise ValueError(f"{where}.{exc}") from None
        return sp

    async def _expand(self, obj: GenerateReqInput) -> list[TokenizedGenerateReqInput]:
        """Validate everything first, then one tokenized request per prompt and sample."""
        if any(n > self.vocab_size for n in obj.per_prompt("top_logprobs_num")):
            raise ValueError(f"top_logprobs_num: at most the vocabulary size ({self.vocab_size})")
        n_prompts = obj.batch_size
        params = obj.sampling_params if isinstance(obj.sampling_params, list) else [obj.sampling_params] * n_prompts
        where = ["sampling_params"] * n_prompts if not isinstance(obj.sampling_params, list) else [
            f"sampling_params[{i}]" for i in range(n_prompts)]
        sps = [self._sampling(p, w) for p, w in zip(params, where)]
        self._check_capacity(sum(sp.n for sp in sps), admitting=False)
        await self._check_grammars(sps, where)
        prompts = await self._tokenize(obj)
        rids = _prompt_rids(obj)
        key = "input_ids" if obj.input_ids is not None else "text"
        logprobs = zip(*(obj.per_prompt(name) for name in ("return_logprob", "logprob_start_len", "top_logprobs_num")))
        bootstraps = self._bootstraps(obj, sps)
        token_ids = self._token_ids_logprob(obj, bootstraps)
        adapters = self._lora_paths(obj)
        out = []
        for i, (ids, sp, rid, (want, start, top)) in enumerate(zip(prompts, sps, rids, logprobs)):
            self._validate_ids(ids, key if obj.is_single else f"{key}[{i}]")
            base = rid or uuid.uuid4().hex
            for j in range(sp.n):
                d = sp.to_dict()
                d["n"] = 1
                if sp.sampling_seed is not None:
                    d["sampling_seed"] = sp.sampling_seed + j
                rid_j = base if sp.n == 1 else f"{base}-{j}"
                out.append(TokenizedGenerateReqInput(rid_j, ids, d, want, start, top, obj.stream, *bootstraps[i],
                                                     token_ids_logprob=token_ids[i], lora_path=adapters[i]))
        given = [r.rid for r in out]
        if len(set(given)) < len(given):  # e.g. ["a-0", "a"] with n = 2 on the second: "a-0" twice
            dup = next(r for r in given if given.count(r) > 1)
            raise ValueError(f"rid: the request ids of this request's generations collide ({dup!r} twice; with "
                             f"n > 1 a request id r becomes r-0, r-1, ...)")
        return out

    @property
    def lora_names(self) -> set[str] | None:
        """The names of the LoRA adapters loaded; None without --enable-lora."""
        return set(self.lora_adapters) if self.lora_enabled else None

    def _lora_paths(self, obj: GenerateReqInput) -> list[str | None]:
        """Each prompt's LoRA adapter, checked: ValueError naming the field and the adapter."""
        out = obj.per_prompt("lora_path")
        for i, name in enumerate(out):
            where = "lora_path" if obj.is_single or not isinstance(obj.lora_path, list) else f"lora_path[{i}]"
            if name is None:
                continue
            if not self.lora_enabled:
                raise ValueError(f"{where}: LoRA adapters are not supported by this server unless it is started "
                                 f"with --enable-lora, got {name!r}")
            if name not in self.lora_adapters:
                known = ", ".join(sorted(self.lora_adapters)) or "none"
                raise ValueError(f"{where}: unknown LoRA adapter {name!r} (loaded: {known})")
        return out

    def _token_ids_logprob(self, obj: GenerateReqInput, bootstraps: list[tuple]) -> list[list[int] | None]:
        """Each prompt's ``token_ids_logprob`` where it asks for logprobs (SGLang
        ignores it otherwise); ValueError naming the field."""
        per_prompt = bool(obj.token_ids_logprob) and isinstance(obj.token_ids_logprob[0], list)
        out = []
        for i, (ids, want, (_, room)) in enumerate(zip(obj.per_prompt("token_ids_logprob"),
                                                       obj.per_prompt("return_logprob"), bootstraps)):
            where = f"token_ids_logprob[{i}]" if per_prompt else "token_ids_logprob"
            if ids is None or not want:
                out.append(None)
                continue
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise ValueError(f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab_size})")
            if room is not None:
                raise ValueError(f"{where}: not with a bootstrap room: the first token crosses from the prefill "
                                 "server to the decode server without these logprobs")
            out.append(ids)
        return out

    def _bootstraps(self, obj: GenerateReqInput, sps: list[SamplingParams]) -> list[tuple[str | None, int | None]]:
        """Each prompt's (bootstrap address, room), or (None, None) when it is
        served here from start to end; ValueError naming the field."""
        out = []
        fields = zip(*(obj.per_prompt(f"bootstrap_{name}") for name in ("host", "port", "room")))
        for i, ((host, port, room), sp) in enumerate(zip(fields, sps)):
            where = "" if obj.is_single else f"[{i}]"
            if room is None:
                if host is not None or port is not None:
                    raise ValueError(f"bootstrap_room{where}: required with bootstrap_host and bootstrap_port")
                out.append((None, None))
                continue
            if self.disaggregation_mode == "null":
                raise ValueError(f"bootstrap_room{where}: this server is neither a prefill nor a decode server "
                                 "(--disaggregation-mode)")
            if not host:
                raise ValueError(f"bootstrap_host{where}: required with bootstrap_room")
            if sp.n != 1:
                raise ValueError(f"bootstrap_room{where}: a disaggregated request samples once (n must be 1)")
            port = self.default_bootstrap_port if port is None else port
            out.append((f"[{host}]:{port}" if ":" in host else f"{host}:{port}", room))
        return out

    async def _check_grammars(self, sps: list[SamplingParams], where: list[str]) -> None:
        """A grammar that cannot be built, or whose compile goes over the
        limits (``grammar_sandbox``), is a 400 here, before anything is queued."""
        checked: set[tuple[str, str]] = set()
        for sp, w in zip(sps, where):
            spec = grammar_spec(sp)
            if spec is None or spec in checked:
                continue
            if self.tokenizer is None:
                raise ValueError(f"{w}.{spec[0]}: structured output needs the model's tokenizer")
            try:
                await self.run_blocking(check_grammar, *spec)  # the first one imports xgrammar (about a second)
                # shielded: a client that leaves must not cancel a verdict other requests share
                await asyncio.shield(asyncio.wrap_future(self.grammar_sandbox.submit(*spec)))
            except ValueError as exc:
                raise ValueError(f"{w}.{exc}") from None
            checked.add(spec)

    def _check_capacity(self, n: int, admitting: bool = True) -> None:
        """Refuse ``n`` more sub-requests when they never fit (400) or do not fit now (429)."""
        cap = self.limits.max_in_flight
        if cap is None:
            return
        if n > cap:
            raise ValueError(f"n: this request asks for {n} generations (prompts x n); the server runs and "
                             f"queues at most {cap} at once")
        if admitting and len(self.states) + n > cap:
            raise ServerBusyError(f"the server is busy: {len(self.states)} requests are in flight and at most "
                                  f"{cap} are queued or running; retry later")

    def _check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine is not serving: {self.dead}")

    async def generate_request(self, obj: GenerateReqInput, request: Any = None) -> AsyncIterator[dict]:
        """Yield outputs (cumulative text) of one request or a batch; see io_struct.
        Raises ValueError naming the field, ServerBusyError, RequestTimeoutError
        or EngineDeadError; nothing is registered or sent for a request refused."""
        self.start()
        self._check_alive()
        reqs = await self._expand(obj)
        payloads = [encode(r) for r in reqs]  # before registering: a failure here leaves nothing behind
        self._check_alive()
        self._check_capacity(len(reqs))
        if any(r.rid in self.states for r in reqs):
            raise ValueError("rid: a request with this id is already running")
        queue: asyncio.Queue = asyncio.Queue()
        now = time.perf_counter()
        states = [ReqState(r.rid, i, queue, now, return_logprob=r.return_logprob, log_metrics=obj.log_metrics)
                  for i, r in enumerate(reqs)]
        for st, r in zip(states, reqs):
            if r.token_ids_logprob is not None:  # in meta_info only when asked for, as in SGLang
                st.logprobs.update(input_token_ids_logprobs=[], output_token_ids_logprobs=[])
        single = len(states) == 1 and obj.is_single
        watcher = None
        try:
            for st, r, data in zip(states, reqs, payloads):
                self.states[st.rid] = st
                if obj.log_metrics:
                    self.metrics.on_request(len(r.input_ids))
                self.sends[self.dp.dispatch(r.rid, r.input_ids, r.bootstrap_room)].send(data, zmq.NOBLOCK)
            if request is not None:
                watcher = asyncio.ensure_future(self._watch_disconnect(request, states))
            async for st in self._updates(queue, len(states)):
                # the scheduler sends a stream's tokens every stream_interval (scheduler_process.py)
                if st.finished or (obj.stream and len(st.output_ids) > st.streamed):
                    if not obj.stream:  # a stream ends with the abort's reason, as in SGLang
                        raise_for_abort(st.meta.get("finish_reason"))
                    st.streamed = len(st.output_ids)
                    yield self._result(st, obj, None if single else st.index)
        finally:
            if watcher:
                watcher.cancel()
            for st in states:
                if not st.finished and self.states.get(st.rid) is st:
                    self.abort_request(st.rid)
                if self.states.get(st.rid) is st:
                    del self.states[st.rid]
                    self.dp.finished(st.rid)

    async def _updates(self, queue: asyncio.Queue, pending: int) -> AsyncIterator[ReqState]:
        """The request's states as they change, until all are finished; raises
        when the engine dies or the request's time is up."""
        timeout = self.limits.request_timeout
        deadline = None if timeout is None else asyncio.get_running_loop().time() + timeout
        while pending:
            try:
                if deadline is None:
                    st = await queue.get()
                else:
                    st = await asyncio.wait_for(queue.get(), max(deadline - asyncio.get_running_loop().time(), 0))
            except asyncio.TimeoutError:
                raise RequestTimeoutError(f"the request did not finish within {timeout:g} s (--request-timeout)") from None
            if st is _ENGINE_DEAD:
                raise EngineDeadError(f"the engine is not serving: {self.dead}")
            st.queued = False
            pending -= st.finished
            yield st

    def _result(self, st: ReqState, obj: GenerateReqInput, index: int | None) -> dict:
        meta = {
            "id": st.rid,
            "prompt_tokens": st.meta.get("prompt_tokens", 0),
            "completion_tokens": st.meta.get("completion_tokens", 0),
            "cached_tokens": st.meta.get("cached_tokens", 0),
            "finish_reason": st.meta.get("finish_reason"),
            "e2e_latency": (st.last_token_time or time.perf_counter()) - st.created,
        }
        if st.return_logprob:
            for key, entries in st.logprobs.items():
                per_position = key.endswith(("top_logprobs", "token_ids_logprobs"))  # a list of entries at each
                meta[key] = self._logprob_entries(entries, per_position, obj.return_text_in_logprobs)
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
        """Abort what is unfinished when the client goes away. Its body is
        read, so the connection's next ASGI message is ``http.disconnect``:
        one wait per request, at no cost while it runs, and noticed at once
        (polling ``is_disconnected`` costs a cancel scope a call)."""
        message = await request.receive()
        while message["type"] != "http.disconnect":  # not expected once the body is read; wait on
            message = await request.receive()
        for st in states:
            if not st.finished:
                self.abort_request(st.rid)

    def abort_request(self, rid: str) -> None:
        if self.dead is not None:
            return
        replica = self.dp.replica_of(rid)
        for sock in self.sends if replica is None else [self.sends[replica]]:
            sock.send(encode(AbortReq(rid)), zmq.NOBLOCK)

    def close_schedulers(self) -> None:
        """Ask every replica's scheduler to close (each rank's cache tiers
        finish their writes, KV events go out) and exit; the server is
        stopping. Also once requests were ended for the shutdown (``dead``
        set by :meth:`fail_all`): the schedulers still run (the caller checks
        that no child died), and without the request they would be killed."""
        for sock in self.sends:
            try:
                sock.send(encode(CloseReq()), zmq.NOBLOCK)
            except zmq.ZMQError:  # its queue is full or it is gone: it is stopped with a signal instead
                pass

    def fail_all(self, reason: str) -> None:
        """The engine is gone: every request in flight and every control call
        ends with ``EngineDeadError(reason)``, and so does every later one."""
        self.dead = reason
        for st in list(self.states.values()):
            st.queue.put_nowait(_ENGINE_DEAD)
        for fut, _ in self.control.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(f"the engine is not serving: {reason}"))

    # -- receiving -----------------------------------------------------------------------
    async def _recv_loop(self) -> None:
        while True:
            data = await self.recv.recv()
            try:
                self._dispatch(decode(data))
            except Exception as exc:  # one bad message must not stop every request's replies
                logger.error("dropped a message from the detokenizer: %s: %s", type(exc).__name__, exc)
                logger.debug("dropped message", exc_info=True)

    def _dispatch(self, msg) -> None:
        if isinstance(msg, BatchStrOut):
            self._on_outputs(msg)
        elif isinstance(msg, SchedulerStats):
            self.replica_stats[int(msg.state.get("dp_rank", 0))] = msg.state
            self.metrics.update_from_state(self.last_stats)
        elif (key := _control_key(msg)) in self.control:  # a control reply: complete once every replica has answered
            fut, replies = self.control[key]
            replies.append(msg)
            if len(replies) == len(self.sends) and not fut.done():
                self.control.pop(key)
                fut.set_result(replies)

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
            if meta.pop("abort_upstream", False):  # the detokenizer ended it: stop it in the scheduler too
                self.abort_request(rid)
            st.meta = meta
            if ids and st.log_metrics:
                self.metrics.on_tokens(st, len(ids), now)
            st.finished = meta.get("finish_reason") is not None
            if st.finished:
                self.dp.finished(rid)
            if st.finished and st.log_metrics:
                self.metrics.on_finish(st, now)
            if not st.queued:
                st.queued = True
                st.queue.put_nowait(st)

    def num_running_requests(self) -> int:
        return len(self.states)

    def close(self) -> None:
        """Stop the tokenizer threads and close the sockets (the process is exiting)."""
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self.grammar_sandbox is not None:
            self.grammar_sandbox.close()
        self.ctx.destroy(linger=0)


# Figures that add up over replicas; the others are recomputed from them.
_SUMMED = ("running", "waiting", "kv_used", "waiting_tokens", "max_total_tokens", "prompt_tokens", "cached_tokens",
           "generated", "forward_ct", "retractions", "kv_free", "kv_cached")


def sum_replica_stats(states: list[dict]) -> dict:
    """One replica's figures, or several replicas' added up (usage and hit
    rate over the sums)."""
    if len(states) <= 1:
        return dict(states[0]) if states else {}
    # the cache tiers' figures (docs/hicache.md), the grammar caches', the elastic KV pools', the KV events'
    # and the experts' load histogram (docs/moe.md)
    per_cache = {key for s in states for key in s
                 if key.startswith(("hicache_", "grammar_", "elastic_kv_", "kv_events_", "moe_"))}
    total = {key: sum(s.get(key, 0) for s in states) for key in (*_SUMMED, *sorted(per_cache))}
    total["kv_usage"] = total["kv_used"] / max(total["max_total_tokens"], 1)
    total["cache_hit_rate"] = total["cached_tokens"] / max(total["prompt_tokens"], 1)
    return total
