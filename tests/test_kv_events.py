"""KV events for external routers (docs/kv_events.md).

A test subscriber plays the router: it reads each replica's PUB stream (and
its replay socket when it sees a gap), rebuilds the set of cached blocks from
BlockStored / BlockRemoved / AllBlocksCleared alone, and must find exactly
the full blocks of the replica's radix tree, under shared prefixes, node
splits, eviction from a tiny pool and flush_cache. Block hashes are checked
against SGLang's page hash computed here independently; payloads are decoded
with SGLang's own msgspec schema when sglang is installed.
"""

from __future__ import annotations

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import radixserve
from mem_harness import Harness, RequestRules
from radixserve.managers.metrics import ServerMetrics
from radixserve.managers.scheduler_factory import build_scheduler
from radixserve.mem_cache import RadixCache
from radixserve.mem_cache.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventRecorder,
    KVEventsConfig,
    create_publisher,
    decode_batch,
    encode_batch,
    offset_endpoint,
    prefix_block_hashes,
)
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


from kv_events_harness import (
    Mirror, Subscriber, assert_mirrors, events_config, full_blocks, sglang_block_hash, tree_blocks, wait_until,
)


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.term()  # every socket of the test must be closed by now


# -- hashes and the wire format ----------------------------------------------------------
def test_block_hashes_are_sglangs_page_hash_chain():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]
    for size in (1, 2, 4, 16):
        got = prefix_block_hashes(tokens, size)
        assert len(got) == len(tokens) // size  # a partial block has no hash
        assert got == [sglang_block_hash(tuple(tokens[:n]), size) for n in range(size, len(tokens) + 1, size)]
    # A block's hash depends on everything before it, not only its own tokens.
    assert prefix_block_hashes([7, 7, 1, 2], 2)[1] != prefix_block_hashes([8, 8, 1, 2], 2)[1]
    assert prefix_block_hashes([1, 2, 7, 7], 2)[0] == prefix_block_hashes([1, 2, 8, 8], 2)[0]
    assert all(-(2**63) <= h < 2**63 for h in prefix_block_hashes(list(range(64)), 4))


def test_wire_format_is_sglangs():
    batch = EventBatch(1234.5, [
        AllBlocksCleared(),
        BlockStored([11, -12], None, [1, 2, 3, 4], 2),
        BlockStored([13], -12, [5, 6], 2),
        BlockRemoved([13, 11]),
    ], data_parallel_rank=3)
    payload = encode_batch(batch)
    ts, events, dp_rank = msgpack.unpackb(payload, raw=False)  # a positional array [ts, events, dp rank]
    assert (ts, dp_rank) == (1234.5, 3)
    assert events[0] == {"type": "AllBlocksCleared"}
    assert events[1] == {"type": "BlockStored", "block_hashes": [11, -12], "parent_block_hash": None,
                         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
                         "lora_name": None}
    assert events[3] == {"type": "BlockRemoved", "block_hashes": [13, 11], "medium": "GPU"}
    assert decode_batch(payload) == batch
    with pytest.raises(ValueError):
        decode_batch(msgpack.packb([1.0, [{"type": "BlockMoved"}], 0]))

    sglang_events = pytest.importorskip("sglang.srt.disaggregation.kv_events")
    msgspec = pytest.importorskip("msgspec")
    decoded = msgspec.msgpack.Decoder(sglang_events.KVEventBatch).decode(payload)
    assert decoded.ts == 1234.5 and decoded.attn_dp_rank == 3
    kinds = [type(e).__name__ for e in decoded.events]
    assert kinds == ["AllBlocksCleared", "BlockStored", "BlockStored", "BlockRemoved"]
    stored = decoded.events[1]
    assert (stored.block_hashes, stored.parent_block_hash, stored.token_ids, stored.block_size, stored.medium) == (
        [11, -12], None, [1, 2, 3, 4], 2, "GPU")
    assert decoded.events[2].parent_block_hash == -12 and decoded.events[3].block_hashes == [13, 11]


