"""A prefill server's scheduler under overlap scheduling, in-process on a
tiny dummy model (CPU, overlap forced as tests/test_engine.py does), with a
stand-in for the transfer layer's sender (the real one needs a decode
server; tests/test_disagg_server.py runs real pairs with overlap too).

Under overlap a prompt's results come back one step after its forward is
queued: for that step a request with a bootstrap room is in no queue, yet
holds its KV (the memory invariant, checked after every step, counts it)
and can be aborted (it then ends without sending anything). Otherwise its
pages are sent, it waits in the in-flight queue and ends with its first
token once the transfer succeeds."""

from __future__ import annotations

import itertools

import pytest
import torch

from radixserve.disaggregation.base import KVPoll
from radixserve.disaggregation.bootstrap import KVBootstrapServer
from radixserve.managers.scheduler_factory import build_scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

ROOMS = itertools.count(1)


class StandInSender:
    """A sender already paired with its decode half (WaitingForInput), which
    records what the scheduler asks of it; the test decides when it succeeds."""

    def __init__(self, kv_manager, bootstrap_addr: str, room: int):
        self.room, self.state = room, KVPoll.WaitingForInput
        self.sent: list[int] | None = None
        self.aborted = self.cleared = False

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self.num_pages = num_kv_indices

    def send(self, kv_indices: torch.Tensor) -> None:
        assert self.state == KVPoll.WaitingForInput and len(kv_indices) == self.num_pages
        self.sent, self.state = kv_indices.tolist(), KVPoll.Transferring

    def poll(self) -> KVPoll:
        return self.state

    def abort(self, reason: str | None = None) -> None:
        self.aborted = True
        if self.state != KVPoll.Success:
            self.state = KVPoll.Failed

    def clear(self) -> None:
        self.cleared = True

    def failure_exception(self):
        raise RuntimeError("unused")


@pytest.fixture
def scheduler():
    with KVBootstrapServer("127.0.0.1", 0) as bootstrap:
        args = ServerArgs(model_path="tiny-llama", load_format="dummy", device="cpu", host="127.0.0.1",
                          disaggregation_mode="prefill", disaggregation_bootstrap_port=bootstrap.port,
                          check_invariants=True, max_total_tokens=256, max_running_requests=4,
                          chunked_prefill_size=32)
        s = build_scheduler(args)
        s.overlap = True
        yield s
        s.close()


@pytest.fixture
def stand_in(scheduler, monkeypatch):
    monkeypatch.setitem(scheduler.disagg.kv_classes, "sender", StandInSender)  # the transfer backend's sender


def add(s, n: int, max_new: int = 4):
    """A request with a room and a prompt of ``n`` tokens that shares no prefix with the others."""
    room = next(ROOMS)
    ids = [room % 100 + 1] + [(7 * room + i) % 200 + 101 for i in range(n - 1)]
    req = s.new_req(f"r{room}", ids, SamplingParams(max_new_tokens=max_new, temperature=0))
    req.bootstrap_addr, req.bootstrap_room = "127.0.0.1:1", room
    s.add_request(req)
    return req


def run_until_idle(s, until=None, limit: int = 20) -> list:
    """Step until the scheduler is idle (or ``until()`` holds); what the steps returned."""
    out = []
    for _ in range(limit):
        if s.is_idle() if until is None else until():
            return out
        out += s.step()
    raise AssertionError("the scheduler did not get there")


def test_a_prompt_in_flight_holds_its_kv_then_is_sent_and_ends_with_its_first_token(scheduler, stand_in):
    s = scheduler
    reqs = [add(s, 20), add(s, 9), add(s, 40)]  # chunks of 32: the third is cut, so the batch is not drained
    s.step()  # bootstrapped: into the waiting queue, prefilled, results next step
    assert s.in_flight_reqs() == reqs and s.chunked_req is reqs[2]
    assert s.disagg.holding() == reqs[:2]  # the chunked one counts as the chunked request
    assert all(r.kv_sender.sent is None for r in reqs) and not s.disagg.inflight_queue
    assert s.step() == []  # processed (sent, waiting for the transfer) behind the next chunk
    assert s.disagg.inflight_queue == reqs[:2] and s.in_flight_reqs() == [reqs[2]]
    run_until_idle(s, until=lambda: reqs[2] in s.disagg.inflight_queue)
    pool = s.req_to_token_pool.req_to_token
    for req in reqs:
        assert req.kv_sender.sent == pool[req.req_pool_idx, : len(req.origin_input_ids)].tolist()  # pages of 1 slot
        req.kv_sender.state = KVPoll.Success
    out = run_until_idle(s)
    assert out == reqs and all(len(r.output_ids) == 1 and r.finished_reason.type == "length" for r in reqs)
    s.check_memory()


def test_an_abort_while_the_prompt_is_in_flight_ends_it_unsent(scheduler, stand_in):
    s = scheduler
    kept, aborted, cut = add(s, 12), add(s, 10), add(s, 30)
    s.step()
    assert s.disagg.holding() == [kept, aborted] and s.chunked_req is cut
    assert s.abort_request(aborted.rid)
    out = s.step()
    assert out == [aborted] and aborted.finished_reason.type == "abort"
    assert aborted.kv_sender.aborted and aborted.kv_sender.sent is None
    assert s.disagg.inflight_queue[0] is kept and kept.kv_sender.sent is not None
    run_until_idle(s, until=lambda: cut in s.disagg.inflight_queue)
    kept.kv_sender.state = cut.kv_sender.state = KVPoll.Success
    assert run_until_idle(s) == [kept, cut]
    s.check_memory()
