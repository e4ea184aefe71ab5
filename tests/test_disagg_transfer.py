"""The P/D transfer layer on its own (radixserve.disaggregation): a bootstrap
server in this process, prefill and decode workers in spawned processes
(tests/disagg_harness.py), KV moving over gloo pair groups.

Checked: the KV and aux data (first token, logprob, top logprobs) of several
requests with scattered pages arrive exactly, in few messages; and the
faults end the transfer with a clear error within a bounded time: a decode
that never registers, holds its half back past the bootstrap timeout, stops
receiving or is killed, a prefill that hangs or is killed mid-transfer, an
abort on either side (on the prefill side also once sent), a room no prefill
request claims, a bootstrap address that does not answer. After each, a new transfer (on a new pair where the old one
broke) succeeds.
"""

from __future__ import annotations

import multiprocessing
import random
import signal
import socket
import time
from contextlib import contextmanager

import pytest
import torch

from disagg_harness import PAGE_SIZE, Worker, make_kv_args, model_kv, start_workers
from radixserve.disaggregation import KVPoll, KVTransferConfig, KVTransferError
from radixserve.disaggregation.bootstrap import (
    KVBootstrapServer, check_health, query_prefill_rank, register_prefill_rank,
)
from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver
from server_harness import wait_for

CONFIG = {"bootstrap_timeout_s": 2.0, "waiting_timeout_s": 4.0, "transfer_timeout_s": 2.0, "connect_timeout_s": 10.0,
          "http_timeout_s": 1.0, "max_message_bytes": 2048}  # 2048 B = 4 pages of 512 B
SLACK_S = 5.0  # how late past its limit a failure may be reported on a loaded 2-core machine
_rooms = random.Random(7)


def new_room() -> int:
    return _rooms.getrandbits(63)


@pytest.fixture(scope="module")
def ctx():
    return multiprocessing.get_context("spawn")


@pytest.fixture(scope="module")
def bootstrap():
    server = KVBootstrapServer("127.0.0.1", 0)
    yield server
    server.close()


@pytest.fixture(scope="module")
def workers(ctx, bootstrap):
    started = start_workers(ctx, dict(role="prefill", bootstrap_addr=bootstrap.address, config=CONFIG, seed=1),
                            dict(role="decode", bootstrap_addr=bootstrap.address, config=CONFIG))
    try:
        yield started
    finally:
        for w in started:
            w.stop()


@contextmanager
def paused(worker: Worker):
    """SIGSTOP the worker for the block (and SIGCONT it after, whatever happens)."""
    worker.signal(signal.SIGSTOP)
    try:
        yield
    finally:
        worker.signal(signal.SIGCONT)


def slots(pages) -> torch.Tensor:
    pages = torch.tensor(pages)
    return (pages[:, None] * PAGE_SIZE + torch.arange(PAGE_SIZE)).reshape(-1)


def first_token_aux(token: int) -> tuple[int, float, list[tuple[float, int]]]:
    """The aux row a test's prefill side sends with ``token``: its logprob and
    0 to 4 top alternatives (values exact in float32)."""
    return token, -0.25 * (token % 7), [(-0.5 * k, token + k) for k in range(token % 5)]


def make_sender(prefill: Worker, addr: str, room: int, num_pages: int, aux=(0, 0, 0)) -> None:
    aux_src, _, token = aux
    _, logprob, top = first_token_aux(token)
    prefill.call("sender", room=room, bootstrap_addr=addr, num_pages=num_pages, aux_index=aux_src, token=token,
                 logprob=logprob, top=top)


def register(decode: Worker, addr: str, room: int, dst: list, aux_index: int = 0) -> None:
    """A receiver of ``room`` that pairs and names its pages."""
    decode.call("receiver", room=room, bootstrap_addr=addr)
    assert decode.call("wait", room=room, states=["WaitingForInput", "Failed"], timeout=20)[0] == "WaitingForInput"
    decode.call("init", room=room, pages=dst, aux_index=aux_index)


