"""The Scheduler: waiting queue, running batch, admission, retraction and the
event loop (one step = schedule, run, process results). Request intake is in
``scheduler_input_mixin.py``, result processing in
``scheduler_output_processor_mixin.py``; docs/architecture.md describes a step."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import msgpack

from radixserve.lora.options import LORA_NOT_ENABLED
from radixserve.lora.slots import LoRASlotTable
from radixserve.managers.decode_sampling import DecodeSamplingState
from radixserve.managers.disagg_decode import DecodeDisaggregation
from radixserve.managers.disagg_prefill import PrefillDisaggregation
from radixserve.managers.disagg_queues import DisaggregationRole
from radixserve.managers.grammar_queue import GrammarQueue
from radixserve.managers.prefix_groups import PrefixGrouper
from radixserve.managers.profiler import phase
from radixserve.managers.schedule_batch import RETRACT_DECODE_STEPS, KVPools, Req, ScheduleBatch
from radixserve.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddResult, PrefillAdder, SchedulePolicy, mixed_step_budget
from radixserve.managers.scheduler_input_mixin import SchedulerInputMixin
from radixserve.managers.scheduler_memory_mixin import SchedulerMemoryMixin
from radixserve.managers.scheduler_output_processor_mixin import Launched, SchedulerOutputProcessorMixin
from radixserve.managers.scheduler_pp_mixin import SchedulerPipelineMixin
from radixserve.managers.tp_worker import TpModelWorker
from radixserve.mem_cache import check_memory_invariant
from radixserve.mem_cache.factory import build_tree_cache
from radixserve.mem_cache.kv_events import ZmqEventPublisher
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
# Runs overlap scheduling's bookkeeping on a CPU too, where the forward is
# synchronous (nothing overlaps): tests use it to check it on servers.
OVERLAP_ON_CPU_ENV = "RADIXSERVE_OVERLAP_ON_CPU"
DISAGG_POLL_S = 0.001  # the pause of a step that has only KV transfers to poll


def retracted_token_ratio(running: list[Req]) -> float:
    """``new_token_ratio`` after a retraction (the share of a running
    request's remaining output that admission reserves,
    ``PrefillAdder.future_tokens``), as SGLang sets it: what the requests
    left running have decoded plus ``RETRACT_DECODE_STEPS`` each, over their
    output budgets (each clipped as admission clips it), at most 1."""
    budget = sum(min(r.sampling_params.max_new_tokens, CLIP_MAX_NEW_TOKENS) for r in running)
    if budget <= 0:
        return INIT_NEW_TOKEN_RATIO
    return min(1.0, (sum(len(r.output_ids) for r in running) + RETRACT_DECODE_STEPS * len(running)) / budget)


@dataclass
class SchedulerStats:
    """Counters since the scheduler started (``get_stats``; /metrics and
    /get_server_info report them)."""

    forward_ct: int = 0  # forwards run
    retractions: int = 0  # requests sent back to the queue for memory
    prompt_tokens: int = 0  # of every request added
    cached_tokens: int = 0  # of those, found in the prefix cache at first admission
    generated: int = 0  # output tokens


class Scheduler(SchedulerInputMixin, SchedulerOutputProcessorMixin, SchedulerMemoryMixin, SchedulerPipelineMixin):
    """Continuous batching over one ModelRunner.

    Each :meth:`step` runs one batch, an extend (new requests and the next
    chunk of a chunked one) or a decode of the running batch, and returns
    the requests that got new tokens or finished in it. docs/architecture.md
    ("A scheduler step") describes it: overlap scheduling (``overlap``, on by
    default on CUDA: a batch's results come back in the next step, and
    ``_deferred`` keeps finished requests whose last forward is in flight),
    structured output (``grammar_queue``) and retraction.

    KV events (``kv_event_publisher``, docs/kv_events.md) go out as one batch
    at the end of each step (and a flush's at once); ``close`` stops the
    publisher. Disaggregation (``disagg``, docs/disaggregation.md): its queues
    are polled at the start of each step. Pipeline stages
    (``scheduler_pp_mixin.py``, docs/pipeline_parallel.md): each step is one
    micro-batch's turn.
    """

    def __init__(self, server_args: ServerArgs, model_runner, tokenizer=None,
                 eos_token_ids: frozenset[int] = frozenset(), kv_event_publisher: ZmqEventPublisher | None = None,
                 dp_rank: int = 0):
        self.args = server_args
        self.dp_rank = dp_rank  # this scheduler's replica under --dp-size
        self.model_runner = model_runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids  # see scheduler_factory.eos_token_ids
        self.device = model_runner.device
        self.tp_group = model_runner.tp_group  # every rank's scheduler must take the same decisions
        self.worker = TpModelWorker(model_runner)
        self.page_size = model_runner.page_size
        self.vocab_size = model_runner.model_config.vocab_size
        self.context_len = model_runner.max_context_len
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.allocator = model_runner.token_to_kv_pool_allocator
        self.kv_event_publisher = kv_event_publisher
        if kv_event_publisher is not None:
            weakref.finalize(self, kv_event_publisher.close)  # dropped without close(): its ports still come back
        self.tree_cache = build_tree_cache(server_args, model_runner, kv_event_publisher, self.worker.forward_stream)
        self.pools = KVPools(self.req_to_token_pool, self.allocator, self.tree_cache, self.page_size, self.device)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache)
        self.max_running = min(server_args.max_running_requests, self.req_to_token_pool.available_size())
        self.chunk_size = server_args.resolved_chunked_prefill_size()
        self.waiting: list[Req] = []
        # waiting for their grammar to compile
        self.grammar_queue = GrammarQueue(tokenizer, self.vocab_size, server_args.grammar_cache_max_mb << 20)
        self.running_batch = ScheduleBatch([], ForwardMode.DECODE, self.pools, self.vocab_size)
        if server_args.enable_prefix_grouped_decode:  # docs/prefix_grouped_decode.md
            self.running_batch.prefix_grouper = PrefixGrouper(self.page_size)
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.decode_sampling = DecodeSamplingState(self.vocab_size, self.device)
        self._finished_outside_batch: list[Req] = []
        # Overlap: the batch queued on the device whose results the next step
        # takes, and finished requests whose last KV slot a queued forward writes.
        # (Pipeline stages overlap by micro-batches instead.)
        self.overlap = not server_args.disable_overlap_schedule and model_runner.pp_group.size == 1 and (
            self.device.type == "cuda" or os.environ.get(OVERLAP_ON_CPU_ENV) == "1")
        self._in_flight: Launched | None = None
        self._deferred: list[Req] = []
        self.stats = SchedulerStats()
        # --enable-lora: which adapter holds which device slot (docs/lora.md)
        manager = model_runner.lora_manager
        self.lora_slots = LoRASlotTable(manager.num_slots) if manager is not None else None
        self.offload_tags: set[str] = set()  # memory released (scheduler_memory_mixin.py): nothing runs until resumed
        # the prefill or decode server's queues and KV manager; a plain server's does nothing
        self.disagg: DisaggregationRole = DisaggregationRole()
        if server_args.disaggregation_mode == "prefill":
            self.disagg = PrefillDisaggregation(self)
        elif server_args.disaggregation_mode == "decode":
            self.disagg = DecodeDisaggregation(self)
        self._init_pipeline(model_runner.pp_group, server_args.resolved_pp_micro_batches())
        self.micro_batch_cap = server_args.resolved_pp_max_micro_batch_size()  # requests per micro-batch

    def is_idle(self) -> bool:
        # a request aborted while waiting is only handed back by the next step
        return not (self.waiting or self.grammar_queue or self.running_batch.reqs or self.chunked_req
                    or self._in_flight or self._finished_outside_batch or self.tree_cache.busy()
                    or self.disagg.queued() or self.pipeline_busy())

    def live_reqs(self) -> list[Req]:
        """Requests holding KV: running, chunked, finished ones waiting for
        their last forward, and those whose KV is being sent or received."""
        return (self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else []) + self._deferred
                + self.disagg.holding() + self.parked_reqs())

    def rows_held(self) -> int:
        """Requests that count against ``--max-running-requests``: running,
        finished ones waiting for their last forward, and those whose KV is
        being sent or received, and the other micro-batches' requests (this
        one's chunked prompt is counted by admission)."""
        return len(self.running_batch) + len(self._deferred) + len(self.disagg.holding()) + len(self.parked_reqs())

    def in_flight_reqs(self) -> list[Req]:
        """The requests of the batch queued on the device, whose results the
        next step takes (none without overlap)."""
        return self._in_flight.reqs if self._in_flight is not None else []

    def finish_outside_batch(self, req: Req) -> None:
        """Hand ``req``, finished outside any batch (an abort, a transfer's
        end), back with the next step's results."""
        self._finished_outside_batch.append(req)

    def check_memory(self) -> None:
        check_memory_invariant(self.allocator, self.tree_cache, self.live_reqs())

    # -- the loop --------------------------------------------------------------
    def step(self) -> list[Req]:
        """Run one batch; returns the requests updated in it (finished ones too).
        With overlap, a batch's results come back in the next step; on a
        pipeline stage, in the micro-batch's next turn."""
        if self.micro_batches:
            return self.pp_step()
        if "kv_cache" not in self.offload_tags:  # a released pool maps nothing
            # an elastic pool gives back empty pages, keeps its reserve
            self.allocator.rebalance(self.tree_cache.evict, busy=self._in_flight is not None)
        out = self._drain() if self._in_flight and self._must_drain() else []
        self.tree_cache.poll()  # copies between cache tiers that have finished
        out += self._process_aborts()
        out += self.disagg.poll()
        if self.grammar_queue:
            ready, failed = self.grammar_queue.pop_compiled(self._agree_on_rids)
            self.waiting += ready
            out += failed
        batch = self.get_next_batch_to_run()
        if batch is None and not self._in_flight:  # only compilations, cache copies or transfers to wait for
            if self.grammar_queue:
                self.grammar_queue.wait()
            elif self.disagg.queued():
                time.sleep(DISAGG_POLL_S)
            else:
                self.tree_cache.wait()
        out += self._finished_outside_batch
        self._finished_outside_batch = []
        previous, self._in_flight = self._in_flight, None
        if batch is not None:
            launched = self.launch_batch(batch)
            if previous is not None and self.grammar_queue.constrained(batch.reqs):
                # The token masks need the tokens of the batch in flight: take
                # them while this batch's forward runs, then queue its sampling.
                out += self._process(previous)
                previous = None
            self._launch_sample(launched)
            if self.overlap:
                self._in_flight = launched
            else:
                out += self._process(launched)
        if previous is not None:
            out += self._process(previous)
        if self._in_flight and self.running_batch.is_empty() and self.chunked_req is None and not self.waiting:
            out += self._drain()  # no batch follows it soon (it writes finished requests' last KV, or prompts to send)
        self.release_unloaded_loras()
        if self.args.check_invariants or self.is_idle():
            self.check_memory()
        self._publish_kv_events()
        return out

    def _publish_kv_events(self) -> None:
        recorder = getattr(self.tree_cache, "kv_events", None)
        if recorder is not None:
            self.kv_event_publisher.publish(recorder.take())

    def _agree_on_rids(self, rids: list[str]) -> list[str]:
        """Rank 0's ``rids`` on every rank (a decision that depends on timing,
        such as which grammars have compiled, is rank 0's): broadcast over
        the first stage's TP group, relayed down the pipeline."""
        if self.tp_group.size == 1 and self.pp.size == 1:
            return rids
        packed = None
        if self.pp.is_first:
            packed = msgpack.packb(rids) if self.tp_group.rank == 0 else None
            packed = self.tp_group.broadcast_bytes(packed)
        return msgpack.unpackb(self.pp.relay(packed))

    def _drain(self) -> list[Req]:
        launched, self._in_flight = self._in_flight, None
        return self._process(launched)

    def _must_drain(self) -> bool:
        """Whether the next batch needs the host to be up to date: an abort,
        or a decode that may need eviction or retraction. (The next chunk of
        a prompt does not: it starts at ``kv_end``, after the chunk in flight.)"""
        if (self.chunked_req and self.chunked_req.to_abort) or any(r.to_abort for r in self.running_batch.reqs):
            return True
        return self.allocator.available_size() < self.pools.decode_pages_needed(self.running_batch.reqs)

    @phase("scheduler.next_batch")
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        """A prefill if one can be admitted, else a decode of the running requests."""
        batch = self.get_new_batch_prefill()
        running = self.running_batch
        if running.is_empty():  # no row is needed (and none piles up on a prefill server)
            self.decode_sampling.invalidate()
        if batch is not None or running.is_empty():
            return batch
        self._ensure_decode_memory()
        if running.is_empty():
            return None
        running.reqs = self.decode_sampling.sync(running.reqs, self.worker.last_token)  # rows in the state's order
        running.prepare_for_decode()
        return running

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        if not self.waiting and self.chunked_req is None:
            return None
        if self.allocator.over_limit() or self.offload_tags:  # a KV limit lowered below use, or memory released
            return None
        free_rows = self.max_running - self.rows_held()  # the chunked request, if any, is in can_run
        if self.micro_batches:  # this micro-batch's share, so that a burst spreads over the micro-batches
            free_rows = min(free_rows, self.micro_batch_share() - len(self.running_batch))
        riders = len(self.running_batch) if self.args.enable_mixed_chunk else 0  # see PrefillAdder
        chunk = self.chunk_size if not (riders and self.args.mixed_chunk_min_size) else mixed_step_budget(
            riders, self.waiting, self.chunked_req, self.args.mixed_chunk_min_size, self.chunk_size)
        adder = PrefillAdder(
            self.tree_cache, self.allocator.available_size(), self.running_batch.reqs + self.parked_reqs(),
            self.new_token_ratio,
            self.args.max_prefill_tokens, chunk, max(free_rows, 0), self.page_size, riders, self.pools.can_back,
        )
        continuing = self.chunked_req
        if continuing is not None and not adder.add_chunked_req(continuing):
            return None  # no memory to map for its next chunk now: the running requests decode meanwhile
        sit_out = self.policy.calc_priority(self.waiting)
        admitted = set()
        adapters = self.lora_in_use()
        for req in self.waiting:
            if adder.new_chunked_req is not None:
                break
            if id(req) in sit_out and adder.can_run:
                continue
            if self.lora_slots is not None and not self.lora_slots.fits(req.lora_id, adapters):
                continue  # its adapter needs a slot that running requests hold; later requests may go
            result = adder.add_one_req(req)
            if result == AddResult.WAIT:
                continue
            if result != AddResult.CONTINUE and req not in adder.can_run:
                break
            admitted.add(id(req))
            if req.lora_id is not None:
                adapters.add(req.lora_id)
        self.waiting = [r for r in self.waiting if id(r) not in admitted]
        for req in adder.can_run:  # count each prompt's cache hit once, at its first admission
            if req is not continuing and req.retractions == 0 and not req.output_ids:
                self.stats.cached_tokens += req.cached_tokens
        self.chunked_req = adder.new_chunked_req
        if not adder.can_run:
            return None
        batch = ScheduleBatch(adder.can_run, ForwardMode.EXTEND, self.pools, self.vocab_size)
        if self._can_mix(batch):  # riders in the decode state's row order (see ``launch_batch``)
            batch.mix_with_running(self.decode_sampling.sync(self.running_batch.reqs, self.worker.last_token))
        batch.prepare_for_extend()
        return batch

    def lora_in_use(self) -> set[str]:
        """The LoRA adapters (uids) of the running and chunked requests: their
        slots stay theirs."""
        reqs = self.running_batch.reqs + ([self.chunked_req] if self.chunked_req else [])
        return {r.lora_id for r in reqs if r.lora_id is not None}

    def _can_mix(self, batch: ScheduleBatch) -> bool:
        """Whether the running requests decode inside this prefill
        (``--enable-mixed-chunk``): no logprobs are asked (SGLang's condition
        too), and the pool holds their next token beside the prefill without
        retracting. (Their last tokens may still be being sampled: the worker
        reads them on the device.)"""
        running = self.running_batch.reqs
        if not (self.args.enable_mixed_chunk and running):
            return False
        if any(r.return_logprob for r in running + batch.reqs):
            return False
        return self.pools.can_hold(self.pools.extend_slots_needed(batch.reqs, riders=len(running)))

    # -- memory for a batch ------------------------------------------------------
    def _ensure_decode_memory(self) -> None:
        """Make room for one more token per running request (``retract_decode``)."""
        retracted, cut = self.running_batch.retract_decode(others_hold=bool(self.parked_reqs()))
        if retracted:
            self.stats.retractions += len(retracted)
            self.waiting = retracted + self.waiting
            old, self.new_token_ratio = self.new_token_ratio, retracted_token_ratio(self.running_batch.reqs)
            logger.info("retracted %d requests; running %d; new token ratio %.3f -> %.3f", len(retracted),
                        len(self.running_batch), old, self.new_token_ratio)
        if cut is not None:  # one request alone outgrew the pool: ended rather than failed
            self.decode_sampling.invalidate()
            self._finished_outside_batch.append(cut)

    # -- running a batch ----------------------------------------------------------
    @phase("scheduler.launch_forward")
    def launch_batch(self, schedule_batch: ScheduleBatch) -> Launched:
        """Queue the forward of a prepared batch (``_launch_sample`` follows).
        A decode's sampling state is the running batch's; a mixed batch's is
        its new requests' followed by the riders' rows of that state, merged
        on the device behind any update still pending there."""
        reqs, mode = list(schedule_batch.reqs), schedule_batch.forward_mode  # the running batch changes later
        decoding = schedule_batch.decoding_reqs
        state, before = self.decode_sampling, self.decode_sampling.apply_pending
        if mode == ForwardMode.DECODE:
            batch = schedule_batch.get_model_worker_batch(state.info)
        elif decoding:
            info = SamplingBatchInfo.from_reqs(reqs[: len(reqs) - len(decoding)], self.vocab_size, self.device)
            batch, riders = schedule_batch.get_model_worker_batch(info), state.info
            riders_pending = state.replace(reqs, info)  # its rows are the running requests' next state

            def before() -> None:
                for update in riders_pending:
                    update()
                info.merge(riders)
        else:
            batch, before = schedule_batch.get_model_worker_batch(), None
            state.absorb(reqs, batch.sampling_info)  # the prompts that finish join with their rows
        if self.lora_slots is not None:  # every rank assigns alike; its LoRA manager fills the slots
            batch.lora_ids = [r.lora_id for r in reqs]
            batch.lora_slots = self.lora_slots.assign(batch.lora_ids, self.lora_in_use())
        forward = self.worker.launch_forward(batch, before)
        for req, seq in zip(reqs, batch.seq_lens_cpu):
            req.kv_inflight = seq - req.kv_len
        decoding_ids = frozenset(id(r) for r in decoding)
        if mode == ForwardMode.EXTEND:  # finished prompts decode next, their first token still on the device
            self.running_batch.merge_batch([r for r in reqs if not r.is_chunked and id(r) not in decoding_ids
                                            and r.kv_sender is None])  # a prompt with a room is sent instead
        self.stats.forward_ct += 1
        return Launched(reqs, forward, decoding_ids)

    @phase("scheduler.launch_sample")
    def _launch_sample(self, launched: Launched) -> None:
        """Queue the sampling of a launched forward. A batch with grammars
        gets its token mask here, from the matchers as they are now (see ``step``)."""
        reqs, batch = launched.reqs, launched.forward.batch
        if self.pp.is_last:  # only the last pipeline stage has logits
            batch.vocab_mask = self.grammar_queue.vocab_mask(reqs)
            tops = [r.top_logprobs_num if r.return_logprob else 0 for r in reqs]
            by_ids = [r.token_ids_logprob if r.return_logprob else None for r in reqs]
            launched.sampled = self.worker.launch_sample(launched.forward, any(r.return_logprob for r in reqs), tops,
                                                         self.grammar_queue.apply, by_ids)
        if self.micro_batches:
            self.pp_sample(launched)

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests run."""
        if not self.is_idle():
            return False
        self.tree_cache.reset()
        if "kv_cache" not in self.offload_tags:  # a released pool is empty already, and maps nothing
            self.allocator.clear()
        self.grammar_queue.clear_cache()
        self._publish_kv_events()
        return True

    def kv_limit(self, apply: bool, limit_bytes: int | None) -> tuple[bool, str, dict]:
        """Read, or set and apply at once, the elastic KV pool's run-time
        limit (docs/elastic_kv.md): ``(ok, message, figures)``."""
        if not self.allocator.elastic:
            return False, "a KV limit needs the elastic KV pool (--enable-elastic-kv)", {}
        if apply:
            self.allocator.set_limit_bytes(limit_bytes)
            if "kv_cache" not in self.offload_tags:  # else applied when the KV is resumed
                self.allocator.apply_limit(self.tree_cache.evict)
        return True, "", self.allocator.limit_state()

    # -- LoRA adapters loaded and unloaded while serving (docs/lora.md) -----------------
    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str, dict[str, str]]:
        """Read the PEFT adapter at ``path`` as ``name`` (every rank alike):
        ``(ok, message, the adapters loaded: name -> folder)``; nothing changes on failure."""
        return self._lora_update(lambda manager: manager.load(name, path))

    def unload_lora_adapter(self, name: str) -> tuple[bool, str, dict[str, str]]:
        """Unload adapter ``name``: new requests cannot name it; the requests
        that hold it run to their end, then its slot and host copy are freed
        (``release_unloaded_loras``). Its cached KV is never matched again
        (its uid is gone) and is evicted as any other."""
        return self._lora_update(lambda manager: manager.unload(name))

    def _lora_update(self, change) -> tuple[bool, str, dict[str, str]]:
        manager = self.model_runner.lora_manager
        if manager is None:
            return False, LORA_NOT_ENABLED, {}
        try:
            change(manager)
        except ValueError as exc:
            return False, str(exc), manager.loaded()
        self.release_unloaded_loras()
        return True, "", manager.loaded()

    def release_unloaded_loras(self) -> None:
        """Free the slot and host copy of every unloaded adapter that no request holds any more."""
        manager = self.model_runner.lora_manager
        if manager is None or not manager.unloading:
            return
        reqs = (self.waiting + self.grammar_queue.reqs + self.live_reqs() + self.in_flight_reqs()
                + self._finished_outside_batch)
        for uid in manager.unloading - {r.lora_id for r in reqs}:
            manager.release(uid)
            self.lora_slots.release(uid)

    def close(self) -> None:
        """Stop publishing KV events (sends what is queued, closes the sockets),
        finish the cache tiers' copies (the file tier's writes land) and
        close the disaggregation KV manager (its transfers fail), and leave
        the elastic KV registry."""
        self.tree_cache.close()
        self.allocator.close()
        self.disagg.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()

    def get_stats(self) -> dict[str, Any]:
        running = len(self.running_batch) + sum(len(mb.running_batch) for mb in self.parked())  # every micro-batch's
        return dict(dataclasses.asdict(self.stats), running=running, waiting=len(self.waiting) + len(self.grammar_queue),
                    kv_free=self.allocator.available_size(), kv_cached=self.tree_cache.total_size(),
                    **self.tree_cache.tier_stats(), **self.grammar_queue.cache_stats(),
                    **self.allocator.pool_stats(), **self.model_runner.expert_load_stats(),
                    **(self.kv_event_publisher.drop_stats() if self.kv_event_publisher is not None else {}))
