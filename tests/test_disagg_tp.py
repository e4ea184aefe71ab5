"""Prefill/decode disaggregation with tensor parallelism: prefill and decode
servers at ``--tp-size`` 2 and 1, paired every way (tiny-llama, 2 KV heads,
dummy weights, fp32, CPU, gloo; tests/disagg_server_harness.py).

Each TP rank of the prefill server registers under its rank; each decode
rank takes its KV heads from the prefill ranks that hold them (the same rank
at equal tp sizes, half the heads of the one prefill rank when the decode
server has twice the ranks, a head from each prefill rank when it has half;
head_map.py), and the ranks of each server agree on every transfer's state
(``agree_polls``), so they move a request on in the same step. Checked: the
decode server's greedy output, logprobs and top logprobs equal a tp-1
engine's for tp 2 -> 2, 1 -> 2 and 2 -> 1; a decode-side abort while the KV
is sent, and one prefill rank of two killed mid-transfer, end in bounded time
with the memory invariants holding; the agreement itself, when one rank's
half failed and the other's did not; and a peer whose KV has other heads is
refused at pairing with a clear error, on both halves.
"""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

import radixserve
from disagg_harness import SLOTS, make_kv_args
from disagg_server_harness import (
    DECODE_ARGS, GREEDY, PAGE_SIZE, PDPair, failure_message, assert_memory_ok, generate, prefill_args,
)
from radixserve.disaggregation import KVPoll, KVTransferConfig, KVTransferError
from radixserve.disaggregation.bootstrap import KVBootstrapServer
from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver, TorchDistKVSender
from server_harness import free_port, start_all
from test_disagg_faults import FAULT_DEADLINE_S, LIMITS, abort_decode_mid_transfer, kv_in_flight
from test_disagg_server import assert_same_logprobs
from tp_harness import run_ranks

TINY = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
        "--page-size", str(PAGE_SIZE), "--max-total-tokens", "2048", "--check-invariants")
TP2 = (*TINY, "--tp-size", "2")
PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [4, 4, 100, 7, 12, 13], list(range(40, 75))]
LOGPROBS = {"return_logprob": True, "top_logprobs_num": 5}
_prompts = random.Random(16)


def fresh_prompt(n: int) -> list[int]:
    """A prompt in tiny-llama's vocabulary that no server has cached."""
    return [_prompts.randrange(3, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def tp1_outputs() -> list[dict]:
    with radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                           max_total_tokens=2048, disable_tqdm=True) as eng:
        return eng.generate(input_ids=PROMPTS, sampling_params=GREEDY, **LOGPROBS)


def start_pair(server_args: tuple[str, ...]):
    """A prefill and a decode server of ``server_args``, stopped cleanly after
    the module (unless a test killed one)."""
    port = free_port()
    started = start_all(server_args + prefill_args(port), server_args + DECODE_ARGS, env=LIMITS)
    try:
        yield PDPair(*started, port)
    finally:
        for srv in started:
            if srv.proc.poll() is None:  # the last test kills the tp-2 prefill server
                assert srv.stop() == 0, f"{srv.url} shuts down cleanly"


@pytest.fixture(scope="module")
def pair():
    yield from start_pair(TP2)


@pytest.fixture(scope="module")
def tp1_pair():
    """Servers at tp 1, to pair with the tp-2 ones."""
    yield from start_pair(TINY)


def mixed(tp2: PDPair, tp1: PDPair, prefill_tp: int) -> PDPair:
    """The prefill server of tp size ``prefill_tp`` with the decode server of the other."""
    if prefill_tp == 1:
        return PDPair(tp1.prefill, tp2.decode, tp1.bootstrap_port)
    return PDPair(tp2.prefill, tp1.decode, tp2.bootstrap_port)


def as_http(entries: list[tuple[float, int]]) -> list:
    """An engine's ``(logprob, id)`` entries as the HTTP server writes them, ``[logprob, id, text]``."""
    return [[logprob, token, None] for logprob, token in entries]


def assert_serves_tp1_output(pd: PDPair, tp1_outputs: list[dict],
                             rooms: tuple[int | None, ...] = (None,) * len(PROMPTS)) -> None:
    """The prompts through ``pd`` at once (in ``rooms``, new ones by
    default): the decode server's greedy output, logprobs and top logprobs
    are the tp-1 engine's, and the prefill server answers with the first token."""
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda ids, room: pd.generate(ids, room=room, **LOGPROBS), PROMPTS, rooms))
    for want, (prefill, decode) in zip(tp1_outputs, replies):
        assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
        got = decode.json()
        assert got["output_ids"] == want["output_ids"]
        assert prefill.json()["output_ids"] == want["output_ids"][:1]
        meta, want_meta = got["meta_info"], want["meta_info"]  # the first position's came with the KV
        assert_same_logprobs(meta["output_token_logprobs"], as_http(want_meta["output_token_logprobs"]))
        assert_same_logprobs(meta["output_top_logprobs"], [as_http(top) for top in want_meta["output_top_logprobs"]])