def test_config_parsing_and_dp_endpoints():
    cfg = KVEventsConfig.from_json('{"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": '
                                   '"tcp://*:5558", "topic": "kv", "buffer_steps": 5}')
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.topic, cfg.buffer_steps) == ("tcp://*:5557", "tcp://*:5558", "kv", 5)
    assert KVEventsConfig.from_json("{}").publisher == "zmq"  # giving the flag turns events on
    assert create_publisher('{"publisher": "null"}') is None
    assert create_publisher('{"enable_kv_cache_events": false}') is None  # vLLM's switch
    for bad in ('{"endpont": "tcp://*:1"}', '{"publisher": "kafka"}', '{"hwm": -1}', '[1]', 'nope',
                '{"buffer_steps": 0}', '{"block_size": 0}'):
        with pytest.raises(ValueError):
            KVEventsConfig.from_json(bad)
    with pytest.raises(ValueError, match="multiple of the page size 4"):
        create_publisher('{"block_size": 6}', page_size=4)

    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 3) == "tcp://*:5560"
    assert offset_endpoint("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_endpoint("inproc://kv", 2) == "inproc://kv_dp2"
    assert offset_endpoint(None, 2) is None
    with pytest.raises(ValueError):
        offset_endpoint("tcp://*:http", 1)


# -- the recorder on a radix tree, without sockets -----------------------------------------
def recorded_harness(page_size: int, block_size: int | None, pool_size: int) -> tuple[Harness, KVEventRecorder]:
    h = Harness(pool_size=pool_size, page_size=page_size, max_reqs=8, max_len=256)
    recorder = KVEventRecorder(page_size, block_size)
    h.cache = RadixCache(h.req_pool, h.alloc, page_size, kv_events=recorder)
    return h, recorder


@pytest.mark.parametrize("page_size,block_size", [(1, None), (1, 4), (2, None), (2, 4), (4, None), (4, 8)])
def test_recorder_follows_inserts_splits_eviction_and_reset(page_size, block_size):
    b = block_size or (16 if page_size == 1 else page_size)
    h, recorder = recorded_harness(page_size, block_size, pool_size=12 * b)
    assert recorder.block_size == b
    mirror = Mirror()

    def check():
        for event in recorder.take():
            mirror.apply(encode_and_back(event))
        assert_mirrors(mirror, h.cache, b)
        h.check()

    check()
    stem = list(range(100, 100 + 3 * b + 1))  # ends inside a block: the next insert splits mid-block
    for tail in ([1] * (2 * b), [2] * (2 * b), [1] * b + [3] * b, []):
        req = h.start(stem + tail)
        h.finish(req)
        check()
    h.cache.match_prefix(stem[: b + page_size])  # a split by a lookup stores nothing
    assert recorder.take() == []
    check()
    assert mirror.stored > 0
    while h.cache.evictable_size():  # evict leaf by leaf: each one's blocks go, the rest stay
        h.cache.evict(1)
        check()
    assert mirror.blocks == {} and mirror.removed == mirror.stored
    h.finish(h.start(stem))
    check()
    h.cache.reset()
    h.alloc.clear()
    assert recorder.take() == [AllBlocksCleared()]  # what the reset superseded is not sent
    mirror.apply({"type": "AllBlocksCleared"})
    check()


def encode_and_back(event) -> dict:
    (event_dict,) = msgpack.unpackb(encode_batch(EventBatch(0.0, [event], 0)), raw=False)[1]
    return event_dict


def test_eviction_under_pressure_from_a_tiny_pool():
    """Requests that do not all fit: admission evicts, the mirror follows."""
    h, recorder = recorded_harness(page_size=1, block_size=4, pool_size=40)
    mirror = Mirror()
    gen = torch.Generator().manual_seed(0)
    for i in range(30):
        shared = [7] * (4 * (i % 3))
        tail_len = int(torch.randint(4, 20, (1,), generator=gen))
        req = h.start(shared + torch.randint(0, 50, (tail_len,), generator=gen).tolist())
        if req is not None:
            h.finish(req)
        for event in recorder.take():
            mirror.apply(encode_and_back(event))
        assert_mirrors(mirror, h.cache, 4)
        h.check()
    assert mirror.removed > 0, "the pool never filled"


# Tokens from a tiny alphabet so that keys share prefixes and split nodes often.
tokens = st.lists(st.integers(0, 1), min_size=0, max_size=20)


class RecordedCacheMachine(RequestRules):
    """Random request life cycles (``RequestRules``), lookups, locks, evictions and resets on a
    RadixCache with a recorder: after every step, the blocks a router rebuilds
    from the events are exactly the tree's."""

    @initialize(page_size=st.sampled_from([1, 2, 4]), blocks_per_page=st.sampled_from([1, 2, 3]))
    def setup(self, page_size, blocks_per_page):
        block_size = page_size * blocks_per_page if page_size * blocks_per_page > 1 else 2
        self.h, self.recorder = recorded_harness(page_size, block_size, pool_size=40 * page_size)
        self.mirror = Mirror()
        self.locks = []

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def chunk(self, data):
        self.h.cache.cache_unfinished_req(data.draw(st.sampled_from(self.h.live)))

    @rule(key=tokens)
    def lock(self, key):
        m = self.h.cache.match_prefix(key)
        if m.last_node is not self.h.cache.root:
            self.h.cache.inc_lock_ref(m.last_node)
            self.locks.append(m.last_node)

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        self.h.cache.dec_lock_ref(self.locks.pop(data.draw(st.integers(0, len(self.locks) - 1))))

    @rule(n=st.integers(0, 64))
    def evict(self, n):
        self.h.cache.evict(n)

    @precondition(lambda self: not self.h.live and not self.locks)
    @rule()
    def reset(self):
        self.h.cache.reset()
        self.h.alloc.clear()

    @invariant()
    def router_view_is_the_tree(self):
        if not hasattr(self, "h"):
            return
        for event in self.recorder.take():
            self.mirror.apply(encode_and_back(event))
        assert_mirrors(self.mirror, self.h.cache, self.recorder.block_size)
        self.h.check()


RecordedCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRecordedCacheProperties = RecordedCacheMachine.TestCase


# -- the publisher: sequence numbers, replay, never blocking --------------------------------
def stored(i: int) -> list:
    """A batch storing the one-token block [i]."""
    return [BlockStored(prefix_block_hashes([i], 1), None, [i], 1)]


def test_publisher_sequence_replay_and_end_marker(ctx):
    config, pub_port, replay_port = events_config(buffer_steps=4)
    publisher = create_publisher(config)
    sub = Subscriber(ctx, pub_port, replay_port, b"kv")
    try:
        assert publisher.endpoint == f"tcp://*:{pub_port}" and publisher.replay_endpoint == f"tcp://*:{replay_port}"
        assert publisher.publish([]) is None  # no events, no batch
        assert [publisher.publish(stored(i)) for i in range(3)] == [0, 1, 2]
        sub.sync(publisher)
        assert sorted(sub.payloads) == [0, 1, 2]
        for i in range(3, 6):
            publisher.publish(stored(i))
        sub.sync(publisher)
        assert sub.live_seqs == sorted(sub.live_seqs), "live batches out of order"
        assert set(sub.live_seqs) & {3, 4, 5}, "nothing arrived live"
        assert {decode_batch(p).data_parallel_rank for p in sub.payloads.values()} == {0}

        # Replay: the last buffer_steps batches from the asked sequence on, as they went out live.
        replays_before = publisher.stats()["replays"]  # the syncs may have asked already
        replayed = sub.request_replay(3)
        assert replayed == [(s, sub.payloads[s]) for s in (3, 4, 5)]
        assert [s for s, _ in sub.request_replay(0)] == [2, 3, 4, 5]  # 0 and 1 are no longer kept
        assert sub.request_replay(6) == []
        # A REQ client gets the first reply; a DEALER without delimiter every one; a bad request the end marker.
        req = ctx.socket(zmq.REQ)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send((5).to_bytes(8, "big"))
        assert req.poll(5000) and req.recv_multipart() == [b"kv", (5).to_bytes(8, "big"), sub.payloads[5]]
        req.close(linger=0)
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send(b"bad")
        assert dealer.poll(5000) and dealer.recv_multipart() == [b"", END_SEQ, b""]
        dealer.send((5).to_bytes(8, "big"))
        assert dealer.poll(5000) and dealer.recv_multipart()[1] == (5).to_bytes(8, "big")
        assert dealer.poll(5000) and dealer.recv_multipart() == [b"", END_SEQ, b""]
        dealer.close(linger=0)
        wait_until(lambda: publisher.stats()["replays"] == replays_before + 6, "replays not counted", timeout=5)
    finally:
        sub.close()
        publisher.close()
    with pytest.raises(RuntimeError):
        publisher.publish(stored(9))


def test_publishing_never_blocks_and_counts_drops():
    """No subscriber, and a queue of one batch: publish returns at once and
    counts what it had no room for; the gap shows in the sequence numbers."""
    config, _, _ = events_config(max_queue_size=1, hwm=1)
    publisher = create_publisher(config)
    try:
        seqs = [publisher.publish(stored(i)) for i in range(20_000)]
        assert seqs == list(range(20_000))
        assert publisher.dropped > 0  # a publish that waited for room would never drop
        wait_until(lambda: publisher.sent + publisher.dropped == 20_000, "a batch neither sent nor dropped", 10)
        assert publisher.drop_stats() == {"kv_events_dropped_queue_full": publisher.dropped,  # one event a batch
                                          "kv_events_dropped_send_failed": 0}
    finally:
        publisher.close()


class RefusingSocket:
    """A PUB socket that refuses every send, as a broken one would."""

    def __init__(self, real: zmq.Socket):
        self.real = real

    def send_multipart(self, *args, **kwargs):
        raise zmq.Again()

    def close(self, linger=None):
        self.real.close(linger=linger)


def test_events_the_socket_refuses_are_counted_into_the_metrics_and_replay_keeps_them(ctx):
    config, pub_port, replay_port = events_config()
    publisher = create_publisher(config)
    publisher._pub = RefusingSocket(publisher._pub)
    sub = Subscriber(ctx, pub_port, replay_port, b"kv")
    metrics = ServerMetrics()
    try:
        batches = [stored(1), stored(2) + stored(3), stored(4)]
        for events in batches:
            publisher.publish(events)
        wait_until(lambda: publisher.dropped_events["send_failed"] == 4, "the refused events were not counted", 10)
        assert [seq for seq, _ in sub.request_replay(0)] == [0, 1, 2]  # never sent live, still replayed
        metrics.update_from_state({**publisher.drop_stats(), "kv_events_dropped_queue_full": 2})
        metrics.update_from_state({**publisher.drop_stats(), "kv_events_dropped_queue_full": 5})  # running totals
        text = metrics.render().decode()
        assert 'radixserve:kv_events_dropped_total{reason="send_failed"} 4.0' in text
        assert 'radixserve:kv_events_dropped_total{reason="queue_full"} 5.0' in text
    finally:
        sub.close()
        publisher.close()


def test_a_port_in_use_fails_at_start():
    config, pub_port, _ = events_config()
    first = create_publisher(config)
    try:
        with pytest.raises(RuntimeError, match=str(pub_port)):
            create_publisher(config)
    finally:
        first.close()


# -- end to end: the Engine and scheduler replicas ----------------------------------------------
def random_prompts(n: int, seed: int, stems: int = 3, stem_len: int = 21, tail=(3, 30)) -> list[list[int]]:
    """Prompts over a few shared stems (splits, hits) with random tails."""
    gen = torch.Generator().manual_seed(seed)
    stem_ids = [torch.randint(1, 250, (stem_len,), generator=gen).tolist() for _ in range(stems)]
    out = []
    for i in range(n):
        tail_len = int(torch.randint(tail[0], tail[1], (1,), generator=gen))
        out.append(stem_ids[i % stems] + torch.randint(1, 250, (tail_len,), generator=gen).tolist())
    return out


@pytest.mark.parametrize("page_size,block_size", [(1, None), (1, 4), (4, None)])
def test_engine_stream_rebuilds_the_cache(ctx, page_size, block_size):
    config, pub_port, replay_port = events_config(**({"block_size": block_size} if block_size else {}))
    engine = radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", kv_events_config=config,
                               page_size=page_size, max_total_tokens=160, max_running_requests=4,
                               check_invariants=True, disable_tqdm=True)
    scheduler, sub = engine.scheduler, Subscriber(ctx, pub_port, replay_port, b"kv")
    publisher, b = scheduler.kv_event_publisher, scheduler.tree_cache.kv_events.block_size
    try:
        greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
        for round_ in range(3):
            for prompts in (random_prompts(6, seed=round_), random_prompts(4, seed=10 + round_, stems=1)):
                engine.generate(input_ids=prompts, sampling_params=greedy)
                sub.sync(publisher)
                assert_mirrors(sub.mirror, scheduler.tree_cache, b)
        assert sub.mirror.removed > 0, "the pool never filled: no eviction"
        assert engine.flush_cache()
        sub.sync(publisher)
        assert sub.mirror.blocks == {} and tree_blocks(scheduler.tree_cache, b) == set()
        engine.generate(input_ids=random_prompts(3, seed=99), sampling_params=greedy)
        sub.sync(publisher)
        assert sub.mirror.blocks and sub.mirror.cleared == 2  # at start, and the flush
        assert_mirrors(sub.mirror, scheduler.tree_cache, b)

        assert sorted(sub.payloads) == list(range(publisher.next_seq))  # consecutive, each once
        assert any(s > 0 for s in sub.live_seqs), "nothing arrived live"
        assert sub.dp_ranks == {0}
        assert sub.request_replay(0) == sorted(sub.payloads.items())  # live and replayed are the same bytes
        assert publisher.dropped == 0
        assert engine.get_stats()["kv_events_dropped_queue_full"] == 0  # what /metrics reads
    finally:
        sub.close()
        scheduler.close()
        engine.shutdown()


