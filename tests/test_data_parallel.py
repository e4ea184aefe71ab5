"""Data parallelism inside one server (--dp-size, --load-balance-method):
the controller's choices on their own, then a server of 2 tiny-llama
replicas (CPU) serving what one replica serves, spread by each method."""

from __future__ import annotations

import httpx
import pytest

import radixserve
from radixserve.managers.data_parallel_controller import BLOCK_TOKENS, DataParallelController, block_keys
from server_harness import ServerProcess

TINY = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", "4096", "--check-invariants")
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
PREFIXES = [[(7 * g + i) % 400 + 1 for i in range(48)] for g in range(4)]  # 3 whole blocks each
PROMPTS = [PREFIXES[g] + [200 + g, 300 + q] for g in range(4) for q in range(3)]


# -- the controller alone -------------------------------------------------------------------
def test_round_robin_takes_replicas_in_turn():
    dp = DataParallelController(3, "round_robin")
    assert [dp.dispatch(f"r{i}", [1, 2]) for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert dp.in_flight == [3, 2, 2]
    dp.finished("r0"), dp.finished("r0")  # a second finish of the same request changes nothing
    assert dp.in_flight == [2, 2, 2] and dp.replica_of("r0") is None and dp.replica_of("r1") == 1


def test_shortest_queue_fills_the_idlest_replica():
    dp = DataParallelController(2, "shortest_queue")
    first = [dp.dispatch(f"a{i}", [1]) for i in range(4)]
    assert sorted(first) == [0, 0, 1, 1]
    for i in range(4):
        if first[i] == 1:
            dp.finished(f"a{i}")
    assert [dp.dispatch(f"b{i}", [1]) for i in range(2)] == [1, 1]


def test_cache_aware_keeps_a_prefix_on_one_replica_and_spreads_new_ones():
    dp = DataParallelController(2, "cache_aware")
    first = {g: dp.dispatch(f"g{g}", PREFIXES[g] + [1]) for g in range(4)}
    assert sorted(first.values()) == [0, 0, 1, 1], "new prefixes go to the replica with the smaller index"
    for g in range(4):
        for q in range(3):
            assert dp.dispatch(f"g{g}-{q}", PREFIXES[g] + [q + 5]) == first[g]
    short = dp.dispatch("short", [1, 2, 3])  # under one block: nothing to match, goes where there is room
    assert short in (0, 1)
    dp.cache_flushed()
    assert all(len(index) == 0 for index in dp.indexes)


def test_cache_aware_falls_back_to_the_shortest_queue_when_unbalanced():
    """One hot prefix: its requests stay on one replica until that replica
    has more than BALANCE_ABS_THRESHOLD (32) more in flight than the other."""
    dp = DataParallelController(2, "cache_aware")
    placed = [dp.dispatch(f"x{i}", PREFIXES[0] + [i]) for i in range(34)]
    assert len(set(placed[:33])) == 1, "the shared prefix keeps them together"
    assert placed[33] != placed[0], "then the loads are unbalanced and the idle replica takes the next"


def test_a_prefill_server_sends_a_room_to_replica_room_mod_dp_size():
    """Whatever the method: the decode server computes the replica from the
    room. Requests without a room, and rooms on other servers, follow the method."""
    for method in ("round_robin", "shortest_queue", "cache_aware"):
        dp = DataParallelController(3, method, by_room=True)
        rooms, prompts = [5, 7, 9, 11, 2**63 - 1], [PREFIXES[1]] + [PREFIXES[0]] * 4
        assert [dp.dispatch(f"r{i}", ids, room) for i, (ids, room) in enumerate(zip(prompts, rooms))] == [2, 1, 0, 2, 1]
        assert dp.in_flight == [1, 2, 2] and dp.replica_of("r3") == 2
        if method == "shortest_queue":
            assert dp.dispatch("no-room", [1, 2]) == 0
        if method == "cache_aware":  # the index learnt where room 5's prompt went (not the shortest queue)
            assert dp.dispatch("no-room", PREFIXES[1] + [9]) == 2
    dp = DataParallelController(3, "round_robin")  # a decode (or plain) server: rooms do not choose
    assert [dp.dispatch(f"d{i}", [1], room) for i, room in enumerate([5, 5, 5, 5])] == [0, 1, 2, 0]


def test_block_keys_chain_whole_blocks_only():
    ids = list(range(BLOCK_TOKENS * 2 + 5))
    keys = block_keys(ids)
    assert len(keys) == 2 and keys[0] == block_keys(ids[:BLOCK_TOKENS])[0]
    assert block_keys([9] + ids[1:])[1] != keys[1], "a block's key names the whole prefix before it"


# -- a server of two replicas ------------------------------------------------------------------
@pytest.fixture(scope="module")
def one_replica_outputs():
    with radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                           max_total_tokens=4096, disable_tqdm=True) as eng:
        return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def _states(srv: ServerProcess) -> list[dict]:
    return httpx.get(srv.url + "/get_server_info", timeout=30).json()["internal_states"]


@pytest.mark.slow
@pytest.mark.parametrize("method", ["round_robin", "shortest_queue", "cache_aware"])
def test_two_replicas_serve_one_replicas_tokens(one_replica_outputs, method):
    srv = ServerProcess(*TINY, "--dp-size", "2", "--load-balance-method", method)
    try:
        for prompt, expected in zip(PROMPTS, one_replica_outputs):  # one at a time: later ones can hit the cache
            out = httpx.post(srv.url + "/generate", json={"input_ids": prompt, "sampling_params": GREEDY}, timeout=60)
            assert out.json()["output_ids"] == expected
        states = srv.wait_idle() and _states(srv)
        assert [s["dp_rank"] for s in states] == [0, 1] and all(s["memory_check"] == "ok" for s in states)
        served = [s["prompt_tokens"] for s in states]
        assert all(served), f"both replicas served requests ({served})"
        if method == "cache_aware":  # each group's prompts after its first hit the first's prefix
            cached = sum(s["cached_tokens"] for s in states)
            assert cached >= 4 * 2 * len(PREFIXES[0])
        load = httpx.get(srv.url + "/get_load", timeout=10).json()
        assert [entry["dp_rank"] for entry in load] == [0, 1]
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
        assert all(s["kv_cached"] == 0 for s in _states(srv))
    finally:
        assert srv.stop() == 0


@pytest.mark.slow
def test_replicas_of_two_tp_ranks_each(tmp_path):
    """--dp-size 2 --tp-size 2: four scheduler processes, two process groups;
    a profile writes one trace per process."""
    srv = ServerProcess(*TINY, "--dp-size", "2", "--tp-size", "2")
    try:
        assert len([k for k in srv.children() if k.startswith("scheduler")]) == 4
        profile = {"output_dir": str(tmp_path), "profile_id": "p"}
        assert httpx.post(srv.url + "/start_profile", json=profile, timeout=30).status_code == 200
        body = {"input_ids": PROMPTS[:4], "sampling_params": GREEDY}
        outs = httpx.post(srv.url + "/generate", json=body, timeout=60).json()
        assert len(outs) == 4 and all(len(o["output_ids"]) == 6 for o in outs)
        assert all(s["prompt_tokens"] for s in _states(srv))
        assert httpx.post(srv.url + "/stop_profile", timeout=60).status_code == 200
        assert sorted(f.name for f in tmp_path.iterdir()) == [
            f"p-DP-{d}-TP-{t}.trace.json.gz" for d in (0, 1) for t in (0, 1)]
    finally:
        assert srv.stop() == 0


def test_the_offline_engine_refuses_dp():
    with pytest.raises(ValueError, match="dp_size"):
        radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", dp_size=2)