@pytest.mark.slow
def test_tp2_pair_serves_tp1_output_with_logprobs(pair, tp1_outputs):
    for rank in (0, 1):
        entry = httpx.get(f"http://127.0.0.1:{pair.bootstrap_port}/route?engine_rank={rank}", timeout=10).json()
        assert entry["engine_rank"] == rank and entry["tp_size"] == 2
    assert_serves_tp1_output(pair, tp1_outputs)
    prefill, decode = pair.generate(PROMPTS[2])  # again: the prefill server's ranks find it in their caches
    assert prefill.json()["meta_info"]["cached_tokens"] > 0
    assert decode.json()["output_ids"] == tp1_outputs[2]["output_ids"]
    assert_memory_ok(pair.prefill, pair.decode)


@pytest.mark.slow
@pytest.mark.parametrize("prefill_tp", [1, 2])
def test_servers_of_different_tp_sizes_serve_tp1_output_with_logprobs(pair, tp1_pair, tp1_outputs, prefill_tp):
    """Prefill tp 1 with decode tp 2 (each decode rank takes one of the two
    heads of the one prefill rank), and prefill tp 2 with decode tp 1 (the
    decode rank takes a head from each prefill rank, the first token from rank 0)."""
    pd = mixed(pair, tp1_pair, prefill_tp)
    assert_serves_tp1_output(pd, tp1_outputs)
    assert_memory_ok(pd.prefill, pd.decode)


@pytest.mark.slow
def test_decode_abort_while_the_kv_is_sent(pair):
    """/abort_request on the decode server while the prefill ranks' sends are
    posted (both decode ranks stopped): both decode ranks end the request in
    the same step, both pools get its pages back, the prefill server's
    transfers complete, and the pair serves on."""
    abort_decode_mid_transfer(pair, pair.body(fresh_prompt(40), rid="tp-decode-abort-mid-transfer"))
    _, decode = pair.generate(PROMPTS[0])
    assert decode.status_code == 200 and len(decode.json()["output_ids"]) == GREEDY["max_new_tokens"], decode.text


# -- the agreement, with ranks that saw different states ---------------------------


class FakeHalf:
    """A sender or receiver whose ``poll()`` says ``state`` (failing with ``reason``)."""

    def __init__(self, room: int, state: KVPoll, reason: str = ""):
        self.room, self.state, self.reason, self.aborted = room, state, reason, None

    def poll(self) -> KVPoll:
        return self.state

    def failure_exception(self) -> None:
        raise KVTransferError(self.reason, self.room)

    def abort(self, reason: str | None = None) -> None:
        if self.state not in (KVPoll.Success, KVPoll.Failed):
            self.state, self.reason, self.aborted = KVPoll.Failed, reason, reason


# room -> each rank's (state, reason)
SEEN = {
    1: [(KVPoll.WaitingForInput, ""), (KVPoll.Failed, "lost the decode rank")],
    2: [(KVPoll.Success, ""), (KVPoll.Transferring, "")],
    3: [(KVPoll.Failed, "rank 0's reason"), (KVPoll.Failed, "rank 1's reason")],
    4: [(KVPoll.Success, ""), (KVPoll.Failed, "no KV arrived")],
    5: [(KVPoll.Bootstrapping, ""), (KVPoll.WaitingForInput, "")],
    6: [(KVPoll.Success, ""), (KVPoll.Success, "")],
}


def agree_rank(rank: int, tp_size: int, init_method: str) -> list:
    from radixserve.distributed import init_tp_group
    from radixserve.managers.disagg_queues import agree_polls

    group = init_tp_group(rank, tp_size, "cpu", init_method, timeout_s=20)
    halves = [FakeHalf(room, *seen[rank]) for room, seen in SEEN.items()]
    agreed = agree_polls(group, halves)
    group.barrier()
    return [(int(state), text, half.aborted) for (state, text), half in zip(agreed, halves)]


