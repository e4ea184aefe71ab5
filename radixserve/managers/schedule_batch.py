"""Scheduling state: ``Req``, ``ScheduleBatch`` and the ``ModelWorkerBatch``
handed to the model worker. Batch data flows one way: ScheduleBatch ->
ModelWorkerBatch -> ForwardBatch, and only sampled ids (and logprobs) come back.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Callable

import torch

from radixserve.mem_cache.allocator import page_aligned, pages_for
from radixserve.mem_cache.base_prefix_cache import EMPTY_SLOTS
from radixserve.model_executor.forward_batch_info import ForwardMode, PrefixGroupTable, ragged_arange
from radixserve.sampling import stop_regex
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo


@dataclass
class ModelWorkerBatch:
    """What one forward needs, still on the host. Built by ``ScheduleBatch``;
    turned into a device-side ``ForwardBatch`` by the ModelRunner."""

    forward_mode: ForwardMode
    input_ids: torch.Tensor | None  # [num_tokens] int64 (cpu); None: the caller sets the device's
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64, lengths after this forward
    out_cache_loc: torch.Tensor  # [num_tokens] int64
    seq_lens_cpu: list[int]
    extend_prefix_lens: list[int] | None = None
    extend_seq_lens: list[int] | None = None
    return_logprob: bool = False
    extend_logprob_start_lens: list[int] | None = None
    top_logprobs_nums: list[int] | None = None
    token_ids_logprobs: list[list[int] | None] | None = None  # per request: the ids whose input logprobs it wants
    sampling_info: SamplingBatchInfo | None = None
    vocab_mask: torch.Tensor | None = None  # [bs, ceil(vocab / 32)] int32 bitmask of allowed tokens (structured output)
    num_decoding: int = 0  # extend: the last n requests decode one token each, their input ids read on the device
    prefix_groups: PrefixGroupTable | None = None  # decode: requests sharing a cached prefix (prefix_groups.py)
    # --enable-lora: each request's adapter uid (None: the base model) and its device slot (-1: none)
    lora_ids: list[str | None] | None = None
    lora_slots: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)


PREFIX_GROUP_TOKENS = 64  # see Req.prefix_group
RETRACT_DECODE_STEPS = 20  # tokens of room a retraction leaves each running request (SGLang's retract_decode_steps)


@dataclass(frozen=True)
class FinishReason:
    """Why a request stopped, in SGLang's three kinds; build one with
    ``stopped``, ``at_length``, or for an abort ``aborted`` (on purpose),
    ``refused`` or ``failed``. ``to_json`` is SGLang's
    ``meta_info.finish_reason``.

    An abort's ``status_code`` is the HTTP status a server answers a
    non-streamed request with, as SGLang's ``FINISH_ABORT`` carries it: 400
    when the request itself was at fault (its message starts with the field),
    500 when the server failed it; None when it was aborted on purpose (a
    client's ``/abort_request``, a closed connection), which is answered as a
    finished request whose reason is ``abort``."""

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # stop: the stop token id, stop string or stop_regex pattern
    length: int | None = None  # length: output tokens when the limit was reached
    message: str | None = None  # abort: why; length: set when a full KV pool cut the request short
    status_code: int | None = None  # abort: see above

    @classmethod
    def stopped(cls, matched: int | str) -> "FinishReason":
        return cls("stop", matched=matched)

    @classmethod
    def at_length(cls, length: int, message: str | None = None) -> "FinishReason":
        return cls("length", length=length, message=message)

    @classmethod
    def aborted(cls, message: str, status_code: int | None = None) -> "FinishReason":
        return cls("abort", message=message, status_code=status_code)

    @classmethod
    def refused(cls, message: str) -> "FinishReason":
        """An abort the request caused (HTTP 400); ``message`` starts with the field."""
        return cls.aborted(message, HTTPStatus.BAD_REQUEST)

    @classmethod
    def failed(cls, message: str) -> "FinishReason":
        """An abort the server caused (HTTP 500)."""
        return cls.aborted(message, HTTPStatus.INTERNAL_SERVER_ERROR)

    def to_json(self) -> dict:
        out: dict = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        if self.type == "length":
            out["length"] = self.length
        if self.message:
            out["message"] = self.message
        if self.status_code is not None:
            out["status_code"] = int(self.status_code)
        return out


class Req:
    """One request's scheduling state: tokens, KV ownership, output so far.

    KV ownership (see ``mem_cache/base_prefix_cache.py``): the first
    ``cache_protected_len`` tokens are the radix cache's, locked through
    ``last_node``; KV slots after that up to ``kv_len`` belong to the request.
    """

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params,
        eos_token_ids: set[int] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        token_ids_logprob: list[int] | None = None,
    ):
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        stop_ids = set(sampling_params.stop_token_ids or [])
        self.stop_token_ids_all = stop_ids | (set() if sampling_params.ignore_eos else set(eos_token_ids or ()))
        # memory
        self.req_pool_idx: int | None = None
        self.kv_len = 0
        self.kv_inflight = 0  # tokens after kv_len whose KV a queued forward is writing
        self.prefix_indices: torch.Tensor = EMPTY_SLOTS
        self.cache_protected_len = 0
        self.last_node = None
        # this round's extend
        self.extend_input_len = 0
        self.is_chunked = False
        self.stop_window = 0  # output tokens re-decoded to find stop strings and regexes (0: none)
        self.stop_patterns: list = []  # compiled stop_regex
        self.stop_regex_timed_out = False  # its last search ran out of time (the request is aborted)
        # structured output: the compilation in progress, then the matcher of the output so far
        self.grammar_future = None
        self.grammar = None
        # outcome
        self.finished_reason: FinishReason | None = None
        self.cached_tokens = 0
        self.retractions = 0
        self.to_abort = False
        # logprobs
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob  # SGLang's: these ids' logprobs at every position scored
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.input_token_ids_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.output_token_ids_logprobs: list[list[tuple[float, int]]] = []
        # prefill/decode disaggregation (disagg_prefill.py, disagg_decode.py): the prefill server's
        # bootstrap address and the room naming this request's transfer, its half of it
        self.bootstrap_addr: str | None = None
        self.bootstrap_room: int | None = None
        self.kv_sender = None  # prefill server: sends the prompt's KV
        self.kv_receiver = None  # decode server: receives it
        self.aux_index: int | None = None  # its row of the first token's metadata
        self.disagg_finish: FinishReason | None = None  # prefill server: how it ends once the KV is sent
        self.output_interval = 1  # output tokens between the batches sent on (scheduler_process.py)
        # --enable-lora (docs/lora.md): the adapter's name as the client gave it, and the uid of its load,
        # which is also the namespace of this request's KV in the radix cache (None: the base model)
        self.lora_path: str | None = None
        self.lora_id: str | None = None

    @functools.cached_property
    def prefix_group(self) -> tuple[int, ...]:
        """The prompt's first ``PREFIX_GROUP_TOKENS`` tokens: requests that
        share them likely share a cached prefix (``SchedulePolicy`` groups a
        long waiting queue by them)."""
        return tuple(self.origin_input_ids[:PREFIX_GROUP_TOKENS])

    @property
    def fill_ids(self) -> list[int]:
        """Every token whose KV the request needs before it can sample next."""
        return self.origin_input_ids + self.output_ids

    @property
    def kv_end(self) -> int:
        """Tokens whose KV is written or being written by a queued forward."""
        return self.kv_len + self.kv_inflight

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def init_stop_matching(self, tokenizer) -> None:
        """Size the output tail that ``check_finished`` re-decodes: enough
        tokens for the longest stop string or regex match (every token at
        least one character), all of the output for an unbounded regex."""
        sp = self.sampling_params
        if tokenizer is None or not (sp.stop or sp.stop_regex):
            return
        regex_chars = max((stop_regex.max_match_chars(p) for p in sp.stop_regex), default=0)
        self.stop_window = max(sp.stop_str_max_len(tokenizer), regex_chars) + 2
        self.stop_patterns = stop_regex.compile_all(sp.stop_regex)

    def check_finished(self, tokenizer, context_len: int, regex_timeout_s: float | None = None) -> None:
        """Set ``finished_reason`` if the last output token ends the request:
        a stop token, a stop string or regex in the output's tail, or the
        length limit."""
        sp, last = self.sampling_params, self.output_ids[-1]
        if last in self.stop_token_ids_all and len(self.output_ids) >= sp.min_new_tokens:
            self.finished_reason = FinishReason.stopped(last)
        elif self.stop_window and len(self.output_ids) >= sp.min_new_tokens:
            tail = tokenizer.decode(self.output_ids[-self.stop_window :], skip_special_tokens=sp.skip_special_tokens)
            self.finished_reason = self._match_stop(tail, regex_timeout_s)
        if self.finished_reason is None and (len(self.output_ids) >= sp.max_new_tokens or self.seqlen >= context_len):
            self.finished_reason = FinishReason.at_length(len(self.output_ids))

    def _match_stop(self, tail: str, regex_timeout_s: float | None = None) -> FinishReason | None:
        matched = next((s for s in self.sampling_params.stop if s in tail), None)
        if matched is not None:
            return FinishReason.stopped(matched)
        try:
            found = stop_regex.first_match(self.stop_patterns, tail, regex_timeout_s)
        except stop_regex.StopRegexTimeout as exc:
            self.stop_regex_timed_out = True
            return FinishReason.refused(str(exc))
        return None if found is None else FinishReason.stopped(found[0])

    def wants_input_logprobs(self) -> bool:
        """Whether this extend scores the prompt's tokens: asked for, and the
        first prefill (a retracted request's prompt was scored already)."""
        return (self.return_logprob and 0 <= self.logprob_start_len < len(self.origin_input_ids)
                and not self.output_ids and self.retractions == 0)

    def reset_for_retract(self) -> None:
        """Back to the waiting queue; output so far is kept and re-prefilled."""
        self.req_pool_idx, self.kv_len, self.last_node = None, 0, None
        self.prefix_indices, self.cache_protected_len = EMPTY_SLOTS, 0
        self.is_chunked = False
        self.retractions += 1

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)}, kv={self.kv_len})"