def handshake(prefill: Worker | list[Worker], decode: Worker | list[Worker], addr: str, room: int, src: list,
              dst: list, aux=(0, 0, 0)):
    """Both halves of ``room`` up to the point where the prefill side may
    send; either side one worker, or a server's ranks."""
    prefills = prefill if isinstance(prefill, list) else [prefill]
    for rank in prefills:
        make_sender(rank, addr, room, len(src), aux)
    for rank in decode if isinstance(decode, list) else [decode]:
        register(rank, addr, room, dst, aux[1])
    for rank in prefills:
        assert rank.call("wait", room=room, states=["WaitingForInput", "Failed"], timeout=20)[0] == "WaitingForInput"


def transfer_ok(prefill: Worker, decode: Worker, addr: str, src: list, dst: list, room: int | None = None) -> tuple:
    """One whole transfer (in ``room``, a new one by default) that must
    succeed with exact KV; returns the ids of the pairs it went over."""
    room = new_room() if room is None else room
    handshake(prefill, decode, addr, room, src, dst)
    prefill.call("send", room=room, pages=src)
    assert decode.call("wait", room=room, states=["Success", "Failed"], timeout=20)[::2] == ("Success", None)
    assert prefill.call("wait", room=room, states=["Success", "Failed"], timeout=20)[0] == "Success"
    (p_kv, _), (d_kv, _) = prefill.call("kv"), decode.call("kv")
    assert all(torch.equal(p[slots(src)], d[slots(dst)]) for p, d in zip(p_kv, d_kv))
    return decode.call("info", room=room)["pair_ids"]