def test_ranks_agree_on_the_lowest_state_and_the_first_failing_rank_s_reason():
    by_rank = run_ranks(agree_rank, 2)
    assert by_rank[0] == [
        (KVPoll.Failed, "KV transfer of bootstrap room 1 failed: lost the decode rank", "lost the decode rank"),
        (KVPoll.Transferring, None, None),
        (KVPoll.Failed, "KV transfer of bootstrap room 3 failed: rank 0's reason", None),
        (KVPoll.Failed, "KV transfer of bootstrap room 4 failed: no KV arrived", None),  # its KV came: nothing to undo
        (KVPoll.Bootstrapping, None, None),
        (KVPoll.Success, None, None),
    ]
    assert [(state, text) for state, text, _ in by_rank[1]] == [(state, text) for state, text, _ in by_rank[0]]
    assert [aborted for *_, aborted in by_rank[1]] == [None] * len(SEEN)  # it failed them itself


# -- a peer whose KV cannot be received ----------------------------------------------


def _other_head_dim(dim: int):
    args = make_kv_args("decode", 0)[0]
    heads = args.local_kv_heads
    return dataclasses.replace(args, k_buffers=[torch.zeros(SLOTS, heads, dim) for _ in args.k_buffers],
                               v_buffers=[torch.zeros(SLOTS, heads, dim) for _ in args.v_buffers])


@pytest.mark.parametrize("decode_kv, differs", [
    (lambda: make_kv_args("decode", 0, tp_rank=1, tp_size=2, num_kv_heads=4)[0],
     "num_kv_heads 2 on the prefill server, 4 on the decode server"),
    (lambda: _other_head_dim(4), "k_head_dim 8 on the prefill server, 4 on the decode server; v_head_dim 8"),
])
def test_a_peer_of_another_model_layout_is_refused_on_both_halves(decode_kv, differs):
    """A decode rank whose prefill server's KV has other heads (another
    model, or another head dim) fails its receiver at once, naming what
    differs, and tells the prefill server's rank 0, whose sender fails too
    instead of waiting out its bootstrap timeout."""
    config = KVTransferConfig(bootstrap_timeout_s=60, waiting_timeout_s=60, connect_timeout_s=30, http_timeout_s=2)
    with KVBootstrapServer("127.0.0.1", 0) as server:
        prefill = TorchDistKVManager(make_kv_args("prefill", 1)[0], "prefill", config, bootstrap_addr=server.address)
        decode = TorchDistKVManager(decode_kv(), "decode", config)
        try:
            sender = TorchDistKVSender(prefill, server.address, 42)
            sender.init(3, 0)
            receiver = TorchDistKVReceiver(decode, server.address, 42)
            start = time.monotonic()
            while (receiver.poll(), sender.poll()) != (KVPoll.Failed, KVPoll.Failed):
                assert time.monotonic() - start < 10, "both halves fail long before any limit"
                time.sleep(0.01)
            why = f"the prefill server's KV does not fit the decode server's: .*{differs}"
            with pytest.raises(KVTransferError, match=f"room 42 failed: could not pair with the prefill server .*{why}"):
                receiver.failure_exception()
            with pytest.raises(KVTransferError, match=f"room 42 failed: the decode side gave the transfer up: {why}"):
                sender.failure_exception()
        finally:
            decode.close()
            prefill.close()


# -- last: a prefill rank dies -------------------------------------------------------


@pytest.mark.slow
def test_one_prefill_rank_of_two_killed_mid_transfer(pair, tp1_pair):
    """The tp-1 decode server takes its heads from both ranks of the tp-2
    prefill server; rank 1 is SIGKILLed with the KV in flight. The request
    ends at once with the error, naming a prefill rank, the decode pool gets
    its pages back, and the decode server serves on (a request without a room)."""
    pd = mixed(pair, tp1_pair, prefill_tp=2)
    body = pd.body(fresh_prompt(40))
    with ThreadPoolExecutor(2) as pool:
        with kv_in_flight(pd, body, pool) as (decode, _):
            os.kill(pd.prefill.children()["scheduler-tp1"], signal.SIGKILL)
            killed = time.monotonic()
        text = failure_message(decode.result(timeout=FAULT_DEADLINE_S))
    assert time.monotonic() - killed < FAULT_DEADLINE_S
    assert f"KV transfer of bootstrap room {body['bootstrap_room']} failed" in text and "prefill rank" in text, text
    assert_memory_ok(pd.decode, timeout=FAULT_DEADLINE_S)
    out = generate(pd.decode.url, {"input_ids": PROMPTS[1], "sampling_params": GREEDY})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == GREEDY["max_new_tokens"], out.text
    pd.prefill.kill()  # a prefill server that lost a rank serves no more
