"""Prefill/decode disaggregation with data parallelism (``--dp-size`` on
either server; docs/disaggregation.md).

A prefill server of D replicas serves room ``r`` on replica (dp group)
``r % D``, whose ranks register with the bootstrap server under their dp
group and TP rank; a decode rank looks D up once, then links to the room's
group. Checked: the bootstrap registry by dp group, and a group that never
registers failing a room with a clear error; one decode rank taking rooms
from two prefill groups (each room's KV from its group's pool, a group's
pair kept across rooms), an abort given before the prefill server's dp size
is known reaching the prefill half, and a group killed mid-transfer failing
its room only while the other group's pair serves on; real servers (tiny-llama, dummy
weights, fp32, CPU) at dp 2 -> 2 and 2 -> 1 giving a tp-1 engine's output,
each room prefilled on its group's replica, every replica's memory check
``ok``; and a prefill replica's scheduler killed mid-transfer failing the
decode request at once while the decode server's replicas serve on.
"""

from __future__ import annotations

import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from disagg_harness import Worker, make_kv_args, start_workers
from disagg_server_harness import (
    DECODE_ARGS, GREEDY, PDPair, failure_message, assert_memory_ok, generate, new_room, prefill_args, replica_states,
    scheduler_pids,
)
from radixserve.disaggregation import KVPoll, KVTransferConfig, KVTransferError, get_kv_classes
from radixserve.disaggregation.bootstrap import (
    KVBootstrapServer, query_prefill_rank, register_prefill_rank, wait_for_prefill_rank,
)
from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver
from radixserve.server_args import ServerArgs
from server_harness import free_port, start_all
from test_disagg_faults import FAULT_DEADLINE_S, LIMITS, kv_in_flight
# the fixtures tp1_outputs, bootstrap and ctx too, as the tp and transfer tests have them
from test_disagg_tp import PROMPTS, TINY, assert_serves_tp1_output, fresh_prompt, tp1_outputs
from test_disagg_transfer import CONFIG, SLACK_S, bootstrap, ctx, handshake, make_sender, paused, transfer_ok

ENTRY = {"engine_rank": 0, "tp_size": 1, "dp_group": 0, "dp_size": 2, "rank_ip": "127.0.0.1", "rank_port": 1000,
         "layout": {"page_size": 2}}


def room_in_group(group: int, dp_size: int = 2) -> int:
    """A new room that a prefill server of ``dp_size`` replicas serves on replica ``group``."""
    return new_room() // dp_size * dp_size + group


def test_modes_take_dp_and_several_nodes():
    for mode in ("prefill", "decode"):
        args = ServerArgs.from_kwargs(model_path="tiny-llama", load_format="dummy", device="cpu", dp_size=2,
                                      disaggregation_mode=mode)
        assert args.dp_size == 2
        args = ServerArgs.from_kwargs(model_path="tiny-llama", load_format="dummy", device="cpu", tp_size=2, nnodes=2,
                                      node_rank=1, dist_init_addr="127.0.0.1:29500", disaggregation_mode=mode)
        assert args.local_ranks() == [(0, 1)]  # (pp rank, tp rank); tests/test_disagg_nodes.py serves through such servers


@pytest.mark.parametrize("backend,why", [("mooncake", "needs CUDA and RDMA"), ("nixl", "needs CUDA and RDMA"),
                                         ("gloo", "unknown transfer backend")])
def test_a_transfer_backend_this_build_lacks_is_refused_at_start_up_and_by_get_kv_classes(backend, why):
    assert set(get_kv_classes("torch")) == {"manager", "sender", "receiver", "bootstrap_server"}
    with pytest.raises(ValueError, match=why):
        get_kv_classes(backend)
    with pytest.raises(ValueError, match=f"^disaggregation_transfer_backend: .*{why}"):
        ServerArgs.from_kwargs(model_path="tiny-llama", disaggregation_mode="prefill",
                               disaggregation_transfer_backend=backend)


def test_bootstrap_registry_is_keyed_by_dp_group():
    with KVBootstrapServer("127.0.0.1", 0) as server:
        addr = server.address
        register_prefill_rank(addr, ENTRY)
        register_prefill_rank(addr, {**ENTRY, "dp_group": 1, "rank_port": 1001})
        assert query_prefill_rank(addr, 0)["rank_port"] == 1000  # group 0 when none is named
        assert query_prefill_rank(addr, 0, dp_group=1) == {"role": "Prefill", **ENTRY, "dp_group": 1, "rank_port": 1001}
        entry = httpx.get(f"http://{addr}/route?engine_rank=0&target_dp_group=1", timeout=10).json()
        assert (entry["dp_group"], entry["dp_size"], entry["rank_port"]) == (1, 2, 1001)
        with pytest.raises(KVTransferError, match=r"refused the registration .400.*dp_group 2 is not in \[0, 2\)"):
            register_prefill_rank(addr, {**ENTRY, "dp_group": 2})
        with pytest.raises(KVTransferError, match="has no prefill rank 1 of dp group 1 .404"):
            query_prefill_rank(addr, 1, dp_group=1)
        start = time.monotonic()  # a rank that never registers is asked again until the deadline
        with pytest.raises(KVTransferError, match="has no prefill rank 0 of dp group 3 .404"):
            wait_for_prefill_rank(addr, 0, 3, start + 1.0, http_timeout_s=0.5)
        assert 1.0 <= time.monotonic() - start < 1.0 + SLACK_S


