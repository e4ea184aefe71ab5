"""Tensor and pipeline parallelism for the offline ``Engine``: rank 0 (TP
rank 0 of the first stage) runs in the Engine's process, the other ranks in
processes of their own running the scheduler loop of
``managers/scheduler_process.py`` (without sockets).

The followers handle, each step, the messages rank 0 broadcasts, exactly as
behind the HTTP server: :class:`TpLeader` stands where the Engine's scheduler
stands, and turns each call that changes the scheduler (a request added, an
abort, a cache flush) into the message the followers apply, sent with the
next step. While the Engine is idle a thread keeps broadcasting empty lists,
so that the followers' collective never times out.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import threading
from typing import Any

import msgpack

from radixserve.managers.io_struct import (
    AbortReq,
    CloseReq,
    FlushCacheReq,
    KVLimitReq,
    LoadLoRAAdapterReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    TokenizedGenerateReqInput,
    UnloadLoRAAdapterReqInput,
    encode,
)
from radixserve.managers.schedule_batch import Req
from radixserve.managers.scheduler_process import IDLE_POLL_MS, run_scheduler_process
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

STOP_TIMEOUT_S = 10


class TpLeader:
    """Rank 0's Scheduler, with its decisions broadcast to the other ranks."""

    def __init__(self, args: ServerArgs):
        from radixserve.entrypoints.launcher import _wait_ready, dist_init_method, start_failure
        from radixserve.managers.scheduler_factory import build_scheduler

        init = dist_init_method(args)
        ctx = mp.get_context("spawn")
        children = []
        for pp_rank, rank in (divmod(g, args.tp_size) for g in range(1, args.tp_size * args.pp_size)):
            reader, writer = ctx.Pipe(duplex=False)
            name = "scheduler" + (f"-pp{pp_rank}" if pp_rank else "") + (f"-tp{rank}" if rank else "")
            proc = ctx.Process(target=run_scheduler_process, name=name, daemon=True,
                               args=(args, None, None, writer, None, rank, init, 0, pp_rank))
            proc.start()
            children.append((proc, reader))
        self.processes = [p for p, _ in children]
        try:
            # a rank that ends before joining (a script without a main guard) fails this at once, not at --dist-timeout
            self.scheduler = build_scheduler(args, 0, init, tp_rank_failure=lambda: start_failure(children))
            _wait_ready(children)
        except BaseException:
            self._stop_followers()
            raise
        self.tp_group, self.pp = self.scheduler.tp_group, self.scheduler.pp
        self._outbox: list[bytes] = []
        self._stepped: list[Req] = []  # what a step taken inside a control call updated: the next step returns it
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._heartbeat = threading.Thread(target=self._keep_alive, name="tp-heartbeat", daemon=True)
        self._heartbeat.start()

    def __getattr__(self, name: str) -> Any:  # the rest of the Scheduler's interface reads rank 0's state
        return getattr(self.scheduler, name)

    # -- what changes the schedulers: applied here, broadcast with the next step --
    def add_request(self, req: Req) -> None:
        msg = TokenizedGenerateReqInput(req.rid, req.origin_input_ids, req.sampling_params.to_dict(),
                                        req.return_logprob, req.logprob_start_len, req.top_logprobs_num,
                                        token_ids_logprob=req.token_ids_logprob, lora_path=req.lora_path)
        self.scheduler.add_request(req)
        self._outbox.append(encode(msg))

    def abort_request(self, rid: str) -> bool:
        self._outbox.append(encode(AbortReq(rid)))
        return self.scheduler.abort_request(rid)

    def flush_cache(self) -> bool:
        return self._everywhere(FlushCacheReq(), self.scheduler.flush_cache)

    def kv_limit(self, apply: bool, limit_bytes: int | None) -> tuple[bool, str, dict]:
        if not apply:
            return self.scheduler.kv_limit(apply, limit_bytes)
        return self._everywhere(KVLimitReq(apply, limit_bytes), self.scheduler.kv_limit, apply, limit_bytes)

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str, dict]:
        return self._everywhere(ReleaseMemoryOccupationReqInput(tags), self.scheduler.release_memory_occupation, tags)

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str, dict]:
        return self._everywhere(ResumeMemoryOccupationReqInput(tags), self.scheduler.resume_memory_occupation, tags)

    def load_lora_adapter(self, name: str, path: str) -> tuple[bool, str, dict[str, str]]:
        return self._everywhere(LoadLoRAAdapterReqInput(name, path), self.scheduler.load_lora_adapter, name, path)

    def unload_lora_adapter(self, name: str) -> tuple[bool, str, dict[str, str]]:
        return self._everywhere(UnloadLoRAAdapterReqInput(name), self.scheduler.unload_lora_adapter, name)

    def _everywhere(self, msg, apply, *args):
        """``apply(*args)`` here while the followers handle ``msg``, at once
        (not with the next step), after the messages queued before it, and
        answer alike. A follower steps after its messages when it is busy (a
        call between a stream's tokens): so does rank 0, and its next
        ``step`` returns what this one updated."""
        with self._lock:
            self._broadcast(self._outbox + [encode(msg)])
            self._outbox = []
            result = apply(*args)
            self.scheduler.barrier_all_ranks()  # the followers' reply barrier (SchedulerProcess.send_replies)
            if not self.scheduler.is_idle():
                self._stepped += self.scheduler.step()
            return result

    def step(self) -> list[Req]:
        with self._lock:
            self._broadcast(self._outbox)
            self._outbox = []
            out, self._stepped = self._stepped, []
            return out + (self.scheduler.step() if not self.scheduler.is_idle() else [])

    # -- the group -------------------------------------------------------------------
    def _broadcast(self, messages: list[bytes]) -> None:
        """To the first stage's TP ranks, relayed down the pipeline (``SchedulerProcess.share``)."""
        packed = msgpack.packb(messages)
        self.tp_group.broadcast_bytes(packed)
        self.pp.relay(packed)

    def _keep_alive(self) -> None:
        while not self._closed.wait(IDLE_POLL_MS / 1000):
            with self._lock:
                if self._closed.is_set():
                    return
                if self.scheduler.is_idle() and not self._outbox:
                    self._broadcast([])

    def dead(self) -> list[str]:
        return [p.name for p in self.processes if not p.is_alive()]

    def shutdown(self) -> None:
        self._closed.set()
        with self._lock:
            self._close_followers()
            self._stop_followers()
            self.scheduler.model_runner.shutdown()

    def _close_followers(self) -> None:
        """Ask the other ranks to close their schedulers (their file tier's
        writes land, as rank 0's do in ``Engine.shutdown``) and wait up to
        ``STOP_TIMEOUT_S`` for them to exit. Skipped if a rank is dead: the
        broadcast would wait for it."""
        if self.dead():
            return
        try:
            self._broadcast([encode(CloseReq())])
        except Exception as exc:  # a rank died meanwhile: _stop_followers ends the rest
            logger.warning("could not ask the TP ranks to close: %s", exc)
            return
        for p in self.processes:
            p.join(timeout=STOP_TIMEOUT_S)

    def _stop_followers(self) -> None:
        for p in self.processes:
            if p.is_alive():
                p.terminate()
        for p in self.processes:
            p.join(timeout=STOP_TIMEOUT_S)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
