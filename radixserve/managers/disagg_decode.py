"""The decode server's side of prefill/decode disaggregation (SGLang's
``SchedulerDisaggregationDecodeMixin``, as a part the Scheduler holds in
``Scheduler.disagg``; docs/disaggregation.md).

A request that names a bootstrap room is not prefilled here. It goes through:

1. the prealloc queue: it gets a KV receiver (the transfer backend's) at once
   (which looks the prefill rank up and pairs with it in the backend's threads).
   Once paired, and in arrival order, it is given a request row and KV
   slots for its prompt; when the pool cannot hold them beside the expected
   output of the running requests and its own (``PrefillAdder``'s estimate)
   it waits there: backpressure, nothing dropped;
2. the transfer queue: the receiver has named those pages to the prefill
   side (``init``) and is polled, without blocking, each step;
3. on Success the prompt's KV and the first token are in place: the token is
   its first output (streamed like any other), the prompt is cached in the
   tree, and it joins the running batch, which decodes it as usual. On
   Failed it ends with an abort that says why and its slots and row are
   freed (the receiver never writes them after Failed).

Requests without a room are served here from start to end, as on a plain server.

Under tensor parallelism every rank's scheduler holds these queues and a
KV manager of its own: each rank pairs with the prefill ranks that hold its
KV heads, whatever the prefill server's tp size (``disaggregation/head_map.py``;
at equal sizes, the prefill rank of the same TP rank), and receives its heads
from each. The pools' slots are the same on every rank, so each reserves the
same pages; the receivers' states are agreed over the TP group
(``agree_polls``), so a request is reserved for, joins the running batch or
ends in the same step on every rank.

Under ``--dp-size`` on either server, each rank's KV manager links to the
prefill server's replica (dp group) each room lives on
(``disaggregation/link_table.py``); this server's own replicas take
requests as a plain server's do.
"""

from __future__ import annotations

import logging

import torch

from radixserve.disaggregation.base import DisaggregationMode, KVPoll
from radixserve.disaggregation.utils import slots_to_pages
from radixserve.managers.disagg_queues import DisaggregationQueues, agree_polls
from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.managers.schedule_policy import PrefillAdder
from radixserve.mem_cache import page_aligned

logger = logging.getLogger(__name__)