def test_kv_and_aux_of_several_requests_arrive_exactly_in_few_messages(workers, bootstrap):
    prefill, decode = workers
    addr = bootstrap.address
    # (prefill pages, decode pages, prefill aux row, decode aux row, first token): scattered, out of order
    requests = [
        ([17, 3, 29], [5, 22, 9], 1, 4, 104),
        ([1, 30, 4, 12, 8, 25, 19, 2, 14], [31, 2, 18, 7, 26, 11, 3, 28, 13], 2, 9, 201),
        ([6, 21, 10, 27, 15], [20, 1, 30, 16, 24], 3, 12, 305),
    ]
    rooms = [new_room() for _ in requests]
    for room, (src, dst, a_src, a_dst, token) in zip(rooms, requests):
        handshake(prefill, decode, addr, room, src, dst, (a_src, a_dst, token))
    for i in (2, 0, 1):  # sent in another order than registered
        prefill.call("send", room=rooms[i], pages=requests[i][0])
    for room in rooms:
        assert decode.call("wait", room=room, states=["Success", "Failed"], timeout=20)[::2] == ("Success", None)
        assert prefill.call("wait", room=room, states=["Success", "Failed"], timeout=20)[0] == "Success"

    (p_kv, p_aux), (d_kv, d_aux) = prefill.call("kv"), decode.call("kv")
    written = torch.zeros(d_kv[0].shape[0], dtype=torch.bool)
    for src, dst, a_src, a_dst, token in requests:
        for p, d in zip(p_kv, d_kv):
            assert torch.equal(p[slots(src)], d[slots(dst)])
        written[slots(dst)] = True
        assert decode.call("aux", index=a_dst) == first_token_aux(token)  # token, logprob, top logprobs
        assert all(torch.equal(p[a_src], d[a_dst]) for p, d in zip(p_aux, d_aux))
    assert all(d[~written].count_nonzero() == 0 for d in d_kv)  # nothing written outside the reserved pages

    for room, (src, *_) in zip(rooms, requests):
        sent = prefill.call("info", room=room)["messages_sent"]
        assert sent == -(-len(src) // 4) + 1  # 4 pages a message, then the aux message
        assert sent < len(src) * 2 * 2  # never a message per page, layer and K/V


def test_sender_fails_when_no_decode_registers(workers, bootstrap):
    prefill, _ = workers
    room = new_room()
    prefill.call("sender", room=room, bootstrap_addr=bootstrap.address, num_pages=3, aux_index=0, token=1, logprob=0.0)
    state, waited, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and CONFIG["bootstrap_timeout_s"] - 0.5 <= waited <= CONFIG["bootstrap_timeout_s"] + SLACK_S
    assert "KVTransferError" in failure and f"room {room}" in failure and "no decode rank registered" in failure


def test_a_receiver_held_back_past_the_bootstrap_timeout_says_so_and_tells_the_prefill_side(workers, bootstrap):
    """Paired but never given its pages (as a decode server does while its
    pool is full): the receiver fails at the bootstrap timeout saying that it
    was held back, not that it found no pair, and the prefill half, made
    later and still within its own limit, is told at once."""
    prefill, decode = workers
    addr, room = bootstrap.address, new_room()
    decode.call("receiver", room=room, bootstrap_addr=addr)
    assert decode.call("wait", room=room, states=["WaitingForInput", "Failed"], timeout=20)[0] == "WaitingForInput"
    pair = decode.call("info", room=room)["pair_ids"]
    time.sleep(CONFIG["bootstrap_timeout_s"] / 2)
    prefill.call("sender", room=room, bootstrap_addr=addr, num_pages=2, aux_index=0, token=1, logprob=0.0)
    state, _, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and "held the request back for more than 2.0 s" in failure, failure
    assert "no pair" not in failure
    state, _, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and "decode side gave the transfer up: the decode side held the request back" in failure
    assert transfer_ok(prefill, decode, addr, [1, 2], [3, 4]) == pair  # nothing was in flight: same pair


def test_decode_that_stops_receiving_fails_the_sender_then_a_new_pair_serves(workers, bootstrap):
    prefill, decode = workers
    addr, room, src, dst = bootstrap.address, new_room(), [5, 9, 13], [4, 8, 12]
    old_pair = transfer_ok(prefill, decode, addr, [2, 3], [6, 7])
    handshake(prefill, decode, addr, room, src, dst)
    with paused(decode):  # registered, then stops: its receives are never posted
        prefill.call("send", room=room, pages=src)
        state, waited, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and waited <= CONFIG["transfer_timeout_s"] + SLACK_S, failure
    assert "Timed out" in failure or "timeout" in failure
    state, waited, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and waited <= CONFIG["waiting_timeout_s"] + SLACK_S
    new_pair = transfer_ok(prefill, decode, addr, src, dst)
    assert new_pair != old_pair  # the broken pair was dropped, a new one formed


def test_decode_killed_after_registering_fails_the_sender_and_the_prefill_keeps_serving(ctx, workers, bootstrap):
    prefill, decode = workers
    addr, room = bootstrap.address, new_room()
    doomed = Worker(ctx, "decode", addr, CONFIG)
    try:
        handshake(prefill, doomed, addr, room, [3, 4], [5, 6])
        doomed.kill()
        prefill.call("send", room=room, pages=[3, 4])  # its receives were never posted: this cannot complete
        state, waited, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=20)
        assert state == "Failed" and waited <= CONFIG["transfer_timeout_s"] + SLACK_S
        assert "with decode rank" in failure
    finally:
        doomed.stop()
    transfer_ok(prefill, decode, addr, [3, 4], [5, 6])


def test_prefill_that_hangs_times_out_the_receiver_and_the_pair_survives(workers, bootstrap):
    prefill, decode = workers
    addr, room = bootstrap.address, new_room()
    handshake(prefill, decode, addr, room, [1, 2], [3, 4])
    pair = decode.call("info", room=room)["pair_ids"]
    with paused(prefill):
        state, waited, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and CONFIG["waiting_timeout_s"] - 0.5 <= waited <= CONFIG["waiting_timeout_s"] + SLACK_S
    assert "no KV arrived within" in failure
    # the decode side told the prefill side, which gives the room up without sending
    state, _, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=10)
    assert state == "Failed" and "decode side gave the transfer up" in failure
    assert transfer_ok(prefill, decode, addr, [10, 11, 12], [20, 21, 22]) == pair  # nothing was in flight: same pair


