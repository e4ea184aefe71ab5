"""A Hypothesis state machine over the Scheduler's abort path on a tiny dummy
model (CPU): requests arrive, steps run, and random requests are aborted while
waiting, running or half-prefilled (chunked). After every step the memory
invariant holds; every request ends exactly once, an aborted one as "abort";
and once idle, evicting the cache gives every KV slot and request row back."""

from __future__ import annotations

import functools
import itertools

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

import radixserve
from radixserve.managers.scheduler import INIT_NEW_TOKEN_RATIO
from radixserve.sampling.sampling_params import SamplingParams

MAX_STEPS_TO_IDLE = 500
RIDS = itertools.count()  # unique across examples: they share an engine


# Plain steps; mixed steps (the running requests decode inside prefills); mixed
# steps sized by the queue (--mixed-chunk-min-size).
MIXING = {"plain": {}, "mixed": {"enable_mixed_chunk": True},
          "queue-sized": {"enable_mixed_chunk": True, "mixed_chunk_min_size": 4}}


@functools.lru_cache(maxsize=None)
def tiny_engine(page_size: int, mixing: str = "plain") -> radixserve.Engine:
    """One engine per page size and way of mixing for all examples; each example leaves it idle."""
    eng = radixserve.Engine(
        model_path="tiny-llama", load_format="dummy", device="cpu", check_invariants=True, disable_tqdm=True,
        max_total_tokens=192, max_running_requests=6, chunked_prefill_size=16, page_size=page_size, **MIXING[mixing],
    )
    eng.free_rows_when_idle = eng.scheduler.req_to_token_pool.available_size()  # the runner may keep a row
    return eng


# Prompts from a small alphabet over a shared stem, so that cache hits happen.
prompt_tails = st.lists(st.integers(1, 3), min_size=1, max_size=40)


class SchedulerAbortMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 4]), overlap=st.booleans(), mixing=st.sampled_from(sorted(MIXING)))
    def setup(self, page_size, overlap, mixing):
        eng = tiny_engine(page_size, mixing)
        self.s, self.free_rows = eng.scheduler, eng.free_rows_when_idle
        assert self.s.is_idle()
        self.s.overlap = overlap  # forced on CPU, as tests/test_engine.py does: results come one step later
        # Same start for every example (Hypothesis replays them): no cache, initial admission ratio.
        assert self.s.flush_cache()
        self.s.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.live: dict[str, object] = {}  # rid -> Req not yet returned finished
        self.aborted: set[str] = set()
        self.done: dict[str, None] = {}  # in finishing order: draws must not depend on rid numbers

    def _finish(self, out):
        for req in out:
            if not req.finished():
                continue
            assert req.rid not in self.done, f"{req.rid} finished twice"
            assert self.live.pop(req.rid, None) is req
            self.done[req.rid] = None
            if req.rid in self.aborted:
                assert req.finished_reason.type in ("abort", "length", "stop")
            else:
                assert req.finished_reason.type != "abort", f"{req.rid} was aborted without being asked"

    @rule(tail=prompt_tails, stem=st.integers(0, 24), max_new=st.integers(1, 24))
    def add(self, tail, stem, max_new):
        rid = f"r{next(RIDS)}"
        sp = SamplingParams(max_new_tokens=max_new, ignore_eos=True, temperature=0)
        req = self.s.new_req(rid, list(range(10, 10 + stem)) + tail, sp)
        self.s.add_request(req)
        self.live[rid] = req

    @rule()
    def step(self):
        self._finish(self.s.step())

    def _where(self, rid) -> str:
        if self.s.chunked_req is not None and self.s.chunked_req.rid == rid:
            return "chunked"
        if any(r.rid == rid for r in self.s.running_batch.reqs):
            return "running"
        return "waiting" if any(r.rid == rid for r in self.s.waiting) else "already aborted"

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort_any(self, data):
        rid = data.draw(st.sampled_from(list(self.live)))
        event(f"abort_any: {self._where(rid)}")
        found = self.s.abort_request(rid)
        # An aborted waiting request has left the queue: a second abort finds nothing.
        assert found or rid in self.aborted
        self.aborted.add(rid)

    @precondition(lambda self: self.s.chunked_req is not None)
    @rule()
    def abort_chunked(self):
        rid = self.s.chunked_req.rid
        event("abort_chunked")
        assert self.s.abort_request(rid)
        self.aborted.add(rid)

    @precondition(lambda self: self.s.waiting)
    @rule(data=st.data())
    def abort_waiting(self, data):
        req = data.draw(st.sampled_from(self.s.waiting))
        assert self.s.abort_request(req.rid)
        self.aborted.add(req.rid)

    @precondition(lambda self: self.done)
    @rule(data=st.data())
    def abort_finished(self, data):
        assert not self.s.abort_request(data.draw(st.sampled_from(list(self.done))))

    @invariant()
    def memory(self):
        if hasattr(self, "s"):
            self.s.check_memory()

    def teardown(self):
        if not hasattr(self, "s"):
            return
        for rid in list(self.live):
            if self.s.abort_request(rid):
                self.aborted.add(rid)
        for _ in range(MAX_STEPS_TO_IDLE):
            # Not is_idle() alone: it ignores aborted waiting requests not yet
            # returned by step() (see test_an_aborted_waiting_request_keeps_the_scheduler_busy).
            if self.s.is_idle() and not self.live:
                break
            self._finish(self.s.step())
            self.s.check_memory()
        idle, left = self.s.is_idle(), dict(self.live)
        # Leave the shared engine clean for the next example before asserting.
        self.s.tree_cache.evict(10**9)
        free, size = self.s.allocator.available_size(), self.s.allocator.size
        rows = self.s.req_to_token_pool.available_size()
        assert idle, "the scheduler did not become idle after every request was aborted"
        assert not left, f"requests never finished: {sorted(left)}"
        assert free == size, f"{size - free} KV slots not back after evicting the cache"
        assert rows == self.free_rows, f"{self.free_rows - rows} request rows not back"


def test_an_aborted_waiting_request_keeps_the_scheduler_busy_until_step_returns_it():
    """SchedulerProcess.event_loop only calls step() while not is_idle(). A
    request aborted while waiting is only returned (finished, "abort") by the
    next step(), so until then the scheduler must not look idle; otherwise a
    generate and its abort that arrive in one receive_all() leave the client
    waiting for an answer that is sent only when some other request comes."""
    s = tiny_engine(1).scheduler
    s.overlap = False
    req = s.new_req(f"r{next(RIDS)}", [5, 6, 7], SamplingParams(max_new_tokens=4))
    s.add_request(req)
    assert s.abort_request(req.rid)
    out = []
    for _ in range(10):  # the event loop: step while not idle
        if s.is_idle():
            break
        out += s.step()
    s.step()  # leave the shared engine clean whatever happened
    assert req in out and req.finished_reason.type == "abort"


SchedulerAbortMachine.TestCase.settings = settings(
    max_examples=20, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerAbortProperties = SchedulerAbortMachine.TestCase