def test_an_engine_shut_down_gives_its_ports_back():
    config, _, _ = events_config()
    for _ in range(2):  # the second binds the same ports: the first's scheduler closed them when dropped
        engine = radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu",
                                   kv_events_config=config, max_total_tokens=128, disable_tqdm=True)
        engine.generate(input_ids=list(range(1, 40)), sampling_params={"max_new_tokens": 2})
        publisher = engine.scheduler.kv_event_publisher
        engine.shutdown()
        assert not publisher._thread.is_alive()


def run_to_idle(scheduler, prompts: list[list[int]], rid_prefix: str) -> None:
    for i, ids in enumerate(prompts):
        params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
        scheduler.add_request(scheduler.new_req(f"{rid_prefix}{i}", ids, params))
    for _ in range(1000):
        if scheduler.is_idle():
            return
        scheduler.step()
    raise AssertionError("the scheduler did not become idle")


def test_each_replica_publishes_its_own_cache_on_its_own_ports(ctx):
    """dp_size 2: replica r binds the endpoint's port + r and the replay
    port + r, and stamps r on its batches; a router rebuilds each replica's
    cache from its own stream."""
    config, pub_port, replay_port = events_config(dp_size=2)
    args = ServerArgs.from_kwargs(model_path="tiny-llama", load_format="dummy", device="cpu", dp_size=2,
                                  kv_events_config=config, max_total_tokens=128, max_running_requests=4,
                                  check_invariants=True, disable_tqdm=True)
    threads = torch.get_num_threads()
    schedulers, subs = [], []
    try:
        for rank in range(2):
            schedulers.append(build_scheduler(args, dp_rank=rank))
            subs.append(Subscriber(ctx, pub_port + rank, replay_port + rank, b"kv"))
        assert [s.kv_event_publisher.endpoint for s in schedulers] == [f"tcp://*:{pub_port}", f"tcp://*:{pub_port + 1}"]
        for round_ in range(3):
            for rank, (scheduler, sub) in enumerate(zip(schedulers, subs)):
                run_to_idle(scheduler, random_prompts(5, seed=100 * rank + round_, stems=2), f"dp{rank}-{round_}-")
                sub.sync(scheduler.kv_event_publisher)
                assert_mirrors(sub.mirror, scheduler.tree_cache, 16)
        assert [sub.dp_ranks for sub in subs] == [{0}, {1}]
        assert subs[0].mirror.prefixes().isdisjoint(subs[1].mirror.prefixes())  # different prompts
        assert all(sub.mirror.removed for sub in subs)
    finally:
        for sub in subs:
            sub.close()
        for scheduler in schedulers:
            scheduler.close()
        torch.set_num_threads(threads)