def test_an_abort_on_either_side_ends_the_other_half_at_once_and_keeps_the_pair(workers, bootstrap):
    prefill, decode = workers
    addr, by_decode, by_prefill = bootstrap.address, new_room(), new_room()
    handshake(prefill, decode, addr, by_decode, [1, 2], [3, 4])
    pair = decode.call("info", room=by_decode)["pair_ids"]
    decode.call("abort", room=by_decode)
    state, waited, failure = prefill.call("wait", room=by_decode, states=["Failed", "Success"], timeout=10)
    # told, not timed out: a timeout's failure says "no KV arrived within"
    assert state == "Failed" and "decode side gave the transfer up: the request was aborted" in failure

    handshake(prefill, decode, addr, by_prefill, [1, 2], [3, 4])
    prefill.call("abort", room=by_prefill)
    state, waited, failure = decode.call("wait", room=by_prefill, states=["Failed", "Success"], timeout=10)
    assert state == "Failed" and "prefill side gave the transfer up" in failure
    assert transfer_ok(prefill, decode, addr, [1, 2], [3, 4]) == pair


def test_a_decode_abort_between_the_last_poll_and_the_send_stops_the_send(workers, bootstrap):
    """The decode side gives the room up after the prefill side polled ready
    and before it sends (a scheduler computing the KV meanwhile): the send
    posts nothing and fails the room with the decode side's reason."""
    prefill, decode = workers
    addr, room = bootstrap.address, new_room()
    handshake(prefill, decode, addr, room, [1, 2], [3, 4])
    pair = decode.call("info", room=room)["pair_ids"]
    decode.call("abort", room=room)
    assert "the request was aborted" in (prefill.call("wait_given_up", room=room, timeout=10) or "")
    prefill.call("send", room=room, pages=[1, 2])
    assert prefill.call("info", room=room)["messages_sent"] == 0
    state, _, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=10)
    assert state == "Failed" and "decode side gave the transfer up: the request was aborted" in failure
    assert transfer_ok(prefill, decode, addr, [1, 2], [3, 4]) == pair


def test_a_prefill_abort_after_the_send_ends_the_decode_half_at_once_and_keeps_the_pair_in_step(workers, bootstrap):
    """The decode side is stopped while the prefill side sends, then gives the
    room up: resumed, the receiver fails at once instead of taking the KV,
    and the next transfer over the pair gets exactly its own data (the
    aborted room's messages were taken into buffers and dropped)."""
    prefill, decode = workers
    addr, room = bootstrap.address, new_room()
    handshake(prefill, decode, addr, room, [1, 2], [3, 4])
    with paused(decode):  # its receives are not posted yet
        prefill.call("send", room=room, pages=[1, 2])
        prefill.call("abort", room=room)
    state, _, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=10)
    assert state == "Failed" and "prefill side gave the transfer up: the prefill side aborted the request" in failure
    transfer_ok(prefill, decode, addr, [5, 6], [3, 4])


def test_a_room_that_no_prefill_request_claims_is_given_up(workers, bootstrap):
    prefill, decode = workers
    addr, room = bootstrap.address, new_room()
    decode.call("receiver", room=room, bootstrap_addr=addr)
    assert decode.call("wait", room=room, states=["WaitingForInput", "Failed"], timeout=20)[0] == "WaitingForInput"
    decode.call("init", room=room, pages=[1, 2], aux_index=0)
    for _ in range(2):  # the prefill side checks for stale rooms while its senders poll (these two have no decode half)
        other = new_room()
        prefill.call("sender", room=other, bootstrap_addr=addr, num_pages=1, aux_index=0, token=1, logprob=0.0)
        prefill.call("wait", room=other, states=["Failed", "Success"], timeout=10)
    state, _, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=10)
    # told after bootstrap_timeout_s, before its own waiting_timeout_s would have said "no KV arrived"
    assert state == "Failed" and "the prefill server had no request for it" in failure, failure