def test_a_room_whose_dp_group_never_registers_fails_with_a_clear_error():
    """Group 0 says the server has two groups; a room of group 1, which never
    registers, fails once the connect timeout has passed, saying which group."""
    with KVBootstrapServer("127.0.0.1", 0) as server:
        register_prefill_rank(server.address, ENTRY)
        mgr = TorchDistKVManager(make_kv_args("decode", 0)[0], "decode",
                                 KVTransferConfig(**{**CONFIG, "connect_timeout_s": 1.0}))
        try:
            rx, start = TorchDistKVReceiver(mgr, server.address, room_in_group(1)), time.monotonic()
            while (state := rx.poll()) == KVPoll.Bootstrapping and time.monotonic() - start < 10:
                time.sleep(0.01)
            assert state == KVPoll.Failed and 1.0 <= time.monotonic() - start < 1.0 + SLACK_S
            why = rf"behind {server.address} \(dp group 1\): .*has no prefill rank 0 of dp group 1 .404"
            with pytest.raises(KVTransferError, match=f"could not pair with the prefill server {why}"):
                rx.failure_exception()
        finally:
            mgr.close()


# -- one decode rank, the prefill ranks of two dp groups -------------------------------------
@pytest.fixture(scope="module")
def dp_workers(ctx, bootstrap):
    """The one rank of each of two prefill dp groups (pools of different
    seeds) and one decode rank."""
    started = start_workers(ctx, *[dict(role="prefill", bootstrap_addr=bootstrap.address, config=CONFIG, seed=group + 1,
                                        dp=(group, 2)) for group in range(2)],
                            dict(role="decode", bootstrap_addr=bootstrap.address, config=CONFIG))
    try:
        yield started[:2], started[2]
    finally:
        for w in started:
            w.stop()


def test_a_decode_rank_takes_each_room_from_its_dp_group(dp_workers, bootstrap):
    """Rooms of groups 0, 1, 0: each room's KV is exactly its group's rank's
    (the pools differ), and the second room of group 0 goes over the pair the
    first formed (a new one would have the next number of that rank's store)."""
    prefills, decode = dp_workers
    pairs = [transfer_ok(prefills[group], decode, bootstrap.address, [1, 4], [2 + group, 6], room_in_group(group))
             for group in (0, 1, 0)]
    assert pairs[0] == pairs[2], pairs


def test_an_abort_before_the_dp_size_is_known_reaches_the_prefill_side(ctx, dp_workers):
    """A receiver made while its prefill server is still starting (nothing
    registered yet) waits unbound; aborted then, its abort is sent once the
    server has registered, so the prefill half of the room ends at once
    rather than at its bootstrap timeout."""
    decode = dp_workers[1]
    with KVBootstrapServer("127.0.0.1", 0) as server:
        room = room_in_group(1)
        decode.call("receiver", room=room, bootstrap_addr=server.address)
        decode.call("abort", room=room)
        late = []
        try:
            for group in range(2):
                late.append(Worker(ctx, "prefill", server.address, CONFIG, seed=3, dp=(group, 2)))
            make_sender(late[1], server.address, room, 2)
            state, _, failure = late[1].call("wait", room=room, states=["Failed", "WaitingForInput"], timeout=20)
            assert state == "Failed" and "the decode side gave the transfer up: the request was aborted" in failure, \
                failure
        finally:
            for w in late:
                w.stop()


def test_a_dp_group_killed_mid_transfer_fails_its_room_only(dp_workers, bootstrap):
    """The last of the dp-worker tests: group 1's rank dies with a room's KV
    in flight; the decode rank fails that room at once, naming the group, and
    group 0's pair, formed before, carries the next room of group 0."""
    prefills, decode = dp_workers
    addr, before = bootstrap.address, transfer_ok(prefills[0], decode, bootstrap.address, [3], [3], room_in_group(0))
    room = room_in_group(1)
    handshake(prefills[1], decode, addr, room, [5, 6], [8, 9])
    with paused(decode):  # so the announced messages are still in flight when the rank dies
        prefills[1].call("send", room=room, pages=[5, 6])
        prefills[1].kill()
        resumed = time.monotonic()
    state, _, failure = decode.call("wait", room=room, states=["Failed", "Success"], timeout=20)
    assert state == "Failed" and time.monotonic() - resumed < SLACK_S, failure
    assert f"room {room} failed" in failure and "prefill rank 0 of dp group 1" in failure, failure
    assert transfer_ok(prefills[0], decode, addr, [7], [10], room_in_group(0)) == before