def test_tp_followers_and_disabled_cache_publish_nothing():
    from radixserve.managers.scheduler_factory import kv_event_publisher

    config, _, _ = events_config()
    args = ServerArgs.from_kwargs(model_path="tiny-llama", load_format="dummy", device="cpu", kv_events_config=config)
    assert kv_event_publisher(args, tp_rank=1) is None
    assert kv_event_publisher(ServerArgs.from_kwargs(model_path="tiny-llama", load_format="dummy")) is None
    engine = radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", kv_events_config=config,
                               disable_radix_cache=True, max_total_tokens=128, disable_tqdm=True)
    try:
        engine.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 2})
        assert engine.scheduler.kv_event_publisher.next_seq == 0
    finally:
        engine.scheduler.close()
        engine.shutdown()


@pytest.mark.slow
def test_a_server_of_two_replicas_publishes_each_on_its_port(ctx):
    """launch_server --dp-size 2: each replica's stream holds the blocks of
    the prompts it served, and a flush clears both."""
    import httpx
    from server_harness import ServerProcess

    config, pub_port, replay_port = events_config(dp_size=2)
    srv = ServerProcess("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                        "--max-total-tokens", "4096", "--dp-size", "2", "--kv-events-config", config)
    subs = [Subscriber(ctx, pub_port + r, replay_port + r, b"kv") for r in range(2)]

    def read_streams() -> None:
        for sub in subs:
            sub.poll(100) or sub.catch_up()

    try:
        prompts = random_prompts(8, seed=7, stems=2)
        greedy = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
        for prompt in prompts:
            assert httpx.post(srv.url + "/generate", json={"input_ids": prompt, "sampling_params": greedy},
                              timeout=60).status_code == 200

        def every_prompt_on_a_replica() -> bool:
            read_streams()
            return all(any(full_blocks(p) <= sub.mirror.prefixes() for sub in subs) for p in prompts)

        wait_until(every_prompt_on_a_replica, "the prompts' blocks never arrived")
        assert [sub.dp_ranks for sub in subs] == [{0}, {1}]
        assert all(sub.mirror.blocks for sub in subs), "round robin served prompts on both replicas"
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200

        def both_cleared() -> bool:
            read_streams()
            return all(not sub.mirror.blocks and sub.mirror.cleared == 2 for sub in subs)  # at start, and now

        wait_until(both_cleared, "no AllBlocksCleared after the flush")
    finally:
        for sub in subs:
            sub.close()
        assert srv.stop() == 0