def test_prefill_killed_mid_transfer_fails_the_receiver_then_a_new_prefill_serves(ctx, workers):
    _, decode = workers
    with KVBootstrapServer("127.0.0.1", 0) as server:
        addr, room, src, dst = server.address, new_room(), [8, 9, 10, 11, 12], [1, 2, 3, 4, 5]
        doomed = Worker(ctx, "prefill", addr, CONFIG, seed=2)
        try:
            handshake(doomed, decode, addr, room, src, dst)
            with paused(decode):  # so the announced messages are still in flight when the prefill dies
                doomed.call("send", room=room, pages=src)
                assert doomed.call("poll", room=room) == KVPoll.Transferring
                doomed.kill()
                resumed = time.monotonic()
            state, _, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=20)
            assert state == "Failed" and time.monotonic() - resumed < CONFIG["waiting_timeout_s"], failure
            assert "prefill" in failure or "peer" in failure
        finally:
            doomed.stop()
        successor = Worker(ctx, "prefill", addr, CONFIG, seed=3)  # registers the same engine rank again
        try:
            transfer_ok(successor, decode, addr, src, dst)
        finally:
            successor.stop()


# -- servers of different tp sizes -------------------------------------------------


@pytest.fixture(scope="module")
def tp2_decode(ctx, bootstrap):
    """A decode server's two TP ranks (one KV head each) for the tp-1 prefill worker."""
    started = start_workers(ctx, *[dict(role="decode", bootstrap_addr=bootstrap.address, config=CONFIG, tp=(rank, 2, 2))
                                   for rank in range(2)])
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def test_two_decode_ranks_take_a_head_each_of_one_prefill_rank(workers, tp2_decode, bootstrap):
    prefill, decodes, room = workers[0], tp2_decode, new_room()
    src, dst = [12, 2, 25], [7, 30, 16]
    handshake(prefill, decodes, bootstrap.address, room, src, dst, (3, 1, 77))
    prefill.call("send", room=room, pages=src)
    for rank in decodes:
        assert rank.call("wait", room=room, states=["Success", "Failed"], timeout=20)[::2] == ("Success", None)
    assert prefill.call("wait", room=room, states=["Success", "Failed"], timeout=20)[0] == "Success"
    p_kv, _ = prefill.call("kv")
    for head, rank in enumerate(decodes):
        d_kv, _ = rank.call("kv")
        assert all(torch.equal(p[slots(src)][:, head : head + 1], d[slots(dst)]) for p, d in zip(p_kv, d_kv))
        assert rank.call("aux", index=1) == first_token_aux(77)  # each decode rank needs the first token
    assert prefill.call("info", room=room)["messages_sent"] == 2 * (1 + 1)  # per decode rank: its head, the aux row


def test_a_decode_rank_that_gives_up_ends_its_peer_rank_s_half_too(workers, tp2_decode, bootstrap):
    """Both decode ranks registered the room; rank 0 gives it up before the
    prefill request came: the prefill rank tells rank 1 at once, and answers
    the prefill request, when it comes, with the abort."""
    prefill, decodes, addr, room = workers[0], tp2_decode, bootstrap.address, new_room()
    for rank in decodes:
        register(rank, addr, room, [1, 2])
    decodes[0].call("abort", room=room)
    state, waited, failure = decodes[1].call("wait", room=room, states=["Failed", "Success"], timeout=10)
    assert state == "Failed", failure  # told by the prefill rank, not timed out:
    assert "the decode side gave the transfer up: the request was aborted" in failure
    make_sender(prefill, addr, room, 2)
    state, _, failure = prefill.call("wait", room=room, states=["Failed", "Success"], timeout=10)
    assert state == "Failed" and "the decode side gave the transfer up" in failure, failure


