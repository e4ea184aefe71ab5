"""The Scheduler as a process: receive requests over ZeroMQ, step the
Scheduler, send new tokens to the detokenizer.

With tensor parallelism there is one such process per rank, each with its
own Scheduler over its shard of the model. Only rank 0 has sockets: each
loop iteration it broadcasts the messages it received, as the msgpack bytes
they arrived in, over the TP group's CPU (gloo) group, and every rank handles
the same messages in the same order, so all schedulers take the same
decisions. Only rank 0 answers and sends tokens to the detokenizer.

With pipeline stages (``--pp-size``) the first stage's ranks do this among
themselves, and each then relays the messages to its counterpart on the next
stage, which passes them on (``PPGroup.relay``): every scheduler of every
stage handles the same messages in the same order. Rank 0 (TP rank 0 of the
first stage) still has the sockets: the last stage sends every micro-batch's
tokens back to the first (``scheduler_pp_mixin.py``)."""

from __future__ import annotations

import logging
import os
import time

import msgpack
import torch
import zmq

from radixserve.managers.child_process import ParentWatch, freeze_startup_objects, zmq_context
from radixserve.managers.io_struct import (
    AbortReq,
    BatchTokenIDOut,
    CloseReq,
    FlushCacheReq,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    GiveKVReq,
    KVLimitReq,
    KVLimitReqOutput,
    LoadLoRAAdapterReqInput,
    LoRAUpdateOutput,
    ProfileReq,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    SchedulerStats,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    decode,
    encode,
    pipeline_sockets,
)
from radixserve.managers.profiler import StepProfiler, phase
from radixserve.managers.schedule_batch import FinishReason, Req
from radixserve.managers.scheduler import Scheduler
from radixserve.model_executor.cpu_malloc import HeapTrimmer, heap_figures
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 1000
SHARED_POLL_MS = 25  # the idle wait of a server whose elastic KV pool shares its device with others (an ask waits for it)
STATS_INTERVAL_S = 0.5  # how often a busy scheduler reports its load (for /metrics)
# A request that is not streamed sends its tokens on in batches of this many (and when it ends), as
# SGLang's scheduler does: no one reads them before the end, and every batch costs the detokenizer and
# the tokenizer manager their per-request work.
UNSTREAMED_OUTPUT_INTERVAL = 50