class DecodeDisaggregation(DisaggregationQueues):
    """The decode server's queues of a :class:`Scheduler` (``s``, whose pools,
    cache and running batch it uses)."""

    mode = DisaggregationMode.DECODE

    def __init__(self, scheduler):
        super().__init__(scheduler)
        self.prealloc_queue: list[Req] = []  # waiting for the pairing, then for KV room
        self.transfer_queue: list[Req] = []  # KV reserved, being received

    def queued(self) -> list[Req]:
        return self.prealloc_queue + self.transfer_queue

    def holding(self) -> list[Req]:
        return self.transfer_queue

    def add(self, req: Req) -> None:
        req.kv_receiver = self.kv_classes["receiver"](self.kv_manager, req.bootstrap_addr, req.bootstrap_room)
        self.prealloc_queue.append(req)

    def poll(self) -> list[Req]:
        """Reserve KV for paired requests (in order, while it fits), and move
        finished transfers on. Returns the requests that got their first
        token or ended."""
        polled, first = list(self.transfer_queue), len(self.prealloc_queue)  # those reserved below: from the next step
        polls = agree_polls(self.s.tp_group, [r.kv_receiver for r in self.prealloc_queue + polled])
        out, waiting, blocked = [], [], False
        budget = self._kv_budget()
        for req, (state, failure) in zip(self.prealloc_queue, polls):
            if state == KVPoll.Failed:
                out.append(self._end_decode_transfer(req, FinishReason.failed(failure)))
            elif state == KVPoll.Bootstrapping or blocked:
                waiting.append(req)
            elif self._reserve_prompt_kv(req, budget):
                self.transfer_queue.append(req)
            else:  # the pool is full: this request, and the paired ones after it, wait
                blocked = True
                waiting.append(req)
        self.prealloc_queue = waiting
        transferring = []
        for req, (state, failure) in zip(polled, polls[first:]):
            if state == KVPoll.Success:
                out.append(self._join_running(req))
            elif state == KVPoll.Failed:
                out.append(self._end_decode_transfer(req, FinishReason.failed(failure)))
            else:
                transferring.append(req)
        self.transfer_queue = transferring + self.transfer_queue[len(polled):]
        return out

    def _kv_budget(self) -> PrefillAdder:
        """What this step's reservations may take: ``PrefillAdder``'s budget,
        free and evictable KV less the estimated future output (by
        ``new_token_ratio``) of the running requests and of those being
        received, which join them. So a request taken in has room to decode,
        rather than being retracted soon after and prefilled again here."""
        s = self.s
        return PrefillAdder(s.tree_cache, s.allocator.available_size(), s.running_batch.reqs + self.transfer_queue,
                            s.new_token_ratio, max_prefill_tokens=0, chunked_prefill_size=0, max_new_reqs=0,
                            page_size=s.page_size)

    def _reserve_prompt_kv(self, req: Req, budget: PrefillAdder) -> bool:
        """Give ``req`` a row and slots for its prompt and tell the prefill
        side where to write; False (nothing taken) when they do not fit
        ``budget`` beside its own estimated output (``PrefillAdder.reserve``)."""
        s = self.s
        n, page = len(req.origin_input_ids), s.page_size
        if s.rows_held() >= s.max_running or s.req_to_token_pool.available_size() < 1:
            return False
        if not budget.reserve(req, n):
            return False
        slots = s.pools.alloc_with_evict(page_aligned(n, page), lambda: s.allocator.alloc(n))
        if slots is None:
            return False
        req.req_pool_idx = s.req_to_token_pool.alloc(1)[0]
        s.req_to_token_pool.write(req.req_pool_idx, 0, slots)
        req.kv_len, req.last_node = n, getattr(s.tree_cache, "root", None)
        req.aux_index = self.aux_rows.alloc()
        req.kv_receiver.init(slots_to_pages(slots, page), req.aux_index)
        return True

    def _join_running(self, req: Req) -> Req:
        """The prompt's KV has arrived: the first token becomes the request's
        first output, and it decodes from there."""
        s = self.s
        tok, logprob, top = self.metadata.get(req.aux_index)
        self._release_receiver(req)
        s.worker.last_token[req.req_pool_idx] = tok  # a decode reads its input id there
        s.append_token(req, tok, logprob, top)
        if req.finished():
            s.tree_cache.cache_finished_req(req)
        else:
            s.tree_cache.cache_unfinished_req(req)  # later requests share the prompt
            s.running_batch.merge_batch([req])
        return req

    def _end_decode_transfer(self, req: Req, reason: FinishReason) -> Req:
        """End a request whose KV did not arrive; free what was reserved."""
        req.finished_reason = reason
        self._release_receiver(req)
        if req.req_pool_idx is not None:
            pool = self.s.req_to_token_pool
            self.s.allocator.free(pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64))
            pool.free(req.req_pool_idx)
            req.req_pool_idx, req.kv_len, req.last_node = None, 0, None
        return req

    def _release_receiver(self, req: Req) -> None:
        req.kv_receiver.clear()
        req.kv_receiver = None
        if req.aux_index is not None:
            self.aux_rows.free(req.aux_index)
            req.aux_index = None

    def abort(self, rid: str) -> bool:
        """Abort a request waiting for its KV: the prefill side is told, and
        what was reserved comes back at once."""
        for queue in (self.prealloc_queue, self.transfer_queue):
            for i, req in enumerate(queue):
                if req.rid == rid:
                    queue.pop(i)
                    req.kv_receiver.abort()
                    ended = self._end_decode_transfer(req, FinishReason.aborted("aborted by request"))
                    self.s.finish_outside_batch(ended)
                    return True
        return False
