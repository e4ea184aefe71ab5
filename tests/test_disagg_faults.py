"""Prefill/decode disaggregation under faults, with real servers (tiny-llama
with dummy weights: the faults do not depend on the model; fp32, CPU;
tests/disagg_server_harness.py): a prefill server killed while
its KV is in flight, a decode server killed while it is in flight, clients
that hang up or abort on either side while the transfer runs or is waited
for, and a decode server whose KV pool cannot hold every request at once.
Both servers run overlap scheduling (forced on the CPU).

Each fault must end both halves of the request with a clear error, in
bounded time, give the KV back on both sides (the memory invariant, and
nothing left running or waiting) and leave the surviving servers serving.
The transfer limits are set far above ``FAULT_DEADLINE_S``: a fault must be
noticed, not waited out.

Mid-transfer is made deterministic with real processes: a decode server's
scheduler processes (which also run their KV receiving threads) are SIGSTOPped
once it has reserved and registered its pages, so the prefill server's sends
stay posted; a prefill server's schedulers (which host its KV stores) are
SIGSTOPped so that nothing is sent. Where a request stands is read from
``/get_server_info``: ``prompt_tokens`` grows when the scheduler takes a
request, ``kv_used`` when it reserves (decode) or prefills (prefill) its KV.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from urllib.parse import urlsplit

import httpx
import pytest

from disagg_server_harness import (
    DECODE_ARGS, GREEDY, PAGE_SIZE, PDPair, abort_message, assert_memory_ok, failure_message, generate, kv_used,
    model_args, prefill_args,
)
from radixserve.managers.scheduler import OVERLAP_ON_CPU_ENV
from server_harness import ServerProcess, free_port, start_all, wait_for

pytestmark = pytest.mark.slow
LIMITS = {"SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": "60", "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": "60",
          "OMP_NUM_THREADS": "1"}
# this file's servers: overlap scheduling's bookkeeping forced on, as it runs by default on a GPU (the
# servers of test_disagg_tp.py, test_disagg_dp.py and test_disagg_nodes.py run without it, with LIMITS)
OVERLAP_LIMITS = {**LIMITS, OVERLAP_ON_CPU_ENV: "1"}
FAULT_DEADLINE_S = 15  # far below the limits above, with slack for a loaded 2-core machine
DECODE_POOL = 240  # tokens (60 pages): the decode server holds only a few requests at once
_prompts = random.Random(15)


TINY = ("--model-path", "tiny-llama", "--load-format", "dummy")


def server_args(pool_tokens: int = 4096) -> tuple[str, ...]:
    """This file's servers' model (tiny-llama) and KV pool (``model_args``)."""
    return TINY + model_args(pool_tokens)


def fresh_prompt(n: int) -> list[int]:
    """A prompt in tiny-llama's vocabulary that no server has cached (so prefilling it takes new KV)."""
    return [_prompts.randrange(3, 512) for _ in range(n)]


@pytest.fixture(scope="module")
def pair():
    port = free_port()
    started = start_all(server_args() + prefill_args(port), server_args(DECODE_POOL) + DECODE_ARGS,
                        env=OVERLAP_LIMITS)
    try:
        pd = PDPair(*started, port)
        _, out = pd.generate(fresh_prompt(8))  # the two ranks pair once; the tests reuse the pair
        assert out.status_code == 200 and len(out.json()["output_ids"]) == GREEDY["max_new_tokens"]
        yield pd
    finally:
        codes = [srv.stop() for srv in started]
        assert codes == [0, 0], "both servers shut down cleanly after the faults"


@contextmanager
def stopped(srv: ServerProcess):
    """SIGSTOP the server's scheduler processes (every TP rank's) for the
    block (SIGCONT after, unless they were killed)."""
    pids = [pid for role, pid in srv.children().items() if role.startswith("scheduler")]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass


