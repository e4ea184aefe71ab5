"""What the Scheduler does with a batch's results: append each request's
token, check its stop conditions, hand finished requests' KV to the prefix
cache and update the running batch (SGLang's ``SchedulerOutputProcessorMixin``)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from radixserve.layers.sampler import SampleOutput
from radixserve.managers.profiler import phase
from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.managers.tp_worker import QueuedForward, QueuedSample
from radixserve.model_executor.forward_batch_info import ForwardMode

logger = logging.getLogger(__name__)

MIN_NEW_TOKEN_RATIO = 0.1
RECHECK_REGEX_TIMEOUT_S = 2.0  # a stop_regex search rank 0 finished in time, run again on a slower rank
NEW_TOKEN_RATIO_DECAY = 0.001


@dataclass
class Launched:
    """A batch queued on the device, with the requests it was launched with
    (the running batch changes after)."""

    reqs: list[Req]
    forward: QueuedForward
    decoding: frozenset[int] = frozenset()  # ids of running requests decoding inside an extend
    sampled: QueuedSample | None = None  # set once its sampling is queued too


class SchedulerOutputProcessorMixin:
    """Result processing of :class:`Scheduler` (whose state it uses)."""

    @phase("scheduler.process")
    def _process(self, launched: Launched) -> list[Req]:
        """Wait for a launched batch and apply its results to its requests."""
        next_ids = launched.sampled.wait()
        reqs, batch, sample = launched.reqs, launched.forward.batch, launched.sampled.sample
        mode = batch.forward_mode
        if mode == ForwardMode.EXTEND:
            launched.sampled.record_input_logprobs(reqs)
        # Entries that prefilled part of a prompt (the next chunk may be in flight already).
        partial = [mode == ForwardMode.EXTEND and seq < len(req.fill_ids) for req, seq in zip(reqs, batch.seq_lens_cpu)]
        updated, constrained = [], []
        for i, (req, tok) in enumerate(zip(reqs, next_ids)):
            seq = batch.seq_lens_cpu[i]
            req.kv_inflight -= seq - req.kv_len
            req.kv_len = seq
            if req.finished():  # finished by the previous batch while this one was queued
                self._release_deferred(req)
            elif req.to_abort:
                req.finished_reason = FinishReason.aborted("aborted by request")
                if self.chunked_req is req:
                    self.chunked_req, req.is_chunked = None, False
                updated.append(req)
            elif partial[i]:
                self.tree_cache.cache_unfinished_req(req)
            elif req.sampling_params.max_new_tokens == 0:
                req.finished_reason = FinishReason.at_length(0)
                updated.append(req)
            else:
                try:
                    self._append_sampled(req, tok, sample, i)
                    if req.grammar is not None:
                        constrained.append(req)
                except Exception as exc:  # e.g. a stop-string check that cannot decode this output
                    logger.error("request %s aborted: %s: %s", req.rid, type(exc).__name__, exc)
                    req.finished_reason = FinishReason.failed(f"internal error: {exc}")
                updated.append(req)
        if constrained:
            self.grammar_queue.advance(constrained)
        self._agree_on_stop_regex(updated)
        prefilled = [r for r, p in zip(reqs, partial) if not p and id(r) not in launched.decoding]
        updated = self.disagg.hand_off_prefilled(updated, prefilled)  # on a prefill server: prompts with a room
        self._update_running(mode, updated, prefilled)
        return updated

    def _agree_on_stop_regex(self, reqs: list[Req]) -> None:
        """Under TP or PP: a stop_regex search runs against a clock on every rank,
        so whether it ran out of time is rank 0's call. A request it timed
        out on rank 0 ends on every rank; one it timed out only here is
        checked again with a longer limit (rank 0 found its answer in time)."""
        if self.tp_group.size == 1 and self.pp.size == 1:
            return
        watched = [r for r in reqs if r.stop_patterns and r.output_ids]
        if not watched:  # the same on every rank: then no rank waits for the others
            return
        timed_out = set(self._agree_on_rids([r.rid for r in watched if r.stop_regex_timed_out]))
        for req in watched:
            if req.rid in timed_out and not req.stop_regex_timed_out:
                req.finished_reason = FinishReason.refused("sampling_params.stop_regex: the search ran out of time")
                req.stop_regex_timed_out = True
            elif req.stop_regex_timed_out and req.rid not in timed_out:
                req.finished_reason, req.stop_regex_timed_out = None, False
                req.check_finished(self.tokenizer, self.context_len, regex_timeout_s=RECHECK_REGEX_TIMEOUT_S)

    def _release_deferred(self, req: Req) -> None:
        if req.kv_inflight == 0:
            self._deferred.remove(req)
            self.tree_cache.cache_finished_req(req)

    def _append_sampled(self, req: Req, tok: int, sample: SampleOutput, i: int) -> None:
        """``append_token`` with row ``i`` of a batch's sampled logprobs."""
        logprob = top = by_ids = None
        if req.return_logprob and sample.next_token_logprobs is not None:
            logprob = float(sample.next_token_logprobs[i])
            if sample.top_logprobs_val is not None:
                top = list(zip(sample.top_logprobs_val[i], sample.top_logprobs_idx[i]))
            if sample.token_ids_logprobs_val is not None and req.token_ids_logprob is not None:
                by_ids = list(zip(sample.token_ids_logprobs_val[i], req.token_ids_logprob))
        self.append_token(req, tok, logprob, top, by_ids)

    def append_token(self, req: Req, tok: int, logprob: float | None = None, top: list | None = None,
                     by_ids: list | None = None) -> None:
        """Append ``tok`` to ``req``'s output with the logprobs it asked for
        (``logprob``; ``top``, its top logprobs as (logprob, id); ``by_ids``,
        those of its ``token_ids_logprob``: each None where not known), count
        it and check its stop conditions. Every output token goes through
        here, a sampled one or one a prefill server sent."""
        req.output_ids.append(tok)
        self.stats.generated += 1
        if req.return_logprob and logprob is not None:
            req.output_token_logprobs.append((logprob, tok))
            if req.top_logprobs_num and top is not None:
                req.output_top_logprobs.append(top)
            if req.token_ids_logprob is not None and by_ids is not None:
                req.output_token_ids_logprobs.append(by_ids)
        req.check_finished(self.tokenizer, self.context_len)

    def _update_running(self, mode: ForwardMode, updated: list[Req], prefilled: list[Req]) -> None:
        for req in (r for r in updated if r.finished()):
            if req.kv_inflight:  # a queued decode still writes its KV
                self._deferred.append(req)
            else:
                self.tree_cache.cache_finished_req(req)  # it stays reusable, evictable
        self.running_batch.filter_batch()
        if mode == ForwardMode.DECODE:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY, MIN_NEW_TOKEN_RATIO)
        else:
            # Cache each prefilled prompt now, not at the end: later requests
            # sharing it reuse its KV while it is still decoding.
            for req in prefilled:
                if not req.finished():
                    self.tree_cache.cache_unfinished_req(req)

    def _process_aborts(self) -> list[Req]:
        """Finish running requests marked ``to_abort`` before the next batch."""
        out = [r for r in self.running_batch.reqs if r.to_abort]
        if out:
            self.running_batch.filter_batch(lambda r: not r.to_abort)
            self.decode_sampling.invalidate()
        for req in out:
            req.finished_reason = FinishReason.aborted("aborted by request")
            self.tree_cache.cache_finished_req(req)
        return out