@dataclass
class KVPools:
    """What a batch allocates from: request rows, KV slots, and the prefix
    cache to evict from when the pool is short."""

    req_to_token_pool: Any
    allocator: Any
    tree_cache: Any
    page_size: int
    device: torch.device

    def can_back(self, need: int) -> bool:
        """Whether ``need`` slots can be allocated now without a map the device
        may refuse: free in mapped memory (mapped here if need be, with an
        elastic pool), or held by cached KV that eviction frees."""
        return (self.allocator.ensure_mapped(need)
                or self.allocator.available_size() + self.tree_cache.evictable_size() >= need)

    def alloc_with_evict(self, need: int, alloc_fn):
        """``alloc_fn()`` after evicting enough cached KV for ``need`` slots."""
        if self.allocator.available_size() < need:
            self.tree_cache.evict(need - self.allocator.available_size())
        return alloc_fn()

    def last_locs(self, reqs: list[Req]) -> torch.Tensor:
        """Each request's last KV slot (where its next token's page continues)."""
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        cols = torch.tensor([max(r.kv_end - 1, 0) for r in reqs], dtype=torch.int64)
        return self.req_to_token_pool.req_to_token[rows.to(self.device), cols.to(self.device)].to(torch.int64)

    def decode_pages_needed(self, reqs: list[Req], steps: int = 1) -> int:
        """Slots ``steps`` decodes of ``reqs`` must allocate: the pages their
        next ``steps`` tokens start (one step: a page for each request whose
        last page is full)."""
        p = self.page_size
        return sum((pages_for(r.kv_end + steps, p) - pages_for(r.kv_end, p)) * p for r in reqs)

    def extend_slots_needed(self, reqs: list[Req], riders: int = 0) -> int:
        """Slots an extend of ``reqs`` may allocate, with ``riders`` running
        requests decoding one token each inside it: each request's new tokens
        in whole pages, and a page more where they straddle one."""
        p = self.page_size
        return sum(page_aligned(r.extend_input_len, p) + p for r in reqs) + riders * (page_aligned(1, p) + p)

    def can_hold(self, need: int) -> bool:
        """Whether ``need`` slots fit now beside the running requests' KV:
        free or held by evictable cached KV, and backed (``can_back``)."""
        return need <= self.allocator.available_size() + self.tree_cache.evictable_size() and self.can_back(need)