def req_meta(req: Req, sent_logprobs: int, first: bool) -> dict:
    """What the detokenizer and the tokenizer manager need about a request.
    Its decode options go with its ``first`` output only: the detokenizer
    keeps them (``DECODE_OPTIONS``), and the per-step messages stay small."""
    meta = {
        "prompt_tokens": len(req.origin_input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finished_reason.to_json() if req.finished_reason else None,
    }
    if first:
        sp = req.sampling_params
        meta.update(skip_special_tokens=sp.skip_special_tokens,
                    spaces_between_special_tokens=sp.spaces_between_special_tokens, stop=list(sp.stop or []),
                    stop_regex=list(sp.stop_regex or []), no_stop_trim=sp.no_stop_trim)
    if req.return_logprob:
        meta["output_token_logprobs"] = req.output_token_logprobs[sent_logprobs:]
        meta["output_top_logprobs"] = req.output_top_logprobs[sent_logprobs:]
        if req.token_ids_logprob is not None:
            meta["output_token_ids_logprobs"] = req.output_token_ids_logprobs[sent_logprobs:]
        if sent_logprobs == 0:
            meta["input_token_logprobs"] = req.input_token_logprobs
            meta["input_top_logprobs"] = req.input_top_logprobs
            if req.token_ids_logprob is not None:
                meta["input_token_ids_logprobs"] = req.input_token_ids_logprobs
    return meta


class SchedulerProcess:
    """Owns the sockets and the sent-so-far bookkeeping around a Scheduler.

    A message that cannot be decoded is dropped; a request that fails
    validation or raises while being added is answered with an abort; an
    exception inside a step is fatal (the process exits, and the server with
    it), because the batch's KV state can no longer be trusted."""

    def __init__(self, scheduler: Scheduler, recv_addr: str | None, send_addr: str | None,
                 watch: ParentWatch | None = None, dp_rank: int = 0):
        self.scheduler = scheduler
        self.dp_rank = dp_rank
        self.watch = watch
        self.tp, self.pp = scheduler.tp_group, scheduler.pp
        self.leader = self.tp.rank == 0 and self.pp.is_first  # has the sockets; the other ranks follow it
        if self.leader:
            self.recv, self.send = pipeline_sockets(zmq_context(), recv_addr, send_addr)
        self.sent: dict[str, tuple[int, int]] = {}  # rid -> (output ids sent, logprobs sent)
        self._stats_at = 0.0
        self._last_stats: dict | None = None
        replica = f"DP-{dp_rank}-" if scheduler.args.dp_size > 1 else ""
        stage = f"PP-{self.pp.rank}-" if self.pp.size > 1 else ""
        self.profiler = StepProfiler(f"{replica}{stage}TP-{self.tp.rank}", scheduler.device,
                                     scheduler.args.resolved_torch_profiler_dir())
        self.closing = False  # a CloseReq came: close the scheduler and leave the loop
        self.heap = HeapTrimmer()  # the malloc heap's free pages go back when idle, and now and then
        self.shared_kv = getattr(scheduler.allocator, "registry", None) is not None  # other servers may ask for memory

    def event_loop(self) -> None:
        """Until a CloseReq: take messages (a follower: rank 0's broadcast), step, send."""
        while True:
            if self.watch is not None and not self.watch.alive():
                self.watch.exit_orphaned()
            idle = self.scheduler.is_idle() or self.scheduler.held()
            received = self.share(self.receive_all(wait=idle) + self.memory_asked() if self.leader else None)
            if idle and not received:
                if self.leader:  # figures that change while idle (the file tier's writes landing)
                    self.report_stats(only_changes=True)
                continue
            for data in received:
                self.handle_bytes(data)
            if self.closing:
                self.scheduler.close()
                logger.info("closed")  # after its cache tiers' writes
                return
            if not self.scheduler.is_idle():
                outputs = self.scheduler.step()
                if self.leader:
                    self.send_outputs(outputs)
                self.send_replies(self.profiler.step())
                self.heap.busy()
            became_idle = not idle and self.scheduler.is_idle()
            if became_idle:
                self.heap.idle()
            if self.leader:
                self.report_stats(became_idle=became_idle)

    @phase("pp.wait_relay")
    def share(self, received: list[bytes] | None) -> list[bytes]:
        """The leader's ``received`` on every rank: broadcast over the first
        stage's TP group, relayed down the pipeline. A follower waits here,
        at most ``IDLE_POLL_MS`` while the leader is idle."""
        if self.tp.size == 1 and self.pp.size == 1:
            return received
        packed = None
        if self.pp.is_first:
            packed = msgpack.packb(received) if self.leader else None
            if self.tp.size > 1:
                packed = self.tp.broadcast_bytes(packed)
        return msgpack.unpackb(self.pp.relay(packed))

    def receive_all(self, wait: bool) -> list[bytes]:
        """Every message waiting on the socket, after waiting up to
        ``IDLE_POLL_MS`` for one if ``wait``."""
        if wait and not self.recv.poll(SHARED_POLL_MS if self.shared_kv else IDLE_POLL_MS):
            return []
        received = []
        while True:
            try:
                received.append(self.recv.recv(zmq.NOBLOCK))
            except zmq.Again:
                return received

    def memory_asked(self) -> list[bytes]:
        """A ``GiveKVReq`` when other servers on this device asked for KV memory since the last look."""
        sched = self.scheduler
        keep = sched.allocator.pages_to_keep(sched.tree_cache.evictable_size(), sched.is_idle()) if self.shared_kv else None
        return [] if keep is None else [encode(GiveKVReq(keep))]

    def handle_bytes(self, data: bytes) -> None:
        try:
            msg = decode(data)
        except ValueError as exc:
            if self.leader:
                logger.error("dropped a malformed message: %s", str(exc).splitlines()[0])
            return
        self.handle(msg)

    def handle(self, msg) -> None:
        if isinstance(msg, TokenizedGenerateReqInput):
            self.add(msg)
        elif isinstance(msg, AbortReq):
            self.scheduler.abort_request(msg.rid)
        elif isinstance(msg, FlushCacheReq):
            flushed = self.scheduler.flush_cache()  # on every rank: the caches stay the same
            self.send_replies([FlushCacheReqOutput(flushed)])
        elif isinstance(msg, KVLimitReq):  # every rank: their pools stay the same
            ok, message, state = self.scheduler.kv_limit(msg.apply, msg.limit_bytes)
            self.send_replies([KVLimitReqOutput(ok, message, {**state, "dp_rank": self.dp_rank})])
        elif isinstance(msg, (ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput)):  # every rank, alike
            release = isinstance(msg, ReleaseMemoryOccupationReqInput)
            call = self.scheduler.release_memory_occupation if release else self.scheduler.resume_memory_occupation
            ok, message, state = call(msg.tags)
            reply = ReleaseMemoryOccupationReqOutput if release else ResumeMemoryOccupationReqOutput
            self.send_replies([reply(ok, message, {**state, "dp_rank": self.dp_rank})])
        elif isinstance(msg, LoadLoRAAdapterReqInput):  # every rank reads it: their adapters stay the same
            self.send_replies([LoRAUpdateOutput(*self.scheduler.load_lora_adapter(msg.lora_name, msg.lora_path))])
        elif isinstance(msg, UnloadLoRAAdapterReqInput):
            self.send_replies([LoRAUpdateOutput(*self.scheduler.unload_lora_adapter(msg.lora_name))])
        elif isinstance(msg, GiveKVReq):  # every rank: their pools stay the same
            given = self.scheduler.allocator.give(msg.epages, self.scheduler.tree_cache.evict)
            if self.leader and given:
                logger.info("gave %d elastic KV pages to other servers on the device", given)
        elif isinstance(msg, ProfileReq):  # every rank profiles itself
            start = msg.action == "start"
            self.send_replies(self.profiler.start(msg.options, msg.req_id) if start else self.profiler.stop(msg.req_id))
        elif isinstance(msg, CloseReq):
            self.closing = True
        elif isinstance(msg, GetInternalStateReq):
            if self.leader:
                self.send.send(encode(GetInternalStateReqOutput(self.internal_state())))
        else:
            logger.error("dropped a %s: not a message for the scheduler", type(msg).__name__)

    def send_replies(self, replies: list) -> None:
        """Control replies (rank 0 answers for every rank, once every rank
        is done: each computes the same replies, so all reach the barrier)."""
        if replies:  # e.g. every rank's trace written before the answer
            self.scheduler.barrier_all_ranks()
        if self.leader:
            for reply in replies:
                self.send.send(encode(reply))

    def add(self, msg: TokenizedGenerateReqInput) -> None:
        try:
            req = self.scheduler.new_req(msg.rid, msg.input_ids, SamplingParams.from_dict(msg.sampling_params),
                                         msg.return_logprob, msg.logprob_start_len, msg.top_logprobs_num,
                                         msg.token_ids_logprob, msg.lora_path)
            req.bootstrap_addr, req.bootstrap_room = msg.bootstrap_addr, msg.bootstrap_room
            req.output_interval = ((req.sampling_params.stream_interval or self.scheduler.args.stream_interval)
                                   if msg.stream else UNSTREAMED_OUTPUT_INTERVAL)
            self.scheduler.add_request(req)
        except Exception as exc:  # the tokenizer manager validates first; this is the backstop
            if not self.leader:
                return
            logger.error("request %s refused: %s", msg.rid, exc)
            req = Req(msg.rid, msg.input_ids or [0], SamplingParams())
            req.finished_reason = FinishReason.refused(f"invalid request: {exc}")
            self.send_outputs([req])

    def send_outputs(self, reqs: list[Req]) -> None:
        if not reqs:
            return
        rids, new_ids, metas = [], [], []
        for req in reqs:
            first = req.rid not in self.sent
            n_ids, n_lp = self.sent.get(req.rid, (0, 0))
            if n_ids and not req.finished() and len(req.output_ids) - n_ids < req.output_interval:
                continue  # the first token goes at once (TTFT), then every output_interval tokens, and the end
            rids.append(req.rid)
            new_ids.append(req.output_ids[n_ids:])
            metas.append(req_meta(req, n_lp, first))
            if req.finished():
                self.sent.pop(req.rid, None)
            else:
                self.sent[req.rid] = (len(req.output_ids), len(req.output_token_logprobs))
        if rids:
            self.send.send(encode(BatchTokenIDOut(rids, new_ids, metas)))

    def report_stats(self, became_idle: bool = False, only_changes: bool = False) -> None:
        """Send the load figures when due (with ``only_changes``, when they
        differ from the last sent), so that /metrics never has to ask."""
        now = time.monotonic()
        if became_idle or now - self._stats_at >= STATS_INTERVAL_S:
            self._stats_at = now
            state = self.load_stats()
            if only_changes and state == self._last_stats:
                return
            self._last_stats = state
            self.send.send(encode(SchedulerStats(state)))

    def load_stats(self) -> dict:
        """Counters and gauges: cheap, computed at any time."""
        sched = self.scheduler
        state = sched.get_stats()
        state["dp_rank"] = self.dp_rank
        state["max_total_tokens"] = sched.allocator.size
        state["kv_used"] = sched.allocator.size - sched.allocator.free_size() - sched.tree_cache.evictable_size()
        state["kv_usage"] = state["kv_used"] / sched.allocator.size
        state["waiting_tokens"] = sum(len(r.origin_input_ids) for q in (sched.waiting, sched.grammar_queue.reqs) for r in q)
        state["cache_hit_rate"] = state["cached_tokens"] / max(state["prompt_tokens"], 1)
        return state

    def internal_state(self) -> dict:
        """The load figures, whether overlap scheduling runs, the memory
        invariant, checked when the scheduler is idle, and this process's
        resident memory and malloc heap (``cpu_malloc.heap_figures``)."""
        state = self.load_stats()
        state["overlap"] = self.scheduler.overlap  # overlap scheduling, on by default on CUDA
        state.update(self.scheduler.memory_occupation())  # what /release_memory_occupation gave back
        state["memory_usage"] = self.scheduler.memory_usage()
        state["process_memory"] = {**heap_figures(), "trimmed_bytes": self.heap.returned_bytes}
        state["memory_check"] = "busy"
        if self.scheduler.is_idle():
            try:
                self.scheduler.check_memory()
                state["memory_check"] = "ok"
            except AssertionError as exc:
                state["memory_check"] = str(exc)
        return state


def run_scheduler_process(server_args: ServerArgs, recv_addr: str | None, send_addr: str | None, ready,
                          ipc_dir: str | None = None, tp_rank: int = 0, dist_init_method: str | None = None,
                          dp_rank: int = 0, pp_rank: int = 0) -> None:
    """Entry point of a scheduler process (TP rank ``tp_rank`` of pipeline
    stage ``pp_rank`` of replica ``dp_rank``; only rank 0 gets socket
    addresses): load the model, report, loop."""
    name = "scheduler" + (f" DP{dp_rank}" if server_args.dp_size > 1 else "") + (
        f" PP{pp_rank}" if server_args.pp_size > 1 else "") + (f" TP{tp_rank}" if server_args.tp_size > 1 else "")
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(message)s")
    watch = ParentWatch(ipc_dir)
    try:
        from radixserve.managers.scheduler_factory import build_scheduler

        scheduler = build_scheduler(server_args, tp_rank, dist_init_method, dp_rank, pp_rank=pp_rank)
        if scheduler.device.type != "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # The host only builds batches from here on: small tensor ops that
            # torch would spread over every core, which this server's other
            # processes also use; one descheduled thread stalls such an op for
            # milliseconds while the GPU waits. One thread, as vLLM's workers.
            torch.set_num_threads(1)
        proc = SchedulerProcess(scheduler, recv_addr, send_addr, watch, dp_rank)
        runner = scheduler.model_runner
        freeze_startup_objects()
        ready.send({
            "status": "ready",
            "max_total_tokens": runner.max_total_tokens,
            "context_len": runner.max_context_len,
            "vocab_size": scheduler.vocab_size,
            "max_running_requests": scheduler.max_running,
            **({"pp_stage": runner.stage_info()} if server_args.pp_size > 1 else {}),
        })
    except Exception as exc:
        ready.send({"status": "error", "error": f"{type(exc).__name__}: {exc}"})
        raise
    proc.event_loop()
    scheduler.model_runner.shutdown()  # after a CloseReq: leave the TP group
