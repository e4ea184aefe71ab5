"""The prefill server's side of prefill/decode disaggregation (SGLang's
``SchedulerDisaggregationPrefillMixin``, as a part the Scheduler holds in
``Scheduler.disagg``; docs/disaggregation.md).

A request that names a bootstrap room goes through:

1. the bootstrap queue: it gets a KV sender (the transfer backend's), polled each step
   until the decode server has registered the room's pages and the two ranks
   are paired (WaitingForInput); then it joins the waiting queue;
2. admission and prefill, as any request, with the radix cache;
3. the in-flight queue: once its first token is sampled it does not join the
   running batch. Its prompt's KV pages (read from ``req_to_token``) and the
   first token with its logprob and top logprobs are sent to the pages the
   decode side named, its prompt is cached (and locked) in the tree, and its
   sender is polled, without blocking, each step;
4. on Success it finishes with that one token (as SGLang's prefill server
   answers), on Failed with an abort that says why. Only then is its KV
   given to the cache (``cache_finished_req``).

Requests without a room are served here from start to end, as on a plain server.

Under tensor parallelism every rank's scheduler holds these queues, with a
KV manager of its own registered under its TP rank; each rank sends the
decode ranks that register a room with it the KV heads each asked for (at
equal tp sizes, all its heads to the decode rank of the same TP rank). The
senders' states are agreed over the TP group (``agree_polls``) wherever a
request moves on, so that the ranks' queues and batches stay the same.

Under ``--dp-size`` each replica's ranks register under their replica's dp
group too, and the TokenizerManager sends a request with a room to replica
``room % dp_size``, where the decode side looks for it.
"""

from __future__ import annotations

import logging

from radixserve.disaggregation.base import DisaggregationMode, KVPoll
from radixserve.disaggregation.bootstrap import join_address, split_address
from radixserve.disaggregation.utils import local_address, slots_to_pages
from radixserve.managers.disagg_queues import DisaggregationQueues, agree_polls
from radixserve.managers.schedule_batch import FinishReason, Req

logger = logging.getLogger(__name__)


