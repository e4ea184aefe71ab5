"""Prefill/decode disaggregation with tensor parallelism: a prefill server and
a decode server at ``--tp-size 2`` (tiny-llama, dummy weights, fp32, CPU,
gloo; tests/disagg_server_harness.py).

Each TP rank of the prefill server registers under its rank and sends its KV
heads to the decode server's rank of the same TP rank, and the ranks of each
server agree on every transfer's state (``agree_polls``), so they move a
request on in the same step. Checked: the decode server's greedy output,
logprobs and top logprobs equal a tp-1 engine's; a decode-side abort while
the KV is sent, and a prefill server killed mid-transfer, end in bounded
time with the memory invariants holding; the agreement itself, when one
rank's half failed and the other's did not; and a peer server of another tp
size is refused at pairing with a clear error, on both halves.
"""

from __future__ import annotations

import dataclasses
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

import radixserve
from disagg_harness import make_kv_args
from disagg_server_harness import (
    DECODE_ARGS, GREEDY, PAGE_SIZE, PDPair, abort_message, assert_memory_ok, generate, prefill_args,
)
from radixserve.disaggregation import KVPoll, KVTransferConfig, KVTransferError
from radixserve.disaggregation.bootstrap import KVBootstrapServer
from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver, TorchDistKVSender
from server_harness import free_port, start_all
from test_disagg_faults import FAULT_DEADLINE_S, LIMITS, abort_decode_mid_transfer, kv_in_flight
from test_disagg_server import assert_same_logprobs
from tp_harness import run_ranks

TINY = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32")
TP2 = (*TINY, "--page-size", str(PAGE_SIZE), "--max-total-tokens", "2048", "--check-invariants", "--tp-size", "2")
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


@pytest.fixture(scope="module")
def pair():
    port = free_port()
    started = start_all(TP2 + prefill_args(port), TP2 + DECODE_ARGS, env=LIMITS)
    try:
        yield PDPair(*started, port)
    finally:
        for srv in started:
            if srv.proc.poll() is None:  # the last test kills the prefill server
                assert srv.stop() == 0, f"{srv.url} shuts down cleanly"


def as_http(entries: list[tuple[float, int]]) -> list:
    """An engine's ``(logprob, id)`` entries as the HTTP server writes them, ``[logprob, id, text]``."""
    return [[logprob, token, None] for logprob, token in entries]


@pytest.mark.slow
def test_tp2_pair_serves_tp1_output_with_logprobs(pair, tp1_outputs):
    for rank in (0, 1):
        entry = httpx.get(f"http://127.0.0.1:{pair.bootstrap_port}/route?engine_rank={rank}", timeout=10).json()
        assert entry["engine_rank"] == rank and entry["tp_size"] == 2
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        replies = list(pool.map(lambda ids: pair.generate(ids, **LOGPROBS), PROMPTS))
    for want, (prefill, decode) in zip(tp1_outputs, replies):
        assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
        got = decode.json()
        assert got["output_ids"] == want["output_ids"]
        assert prefill.json()["output_ids"] == want["output_ids"][:1]
        meta, want_meta = got["meta_info"], want["meta_info"]  # the first position's came with the KV
        assert_same_logprobs(meta["output_token_logprobs"], as_http(want_meta["output_token_logprobs"]))
        assert_same_logprobs(meta["output_top_logprobs"], [as_http(top) for top in want_meta["output_top_logprobs"]])
    prefill, decode = pair.generate(PROMPTS[2])  # again: the prefill server's ranks find it in their caches
    assert prefill.json()["meta_info"]["cached_tokens"] > 0
    assert decode.json()["output_ids"] == tp1_outputs[2]["output_ids"]
    assert_memory_ok(pair.prefill, pair.decode)


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


# -- peers of another tp size --------------------------------------------------------


@pytest.mark.parametrize("prefill_tp, decode_rank, decode_tp", [(2, 0, 1), (1, 1, 2)])
def test_a_peer_server_of_another_tp_size_is_refused_on_both_halves(prefill_tp, decode_rank, decode_tp):
    """A decode rank whose prefill server runs another tp size fails its
    receiver at once, naming both sizes, and tells the prefill rank it
    looked up, whose sender fails too instead of waiting out its bootstrap
    timeout. The prefill server with fewer ranks never registers the decode
    rank's own: its rank 0's entry says so."""
    config = KVTransferConfig(bootstrap_timeout_s=60, waiting_timeout_s=60, connect_timeout_s=30, http_timeout_s=2)
    with KVBootstrapServer("127.0.0.1", 0) as server:
        prefill_kv = dataclasses.replace(make_kv_args("prefill", 1)[0], tp_size=prefill_tp)
        decode_kv = dataclasses.replace(make_kv_args("decode", 0)[0], tp_rank=decode_rank, tp_size=decode_tp)
        prefill = TorchDistKVManager(prefill_kv, "prefill", config, bootstrap_addr=server.address)
        decode = TorchDistKVManager(decode_kv, "decode", config)
        try:
            sender = TorchDistKVSender(prefill, server.address, 42)
            sender.init(3, 0)
            receiver = TorchDistKVReceiver(decode, server.address, 42)
            start = time.monotonic()
            while (receiver.poll(), sender.poll()) != (KVPoll.Failed, KVPoll.Failed):
                assert time.monotonic() - start < 10, "both halves fail long before any limit"
                time.sleep(0.01)
            sizes = f"the prefill server runs at --tp-size {prefill_tp} and this decode server at --tp-size {decode_tp}"
            with pytest.raises(KVTransferError, match=f"room 42 failed: could not pair .*: {sizes}; .*same tp size"):
                receiver.failure_exception()
            with pytest.raises(KVTransferError, match=f"room 42 failed: the decode side gave the transfer up: {sizes}"):
                sender.failure_exception()
        finally:
            decode.close()
            prefill.close()


# -- last: the prefill server dies ---------------------------------------------------


@pytest.mark.slow
def test_prefill_killed_mid_transfer(pair):
    """Both decode ranks lose their prefill rank: the request ends at once
    with the error, the decode pool gets its pages back, and the decode
    server serves on (a request without a room)."""
    body = pair.body(fresh_prompt(40))
    with ThreadPoolExecutor(2) as pool:
        with kv_in_flight(pair, body, pool) as (decode, _):
            pair.prefill.kill()
            killed = time.monotonic()
        text = abort_message(decode.result(timeout=FAULT_DEADLINE_S))
    assert time.monotonic() - killed < FAULT_DEADLINE_S
    assert f"KV transfer of bootstrap room {body['bootstrap_room']} failed" in text and "prefill rank" in text, text
    assert_memory_ok(pair.decode, timeout=FAULT_DEADLINE_S)
    out = generate(pair.decode.url, {"input_ids": PROMPTS[1], "sampling_params": GREEDY})
    assert out.status_code == 200 and len(out.json()["output_ids"]) == GREEDY["max_new_tokens"], out.text