# -- a prefill server of more ranks than the decode server -----------------------------


@pytest.fixture(scope="module")
def tp4_prefill(ctx):
    """A prefill server's four TP ranks over a model of 2 KV heads (each head
    on two ranks), behind their own bootstrap server, and a decode rank at tp
    1: it takes head 0 from rank 0 (with the aux row), head 1 from rank 2, and
    tells ranks 1 and 3 of its rooms only (head_map.py)."""
    with KVBootstrapServer("127.0.0.1", 0) as server:
        started = start_workers(ctx, *[dict(role="prefill", bootstrap_addr=server.address, config=CONFIG, seed=5,
                                            tp=(rank, 4, 2)) for rank in range(4)],
                                dict(role="decode", bootstrap_addr=server.address, config=CONFIG, tp=(0, 1, 2)))
        try:
            yield started[:4], started[4], server.address
        finally:
            for w in started:
                w.stop()


def test_a_decode_rank_assembles_its_heads_from_the_prefill_ranks_that_hold_them(tp4_prefill):
    prefills, decode, addr = tp4_prefill
    room, src, dst = new_room(), [17, 3, 29, 8, 11], [5, 22, 9, 30, 1]
    handshake(prefills, decode, addr, room, src, dst, (1, 2, 104))
    for rank in prefills:
        rank.call("send", room=room, pages=src)
    assert decode.call("wait", room=room, states=["Success", "Failed"], timeout=20)[::2] == ("Success", None)
    for rank in prefills:
        assert rank.call("wait", room=room, states=["Success", "Failed"], timeout=20)[0] == "Success"
    d_kv, _ = decode.call("kv")
    assert all(torch.equal(want[slots(src)], got[slots(dst)]) for want, got in zip(model_kv(5, 2), d_kv))
    assert decode.call("aux", index=2) == first_token_aux(104)
    # one KV message of 5 pages of one head from each rank read, the aux row from rank 0, nothing from the others
    assert [rank.call("info", room=room)["messages_sent"] for rank in prefills] == [2, 0, 1, 0]


def test_one_prefill_rank_that_gives_up_fails_the_decode_half_at_once(tp4_prefill):
    prefills, decode, addr = tp4_prefill
    room = new_room()
    handshake(prefills, decode, addr, room, [1, 2], [3, 4])
    prefills[3].call("abort", room=room)  # a rank that sends no heads: the room fails all the same
    state, waited, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=10)
    assert state == "Failed" and "prefill side gave the transfer up" in failure, failure  # told, not timed out
    for rank in prefills[:3]:
        rank.call("abort", room=room)


def test_one_prefill_rank_killed_mid_transfer_fails_the_decode_half_and_leaves_its_pages_alone(tp4_prefill):
    """The last of the tp-4 tests: prefill rank 2 dies with its KV in flight;
    the decode rank fails the room at once, naming it, and never writes the
    reserved pages, which its caller may free; the other ranks' halves end."""
    prefills, decode, addr = tp4_prefill
    room, dst = new_room(), [20, 21, 22]
    handshake(prefills, decode, addr, room, [6, 7, 8], dst)
    before, _ = decode.call("kv")
    with paused(decode):  # so the announced messages are still in flight when rank 2 dies
        for rank in prefills:
            rank.call("send", room=room, pages=[6, 7, 8])
        assert prefills[2].call("poll", room=room) == KVPoll.Transferring
        prefills[2].kill()
        resumed = time.monotonic()
    state, _, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and time.monotonic() - resumed < SLACK_S, failure
    assert f"room {room} failed" in failure and "prefill rank 2" in failure, failure
    after, _ = decode.call("kv")
    assert all(torch.equal(old[slots(dst)], new[slots(dst)]) for old, new in zip(before, after))
    for rank in (0, 1, 3):
        assert prefills[rank].call("wait", room=room, states=["Success", "Failed"],
                                   timeout=CONFIG["transfer_timeout_s"] + SLACK_S)[0] in ("Success", "Failed")