# -- servers -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers():
    """A prefill server and a decode server of two replicas each (the decode
    one dispatching by its own --load-balance-method), and a decode server of one."""
    port = free_port()
    dp2 = ("--dp-size", "2")
    started = start_all(TINY + dp2 + prefill_args(port),
                        TINY + dp2 + ("--load-balance-method", "shortest_queue") + DECODE_ARGS,
                        TINY + DECODE_ARGS, env=LIMITS)
    try:
        yield PDPair(started[0], started[1], port), started[2]
    finally:
        for srv in started:
            if srv.proc.poll() is None:  # the last test kills the prefill server
                assert srv.stop() == 0, f"{srv.url} shuts down cleanly"


def assert_rooms_served_by_their_groups(pd: PDPair, tp1_outputs: list[dict], groups: tuple[int, ...]) -> None:
    """``PROMPTS`` through ``pd`` at once, in rooms of ``groups``: the tp-1
    engine's output, each prompt prefilled on its room's replica, and every
    replica of both servers idle with its memory check ``ok`` after."""
    before = [state["prompt_tokens"] for state in replica_states(pd.prefill)]
    assert_serves_tp1_output(pd, tp1_outputs, tuple(room_in_group(g) for g in groups))
    served = [state["prompt_tokens"] - b for state, b in zip(replica_states(pd.prefill), before)]
    assert served == [sum(len(ids) for ids, g in zip(PROMPTS, groups) if g == group) for group in (0, 1)]
    assert_memory_ok(pd.prefill, pd.decode)


@pytest.mark.slow
def test_dp2_prefill_and_dp2_decode_serve_tp1_output(servers, tp1_outputs):
    pd, _ = servers
    for group in (0, 1):
        url = f"http://127.0.0.1:{pd.bootstrap_port}/route?engine_rank=0&target_dp_group={group}"
        entry = httpx.get(url, timeout=10).json()
        assert (entry["dp_group"], entry["dp_size"], entry["tp_size"]) == (group, 2, 1)
    decoded = [state["prompt_tokens"] for state in replica_states(pd.decode)]
    assert_rooms_served_by_their_groups(pd, tp1_outputs, (0, 1, 1))
    assert all(state["prompt_tokens"] > b for state, b in zip(replica_states(pd.decode), decoded)), \
        "both decode replicas took requests"


@pytest.mark.slow
def test_dp2_prefill_and_dp1_decode_serve_tp1_output(servers, tp1_outputs):
    pd, dp1_decode = servers
    assert_rooms_served_by_their_groups(PDPair(pd.prefill, dp1_decode, pd.bootstrap_port), tp1_outputs, (1, 0, 1))


@pytest.mark.slow
def test_a_prefill_replica_killed_mid_transfer(servers, tp1_outputs):
    """The last server test: prefill replica 1's scheduler is SIGKILLed with a
    room's KV in flight to the dp-2 decode server, which fails the request at
    once, naming the group, gives its KV back, and serves on, on both replicas
    (the prefill server stops, as a server with a dead child does)."""
    pd, _ = servers
    body = pd.body(fresh_prompt(40), room=room_in_group(1))
    with ThreadPoolExecutor(2) as pool:
        with kv_in_flight(pd, body, pool) as (decode, _):
            os.kill(scheduler_pids(pd.prefill)[1], signal.SIGKILL)
            killed = time.monotonic()
        text = failure_message(decode.result(timeout=FAULT_DEADLINE_S))
    assert time.monotonic() - killed < FAULT_DEADLINE_S
    assert f"KV transfer of bootstrap room {body['bootstrap_room']} failed" in text, text
    assert "prefill rank 0 of dp group 1" in text, text
    assert_memory_ok(pd.decode, timeout=FAULT_DEADLINE_S)
    pd.prefill.kill()
    served = [state["prompt_tokens"] for state in replica_states(pd.decode)]
    for ids, want in zip(PROMPTS[:2], tp1_outputs):  # one at a time: the shortest queue takes each replica in turn
        out = generate(pd.decode.url, {"input_ids": ids, "sampling_params": GREEDY})
        assert out.status_code == 200 and out.json()["output_ids"] == want["output_ids"], out.text
    assert all(state["prompt_tokens"] > b for state, b in zip(replica_states(pd.decode), served))