class ScheduleBatch:
    """The requests of one forward and the KV they need.

    The Scheduler picks the requests (admission, or the running batch) and
    builds one; ``prepare_for_extend`` / ``prepare_for_decode`` allocate the
    batch's request rows and KV slots (evicting from the prefix cache when the
    pool is short) and return the slots; ``get_model_worker_batch`` then
    describes the forward for the ModelRunner.
    """

    def __init__(self, reqs: list[Req], forward_mode: ForwardMode, pools: KVPools, vocab_size: int):
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.pools = pools
        self.vocab_size = vocab_size
        self.out_cache_loc: torch.Tensor | None = None
        self.seq_lens: list[int] = []
        self.decoding_reqs: list[Req] = []  # running requests decoding inside this extend (mix_with_running)
        self.prefix_grouper = None  # the running batch's, with --enable-prefix-grouped-decode (prefix_groups.py)

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    # The request list is replaced, never changed in place: a batch in flight
    # keeps the list it was launched with.
    def filter_batch(self, keep: Callable[[Req], bool] | None = None) -> None:
        """Keep the requests ``keep`` accepts (by default: those not finished)."""
        self.reqs = [r for r in self.reqs if (keep(r) if keep is not None else not r.finished())]

    def merge_batch(self, reqs: list[Req]) -> None:
        """Add requests (prefilled ones joining the running batch)."""
        self.reqs = self.reqs + reqs

    def retract_decode(self, others_hold: bool = False) -> tuple[list[Req], Req | None]:
        """Make room for one more token per request: evict cached KV; if that
        is not enough, retract requests (fewest outputs first, longest
        prompts first among equals), removing them with their KV given to the
        cache, until those left have room for ``RETRACT_DECODE_STEPS`` more
        tokens each (SGLang's ``retract_decode_steps``: one retraction, not
        one a step). Returns the retracted requests (to re-queue) and, if one
        request alone has outgrown the pool, that request, removed too and
        finished by length. With ``others_hold`` (other micro-batches'
        requests hold KV) no request is alone: the last one is retracted
        too, to wait for theirs."""
        pools = self.pools

        def short(steps: int = 1) -> int:
            return pools.decode_pages_needed(self.reqs, steps) - pools.allocator.available_size()

        pools.allocator.ensure_mapped(pools.decode_pages_needed(self.reqs))  # refused: short() counts mapped slots only

        if short() > 0:
            pools.tree_cache.evict(short())
        retracted = []
        if short() > 0:
            pools.tree_cache.evict(short(RETRACT_DECODE_STEPS))
            # a run-time limit never cuts a request short: the last one waits too, for the limit to rise
            while self.reqs and ((len(self.reqs) > 1 and short(RETRACT_DECODE_STEPS) > 0)
                                 or (short() > 0 and (others_hold or pools.allocator.limit_binds()))):
                victim = min(self.reqs, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
                self.filter_batch(lambda r: r is not victim)  # noqa: B023 (called here, in this iteration)
                pools.tree_cache.cache_finished_req(victim)
                victim.reset_for_retract()
                retracted.append(victim)
                if short(RETRACT_DECODE_STEPS) > 0:
                    pools.tree_cache.evict(short(RETRACT_DECODE_STEPS))
        if short() <= 0:
            return retracted, None
        cut, self.reqs = self.reqs[-1], self.reqs[:-1]
        cut.finished_reason = FinishReason.at_length(len(cut.output_ids), message="the KV cache is full")
        pools.tree_cache.cache_finished_req(cut)
        return retracted, cut

    def prepare_for_extend(self) -> torch.Tensor:
        """Give new requests a row (holding their cached prefix) and allocate
        the slots of every request's new tokens; returns the slots."""
        pools = self.pools
        for req in self.reqs:
            if req.req_pool_idx is None:
                req.req_pool_idx = pools.req_to_token_pool.alloc(1)[0]
                pools.req_to_token_pool.write(req.req_pool_idx, 0, req.prefix_indices)
        prefix = torch.tensor([r.kv_end for r in self.reqs], dtype=torch.int64)
        seq = prefix + torch.tensor([r.extend_input_len for r in self.reqs], dtype=torch.int64)
        need, last = pools.extend_slots_needed(self.reqs), pools.last_locs(self.reqs)
        slots = pools.alloc_with_evict(need, lambda: pools.allocator.alloc_extend(prefix, seq, last))
        if slots is None:
            raise RuntimeError(f"KV allocation failed for an admitted prefill of {int((seq - prefix).sum())} tokens")
        lens, rows = seq - prefix, torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64)
        # One scatter for the whole batch (a mixed one has a request per rider).
        pools.req_to_token_pool.write_at(rows.repeat_interleave(lens), ragged_arange(prefix, lens), slots)
        self.out_cache_loc, self.seq_lens = slots, seq.tolist()
        return slots

    def mix_with_running(self, running: list[Req]) -> None:
        """Let running requests decode inside this extend, one new token each
        (their last output token, which the worker reads on the device: the
        host may not know it yet); call before ``prepare_for_extend``."""
        for req in running:
            req.extend_input_len = 1
        self.reqs = self.reqs + running
        self.decoding_reqs = list(running)

    def prepare_for_decode(self) -> torch.Tensor:
        """Allocate one slot per request for the token being decoded; returns the slots."""
        pools = self.pools
        seq = torch.tensor([r.kv_end + 1 for r in self.reqs], dtype=torch.int64)
        at_boundary = all(r.kv_end % pools.page_size == 0 for r in self.reqs)  # then no last slot is needed
        last = None if at_boundary else pools.last_locs(self.reqs)
        slots = pools.alloc_with_evict(pools.decode_pages_needed(self.reqs),
                                       lambda: pools.allocator.alloc_decode(seq, last))
        if slots is None:
            raise RuntimeError("KV allocation failed for decode after making room")
        rows = torch.tensor([r.req_pool_idx for r in self.reqs], dtype=torch.int64).to(pools.device)
        pools.req_to_token_pool.req_to_token[rows, (seq - 1).to(pools.device)] = slots.to(torch.int32)
        self.out_cache_loc, self.seq_lens = slots, seq.tolist()
        return slots

    def get_model_worker_batch(self, sampling_info: SamplingBatchInfo | None = None) -> ModelWorkerBatch:
        """The forward of this batch, after ``prepare_for_*``. An extend gets
        a fresh sampling info unless one is given; a decode's comes from the
        running batch's state (``DecodeSamplingState``) and its input ids
        from the device (``input_ids`` None: they may still be being sampled)."""
        reqs = self.reqs
        rows = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        seq = torch.tensor(self.seq_lens, dtype=torch.int64)
        if self.forward_mode == ForwardMode.DECODE:
            groups = None if self.prefix_grouper is None else self.prefix_grouper.table(reqs)
            return ModelWorkerBatch(ForwardMode.DECODE, None, rows, seq, self.out_cache_loc, self.seq_lens,
                                    sampling_info=sampling_info, prefix_groups=groups)
        input_ids, prefix, ext = [], [], []
        for r in reqs:
            prefix.append(r.kv_end)
            ext.append(r.extend_input_len)
        decoding = len(self.decoding_reqs)  # the last requests (``mix_with_running``)
        for r in reqs[: len(reqs) - decoding]:
            input_ids += r.fill_ids[r.kv_end : r.kv_end + r.extend_input_len]
        input_ids += [0] * decoding  # their last tokens may still be being sampled
        want = [r.wants_input_logprobs() for r in reqs]
        return ModelWorkerBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            req_pool_indices=rows,
            seq_lens=seq,
            out_cache_loc=self.out_cache_loc,
            seq_lens_cpu=self.seq_lens,
            extend_prefix_lens=prefix,
            extend_seq_lens=ext,
            return_logprob=any(want),
            extend_logprob_start_lens=[
                max(r.logprob_start_len - 1 - p, 0) if w else e for r, w, e, p in zip(reqs, want, ext, prefix)
            ],
            top_logprobs_nums=[r.top_logprobs_num if w else 0 for r, w in zip(reqs, want)],
            token_ids_logprobs=[r.token_ids_logprob if w else None for r, w in zip(reqs, want)],
            sampling_info=sampling_info or SamplingBatchInfo.from_reqs(reqs, self.vocab_size, self.pools.device),
            num_decoding=decoding,
        )