def _silent_listener() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)  # connections complete in the kernel; nobody ever reads or answers
    return sock


def test_bootstrap_address_that_does_not_answer_gives_a_clear_error_in_bounded_time():
    silent = _silent_listener()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    closed_addr = f"127.0.0.1:{closed.getsockname()[1]}"
    closed.close()
    silent_addr = f"127.0.0.1:{silent.getsockname()[1]}"
    try:
        for addr in (silent_addr, closed_addr):
            start = time.monotonic()
            with pytest.raises(KVTransferError, match=f"bootstrap server at {addr} did not answer"):
                query_prefill_rank(addr, 0, timeout_s=0.5)
            assert time.monotonic() - start < 0.5 + SLACK_S
    finally:
        silent.close()


def test_a_receiver_polls_while_its_bootstrap_query_hangs_and_fails_when_it_does():
    """The decode receiver asks the bootstrap server on a thread of its
    own: while the server holds the query unanswered, poll() says
    Bootstrapping; once the server hangs up, the receiver fails naming the
    address. Its limits are far off, so only the hang-up can end it."""
    silent = _silent_listener()
    silent.settimeout(30)
    addr = f"127.0.0.1:{silent.getsockname()[1]}"
    args, _ = make_kv_args("decode", 0)
    limits = {"bootstrap_timeout_s": 60.0, "connect_timeout_s": 60.0, "http_timeout_s": 30.0}
    mgr = TorchDistKVManager(args, "decode", KVTransferConfig(**{**CONFIG, **limits}))
    try:
        rx = TorchDistKVReceiver(mgr, addr, new_room())
        query, _ = silent.accept()  # the receiver's query, which the test holds unanswered
        try:
            assert rx.poll() == KVPoll.Bootstrapping
        finally:
            query.close()
        wait_for(lambda: rx.poll() == KVPoll.Failed, 30, "the receiver's failure once the server hung up")
        with pytest.raises(KVTransferError, match=f"could not pair .* {addr}"):
            rx.failure_exception()
    finally:
        mgr.close()
        silent.close()


def test_bootstrap_routes():
    with KVBootstrapServer("127.0.0.1", 0) as server:
        assert check_health(server.address)
        with pytest.raises(KVTransferError, match="has no prefill rank 1 of dp group 0 .404"):
            query_prefill_rank(server.address, 1)
        with pytest.raises(KVTransferError, match="refused the registration .400.*engine_rank 2 is not in"):
            register_prefill_rank(server.address, {"engine_rank": 2, "tp_size": 2, "dp_group": 0, "dp_size": 1,
                                                   "rank_ip": "127.0.0.1", "rank_port": 1234, "layout": {}})
        entry = {"engine_rank": 1, "tp_size": 2, "dp_group": 0, "dp_size": 1, "rank_ip": "127.0.0.1",
                 "rank_port": 1234, "layout": {"page_size": 2}}
        register_prefill_rank(server.address, entry)
        register_prefill_rank(server.address, {**entry, "rank_port": 4321})  # a restarted rank replaces its entry
        assert query_prefill_rank(server.address, 1) == {"role": "Prefill", **entry, "rank_port": 4321}
    assert not check_health(server.address, timeout_s=0.5)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL puts one rank on each)")
def test_kv_moves_between_two_gpus_over_an_nccl_pair(ctx):
    with KVBootstrapServer("127.0.0.1", 0) as server:
        started = []
        try:
            started.append(Worker(ctx, "prefill", server.address, CONFIG, seed=4, device="cuda:0"))
            started.append(Worker(ctx, "decode", server.address, CONFIG, device="cuda:1"))
            transfer_ok(*started, server.address, [1, 30, 4, 12, 8, 25, 19], [31, 2, 18, 7, 26, 11, 3])
        finally:
            for w in started:
                w.stop()