class HangingUp:
    """A streamed ``/generate`` whose client hangs up on demand (its HTTP
    connection is a plain socket, closed by :meth:`hang_up`)."""

    def __init__(self, url: str, body: dict):
        address = urlsplit(url)
        data = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.create_connection((address.hostname, address.port), timeout=10)
        self.sock.sendall(f"POST /generate HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
                          f"Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def hang_up(self) -> None:
        self.sock.close()


def wait_state(srv: ServerProcess, check, what: str) -> None:
    """Poll the server's scheduler state until ``check(state)`` holds."""
    wait_for(lambda: check(srv.state()), FAULT_DEADLINE_S, what)


@contextmanager
def kv_in_flight(pd: PDPair, body: dict, pool: ThreadPoolExecutor, to_prefill=None):
    """Send ``body``'s decode half, stop the decode server's scheduler once
    it has registered its pages (its receiving threads stop with it), then send
    the prefill half (``to_prefill(url, body)``, by default ``generate`` in
    ``pool``) and wait until the prefill server has sent its KV. Yields both
    halves (futures, or what ``to_prefill`` returned) with the transfer in
    flight; the decode server resumes after the block, unless it was killed."""
    used = kv_used(pd.decode)
    decode = pool.submit(generate, pd.decode.url, body)
    wait_for(lambda: kv_used(pd.decode) > used, FAULT_DEADLINE_S, "the decode server reserving the KV")
    with stopped(pd.decode):
        used = kv_used(pd.prefill)
        prefill = (to_prefill or (lambda url, b: pool.submit(generate, url, b)))(pd.prefill.url, body)
        wait_for(lambda: kv_used(pd.prefill) > used, FAULT_DEADLINE_S, "the prefill server sending the KV")
        assert not decode.done(), "the transfer is in flight"
        yield decode, prefill


def own_output(srv: ServerProcess, ids: list[int]) -> list[int]:
    """The server's greedy output for ``ids`` served from start to end (no room)."""
    out = generate(srv.url, {"input_ids": ids, "sampling_params": GREEDY})
    assert out.status_code == 200, out.text
    return out.json()["output_ids"]


def assert_serves(pd: PDPair, ids: list[int] | None = None) -> httpx.Response:
    """A request through the pair gets the decode server's own output; returns the prefill's reply."""
    ids = ids or fresh_prompt(20)
    prefill, decode = pd.generate(ids)
    assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
    assert decode.json()["output_ids"] == own_output(pd.decode, ids)
    return prefill


def kill_mid_transfer(doomed: PDPair, dying: ServerProcess) -> tuple[dict, str, float]:
    """Check that ``doomed`` (a pair, one of whose servers is ``dying``)
    serves, then SIGKILL ``dying`` with a request's KV in flight. Returns the
    request's body, the abort message of the surviving half, and the seconds
    from the kill to that answer."""
    assert_serves(doomed)
    body = doomed.body(fresh_prompt(40))
    with ThreadPoolExecutor(2) as pool:
        with kv_in_flight(doomed, body, pool) as (decode, prefill):
            dying.kill()
            killed = time.monotonic()
        survivor = prefill if dying is doomed.decode else decode
        text = failure_message(survivor.result(timeout=FAULT_DEADLINE_S))
    return body, text, time.monotonic() - killed


def test_prefill_killed_mid_transfer(pair):
    """The decode server fails the request at once, frees what it reserved, serves on."""
    port = free_port()
    dying = ServerProcess(*server_args(), *prefill_args(port), env=OVERLAP_LIMITS)
    try:
        body, text, took = kill_mid_transfer(PDPair(dying, pair.decode, port), dying)
        assert took < FAULT_DEADLINE_S
        assert f"KV transfer of bootstrap room {body['bootstrap_room']} failed" in text and "prefill rank" in text, text
        assert_memory_ok(pair.decode, timeout=FAULT_DEADLINE_S)
        assert_serves(pair)
    finally:
        dying.kill()


def test_decode_killed_mid_transfer(pair):
    """The prefill server fails the request at once, caches its prompt, serves on."""
    dying = ServerProcess(*server_args(), *DECODE_ARGS, env=OVERLAP_LIMITS)
    try:
        body, text, took = kill_mid_transfer(PDPair(pair.prefill, dying, pair.bootstrap_port), dying)
        assert took < FAULT_DEADLINE_S
        assert f"KV transfer of bootstrap room {body['bootstrap_room']} failed" in text and "decode rank" in text, text
        assert_memory_ok(pair.prefill, timeout=FAULT_DEADLINE_S)
        reply = assert_serves(pair, body["input_ids"])
        assert reply.json()["meta_info"]["cached_tokens"] >= len(body["input_ids"]) - PAGE_SIZE, "its prompt was cached"
    finally:
        dying.kill()


def test_decode_client_hangs_up_while_the_kv_is_waited_for(pair):
    """The decode server ends the request and frees its pages while the
    prefill server is stopped; the prefill server, resumed, is told, and its
    request for the room ends at once. (The request reaches it after the
    abort: had it been prefilled and sent first, the transfer would complete
    into the decode side's own buffers and end normally, docs/disaggregation.md;
    test_disagg_transfer.py covers an abort that comes just before the send.)"""
    body = pair.body(fresh_prompt(40))
    with stopped(pair.prefill):
        used = pair.decode.state()["kv_used"]
        client = HangingUp(pair.decode.url, body)
        wait_state(pair.decode, lambda s: s["kv_used"] > used, "the decode server reserving the KV")
        client.hang_up()
        assert_memory_ok(pair.decode, timeout=FAULT_DEADLINE_S)
    time.sleep(1.0)  # the decode side's abort, queued while the prefill server was stopped, goes through
    text = failure_message(generate(pair.prefill.url, body, timeout=FAULT_DEADLINE_S))
    assert "the decode side gave the transfer up: the request was aborted" in text, text
    assert_memory_ok(pair.prefill, pair.decode, timeout=FAULT_DEADLINE_S)
    assert_serves(pair)


def abort_decode_mid_transfer(pd: PDPair, body: dict) -> None:
    """/abort_request on the decode server while the prefill server's sends
    (of ``body``, which names a rid) are posted: the decode request ends as
    aborted, its pages come back, the prefill server's transfer completes
    (into the receiver's own buffers)."""
    with ThreadPoolExecutor(2) as pool:
        with kv_in_flight(pd, body, pool) as (decode, prefill):
            assert httpx.post(pd.decode.url + "/abort_request", json={"rid": body["rid"]}, timeout=10).status_code == 200
        assert abort_message(decode.result(timeout=FAULT_DEADLINE_S)) == "aborted by request"
        out = prefill.result(timeout=FAULT_DEADLINE_S)
    assert out.status_code == 200 and out.json()["meta_info"]["finish_reason"]["type"] == "length", out.text
    assert_memory_ok(pd.prefill, pd.decode, timeout=FAULT_DEADLINE_S)


def test_decode_abort_while_the_kv_is_sent(pair):
    abort_decode_mid_transfer(pair, pair.body(fresh_prompt(40), rid="decode-abort-mid-transfer"))
    assert_serves(pair)


def test_prefill_client_hangs_up_while_its_kv_is_sent(pair):
    """The prefill server ends the request at once (the pages were copied
    out when sent) while the decode server is stopped; resumed, the decode
    server ends its half at once too, rather than taking the KV and
    decoding, gives its pages back and serves on."""
    body = pair.body(fresh_prompt(40))
    with ThreadPoolExecutor(1) as pool:
        with kv_in_flight(pair, body, pool, HangingUp) as (decode, client):
            client.hang_up()
            assert_memory_ok(pair.prefill, timeout=FAULT_DEADLINE_S)
        text = failure_message(decode.result(timeout=FAULT_DEADLINE_S))
    assert "the prefill side gave the transfer up: the prefill side aborted the request" in text, text
    assert_memory_ok(pair.prefill, pair.decode, timeout=FAULT_DEADLINE_S)
    assert_serves(pair)


def test_prefill_client_hangs_up_while_the_decode_is_waited_for(pair):
    """The prefill server ends the request; the decode half, when it comes,
    is told at once instead of waiting for KV that will never come."""
    body = pair.body(fresh_prompt(40))
    tokens = pair.prefill.state()["prompt_tokens"]
    client = HangingUp(pair.prefill.url, body)
    wait_state(pair.prefill, lambda s: s["prompt_tokens"] > tokens, "the prefill server taking the request")
    client.hang_up()
    assert_memory_ok(pair.prefill, timeout=FAULT_DEADLINE_S)
    start = time.monotonic()
    text = failure_message(generate(pair.decode.url, body, timeout=FAULT_DEADLINE_S))
    assert time.monotonic() - start < FAULT_DEADLINE_S
    assert "the prefill side gave the transfer up: the prefill side aborted the request" in text, text
    assert_memory_ok(pair.decode, timeout=FAULT_DEADLINE_S)
    assert_serves(pair)


def test_decode_client_hangs_up_while_held_back_by_a_full_pool(pair):
    """A request the decode server's pool cannot hold yet waits there,
    unregistered; its client hangs up: the prefill server's half, waiting for
    the decode side to register, is told and ends at once."""
    used = pair.decode.state()["kv_used"]
    hog = HangingUp(pair.decode.url, pair.body(fresh_prompt(200)))  # no prefill half: its 50 pages stay reserved
    try:
        wait_state(pair.decode, lambda s: s["kv_used"] >= used + 200, "the decode server reserving the hog's KV")
        body = pair.body(fresh_prompt(40))  # 10 pages, and a page of headroom for it and the hog: 12 > the 10 left
        with ThreadPoolExecutor(1) as pool:
            tokens = [srv.state()["prompt_tokens"] for srv in (pair.prefill, pair.decode)]
            prefill = pool.submit(generate, pair.prefill.url, body)
            wait_state(pair.prefill, lambda s: s["prompt_tokens"] > tokens[0], "the prefill server taking the request")
            client = HangingUp(pair.decode.url, body)
            wait_state(pair.decode, lambda s: s["prompt_tokens"] > tokens[1], "the decode server taking the request")
            assert pair.decode.state()["kv_used"] == used + 200, "the request is held back, its KV not reserved"
            client.hang_up()
            text = failure_message(prefill.result(timeout=FAULT_DEADLINE_S))
        assert "the decode side gave the transfer up: the request was aborted" in text, text
    finally:
        hog.hang_up()
    assert_memory_ok(pair.prefill, pair.decode, timeout=FAULT_DEADLINE_S)


def test_backpressure_serves_every_request(pair):
    """Six requests at once, each 14 pages of prompt, into a pool of 60: the
    decode server holds some back until others finish, taking in only what
    leaves room for the expected output of those it runs, so it never has to
    retract one it just received; none is dropped, and each gets the decode
    server's own output."""
    prompts = [fresh_prompt(56) for _ in range(6)]
    expected = [own_output(pair.decode, ids) for ids in prompts]
    retractions = pair.decode.state()["retractions"]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(pair.generate, prompts))
    for want, (prefill, decode) in zip(expected, replies):
        assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
        assert decode.json()["output_ids"] == want
        assert prefill.json()["output_ids"] == want[:1]
    assert pair.decode.state()["retractions"] == retractions, "a request was retracted on the decode server"
    assert_memory_ok(pair.prefill, pair.decode, timeout=FAULT_DEADLINE_S)