class PrefillDisaggregation(DisaggregationQueues):
    """The prefill server's queues of a :class:`Scheduler` (``s``, whose pools,
    cache and queues it uses); its KV manager registers at once with the
    bootstrap server that this server's HTTP process (on node 0) runs."""

    mode = DisaggregationMode.PREFILL

    def __init__(self, scheduler):
        args = scheduler.args
        # node 0 runs the bootstrap server; a rank on another node (--nnodes) reaches it at --dist-init-addr's host
        host = local_address(args.host) if args.node_rank == 0 else split_address(args.dist_init_addr)[0]
        super().__init__(scheduler, join_address(host, args.disaggregation_bootstrap_port))
        self.bootstrap_queue: list[Req] = []  # waiting for the decode side to register the room
        self.inflight_queue: list[Req] = []  # prefilled, KV being sent

    def queued(self) -> list[Req]:
        return self.bootstrap_queue + self.inflight_queue

    def holding(self) -> list[Req]:
        return self._prefilling() + self.inflight_queue

    def _prefilling(self) -> list[Req]:
        """Requests with a room whose prompt's last chunk is in flight under
        overlap scheduling: their first token comes back next step, and
        until then they are in no queue but hold their KV."""
        return [r for r in self.s.in_flight_reqs() if r.kv_sender is not None and not r.is_chunked]

    def add(self, req: Req) -> None:
        req.kv_sender = self.kv_classes["sender"](self.kv_manager, req.bootstrap_addr, req.bootstrap_room)
        self.bootstrap_queue.append(req)

    def poll(self) -> list[Req]:
        """Bootstrapped requests to the waiting queue; finished transfers
        end their requests. Returns the requests that ended."""
        polls = agree_polls(self.s.tp_group, [r.kv_sender for r in self.bootstrap_queue + self.inflight_queue])
        out, bootstrapping = [], []
        for req, (state, failure) in zip(self.bootstrap_queue, polls):
            if state == KVPoll.Failed:
                self._end_prefill_transfer(req, FinishReason.failed(failure))
                out.append(req)
            elif state == KVPoll.Bootstrapping:
                bootstrapping.append(req)
            else:
                self.s.enqueue(req)
        in_flight = []
        for req, (state, failure) in zip(self.inflight_queue, polls[len(self.bootstrap_queue):]):
            if state == KVPoll.Success:
                self._end_inflight(req, req.disagg_finish)
            elif state == KVPoll.Failed:
                self._end_inflight(req, FinishReason.failed(failure))
            else:
                in_flight.append(req)
                continue
            out.append(req)
        self.bootstrap_queue, self.inflight_queue = bootstrapping, in_flight
        return out

    def hand_off_prefilled(self, updated: list[Req], prefilled: list[Req]) -> list[Req]:
        """Send the KV of the requests with a room whose prompt was just
        prefilled, and keep them, unfinished, in the in-flight queue (the
        caller caches their prompts); returns ``updated`` without them."""
        prefilled_ids = {id(r) for r in prefilled}
        ready = []
        for req in updated:
            if req.kv_sender is None:
                continue
            if not req.output_ids or (req.finished() and req.finished_reason.type == "abort"):
                req.kv_sender.abort()  # nothing to send: the decode side is told
                req.kv_sender.clear()
            elif id(req) in prefilled_ids:
                ready.append(req)
        # polled once more: the decode side may have given the room up meanwhile
        for req, (state, failure) in zip(ready, agree_polls(self.s.tp_group, [r.kv_sender for r in ready])):
            if state == KVPoll.Failed:  # it stays in ``updated``, finished: the caller caches its KV
                self._end_prefill_transfer(req, FinishReason.failed(failure))
            else:
                self._send_prompt_kv(req)  # unfinished until the transfer ends
        leaving = {id(r) for r in ready if not r.finished()}
        return [r for r in updated if id(r) not in leaving]

    def _send_prompt_kv(self, req: Req) -> None:
        tok = req.output_ids[-1]
        logprob = req.output_token_logprobs[-1][0] if req.output_token_logprobs else 0.0
        top = req.output_top_logprobs[-1] if req.output_top_logprobs else []
        req.aux_index = self.aux_rows.alloc()
        self.metadata.set(req.aux_index, tok, logprob, top)
        slots = self.s.req_to_token_pool.req_to_token[req.req_pool_idx, : len(req.origin_input_ids)]
        pages = slots_to_pages(slots, self.s.page_size)
        req.kv_sender.init(len(pages), req.aux_index)
        try:
            req.kv_sender.send(pages)
        except ValueError:  # the sender has failed the room; the next poll reports it
            logger.exception("request %s: bad page indices", req.rid)
        req.disagg_finish = req.finished_reason or FinishReason.at_length(len(req.output_ids))
        req.finished_reason = None  # until the transfer ends
        self.inflight_queue.append(req)

    def _end_prefill_transfer(self, req: Req, reason: FinishReason) -> None:
        req.finished_reason = reason
        req.kv_sender.clear()
        if req.aux_index is not None:
            self.aux_rows.free(req.aux_index)
            req.aux_index = None

    def _end_inflight(self, req: Req, reason: FinishReason) -> None:
        """End a request of the in-flight queue; its KV goes to the cache."""
        self._end_prefill_transfer(req, reason)
        self.s.tree_cache.cache_finished_req(req)

    def abort(self, rid: str) -> bool:
        """Abort a request still bootstrapping, one whose prefill is in
        flight (marked, as a running request is) or one whose KV is being
        sent. The latter ends at once too: ``send()`` copied its pages out,
        so its KV goes to the cache now. In both queues the decode side is
        told, and its half ends at once (``TorchDistKVSender.abort``)."""
        for req in self._prefilling():
            if req.rid == rid:  # ends when its batch's results are processed: nothing is sent
                req.to_abort = True
                return True
        ends = ((self.bootstrap_queue, self._end_prefill_transfer), (self.inflight_queue, self._end_inflight))
        for queue, end in ends:
            for i, req in enumerate(queue):
                if req.rid == rid:
                    queue.pop(i)
                    req.kv_sender.abort()  # once sent, the data still goes, into buffers the decode side drops
                    end(req, FinishReason.aborted("aborted by request"))
                    self.s.finish_outside_batch(req)
                    return True
        return False
