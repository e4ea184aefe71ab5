"""The hierarchical cache (docs/hicache.md): the host pool's copies, the
two-tier radix tree's policies on a real KV pool, and the Engine with the
tiers on against HF transformers and against the tiers off, under a device
pool too small for the prompts' shared prefixes; the file tier across a
restart and with corrupt files. The memory invariant (both tiers) is
checked after every scheduler step."""

from __future__ import annotations

import math
import random

import pytest
import torch

import radixserve
from radixserve.feature_args import HICACHE_WRITE_POLICIES
from radixserve.mem_cache import MHATokenToKVPool, ReqToTokenPool, TokenToKVPoolAllocator
from radixserve.mem_cache.hicache_storage import FileTier
from radixserve.mem_cache import hiradix_cache
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.storage import HiCacheFile
from radixserve.mem_cache.host_pool import HostKVPool, host_pool_tokens, runs
from radixserve.mem_cache.invariants import check_memory_invariant
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs
from test_engine import GREEDY, hf_greedy, llama  # noqa: F401  (fixture)

# -- the host pool ------------------------------------------------------------------


def make_pools(size=64, page=1, host=128):
    pool = MHATokenToKVPool(size, page, torch.float32, head_num=2, head_dim=4, layer_num=3)
    for layer in range(3):  # every slot's K and V say which slot and layer they are
        slots = torch.arange(size + page, dtype=torch.float32)
        pool.k_buffer[layer][:] = (slots * 10 + layer)[:, None, None]
        pool.v_buffer[layer][:] = -(slots * 10 + layer)[:, None, None]
    return pool, HostKVPool(pool, host)


def test_runs_split_consecutive_slots():
    assert runs(torch.tensor([4, 5, 6, 9, 10, 2])) == [(4, 0, 3), (9, 3, 2), (2, 5, 1)]
    assert runs(torch.tensor([], dtype=torch.int64)) == []


def test_backup_then_load_moves_every_layer():
    pool, host = make_pools()
    src = torch.tensor([3, 17, 4, 60])
    before = [(pool.k_buffer[layer][src].clone(), pool.v_buffer[layer][src].clone()) for layer in range(3)]
    host_slots = host.allocator.alloc(4)
    host.backup_from_device(src, host_slots)
    dst = torch.tensor([30, 31, 8, 9])
    host.load_to_device(host_slots, dst)
    for layer, (k, v) in enumerate(before):
        assert torch.equal(pool.k_buffer[layer][dst], k) and torch.equal(pool.v_buffer[layer][dst], v)
    assert host.read(host_slots).shape == (4, 3, 2, 2, 4)


def test_host_pool_size_flags():
    assert host_pool_tokens(100, 4, 1024, 2.0, 0) == 200
    assert host_pool_tokens(100, 4, 1024, 2.0, 1 / 1024) == 1024  # 1 MiB of 1 KiB tokens wins over the ratio
    with pytest.raises(ValueError, match="at least as large"):
        host_pool_tokens(100, 1, 1024, 0.5, 0)


# -- the two-tier tree ------------------------------------------------------------------


def make_cache(policy="write_through", size=64, page=1, host=128):
    pool, hostpool = make_pools(size, page, host)
    alloc = TokenToKVPoolAllocator(size, page)
    cache = HiRadixCache(ReqToTokenPool(8, 256), alloc, page, hostpool, policy)
    return cache, alloc, pool


def put(cache, alloc, tokens):
    """Insert ``tokens`` on fresh device slots (as a finished request would)."""
    slots = alloc.alloc(len(tokens))
    dup = cache.insert(tokens, slots)
    alloc.free(slots[:dup])
    cache.poll()
    return slots


def kv_of(pool, slots):
    return torch.stack([pool.k_buffer[layer][slots] for layer in range(pool.layer_num)])


class OtherRankBehind:
    """A TP group of two whose other rank has finished none of its copies
    while ``behind`` is set."""

    size = 2
    behind = True

    def agree_mins(self, values):
        return [0] * len(values) if self.behind else list(values)


def test_under_tp_a_copy_finishes_only_once_every_rank_has_finished_it():
    _, hostpool = make_pools(64, 1, 128)
    alloc = TokenToKVPoolAllocator(64, 1)
    group = OtherRankBehind()
    cache = HiRadixCache(ReqToTokenPool(8, 256), alloc, 1, hostpool, "write_through", tp_group=group)
    put(cache, alloc, list(range(100, 120)))  # its backup is done here, not on the other rank
    assert cache.busy() and cache.match_prefix(list(range(100, 120))).last_node.transfer is not None
    cache.poll()
    assert cache.busy()
    group.behind = False
    cache.poll()
    assert not cache.busy() and cache.match_prefix(list(range(100, 120))).last_node.transfer is None
    cache.check_invariants()


class CappedRanks:
    """A TP group whose other rank reports ``cap`` for everything agreed:
    files on disk, tasks finished, tokens read, prefetches not timed out."""

    size = 2
    cap = 1 << 30

    def agree_mins(self, values):
        return [min(v, self.cap) for v in values]


def file_cache(tmp_path, group=None, policy="write_through"):
    pool, hostpool = make_pools(256, 1, 512)
    storage = FileTier(HiCacheFile(str(tmp_path), "ns"), hostpool, 1, group)
    alloc = TokenToKVPoolAllocator(256, 1)
    return HiRadixCache(ReqToTokenPool(8, 512), alloc, 1, hostpool, policy, storage=storage,
                        tp_group=group), alloc


def test_under_tp_the_file_tier_acts_on_what_every_rank_has(tmp_path):
    tokens = list(range(500, 628))  # two 64-token blocks
    writer, alloc = file_cache(tmp_path)
    put(writer, alloc, tokens)
    writer.close()  # the blocks are on file
    group = CappedRanks()
    reader, _ = file_cache(tmp_path, group)
    key = tokens + [1]
    group.cap = 0  # the other rank has none of the files
    reader.prefetch(key)
    reader.poll()
    assert not reader.storage.busy()
    group.cap = 1 << 30
    reader.prefetch(key)
    reader.poll()
    assert reader.storage.busy()
    reader.storage.drain()  # this rank's read is done...
    group.cap = 0  # ...the other's not, and its clock says the prefetch timed out
    reader.poll()
    (prefetch,) = reader.storage._prefetches.values()
    assert not prefetch.finished and prefetch.deadline == -math.inf
    assert reader.match_prefix(key).host_hit_length == 0
    group.cap = 64  # the other rank has read one block
    reader.poll()
    assert prefetch.finished and not reader.storage.busy()
    assert reader.match_prefix(key).host_hit_length == 64
    reader.check_invariants()
    reader.close()


@pytest.mark.parametrize("tree_prefix", [64, 128])
def test_a_prefetch_landing_while_an_eviction_waits_stays_out_of_the_deleted_subtree(tmp_path, tree_prefix):
    """A device node with no host copy leaves the tree with the host-only
    nodes under it, waiting first for their copies in flight. Blocks a
    prefetch has read meanwhile, whose tokens run through that node, must
    not be put into the tree under it (a leaf cut off with its host slots)
    or through it (a split whose upper half keeps the freed device slots)."""
    from test_hicache_properties import LaggingEvent

    x_r = list(range(500, 628))  # two blocks on file: X, then R
    writer, walloc = file_cache(tmp_path)
    written = kv_of(writer.host.device_pool, put(writer, walloc, x_r))
    writer.close()
    _, hostpool = make_pools(256, 1, 192)
    alloc = TokenToKVPoolAllocator(256, 1)
    cache = HiRadixCache(ReqToTokenPool(8, 512), alloc, 1, hostpool, "write_back",
                         storage=FileTier(HiCacheFile(str(tmp_path), "ns"), hostpool, 1))
    key = x_r + [1]
    assert cache.fetch(key, cache.match_prefix(key), 256)[0] is not None  # reads X and R into 128 host slots
    p = x_r[:64] + list(range(900, 900 + tree_prefix - 64))  # X, or X and 64 tokens that are not R
    q = list(range(1000, 1064))
    cache.insert(p + q, alloc.alloc(tree_prefix + 64))  # no poll: the blocks are not in the tree yet
    cache.insert(p, cache.match_prefix(p).device_indices)  # q becomes a node of its own under p
    cache._copy = lambda stream, issue, after: (issue(), LaggingEvent(1))[1]
    cache.evict(64)  # q is backed up (in flight) and demoted: the host is full
    cache.storage.drain()  # the blocks are read
    cache.evict(tree_prefix)  # p finds no host room: it leaves with q, once q's copy is done
    check_memory_invariant(alloc, cache, [])
    while cache.busy():
        cache.poll()
    m = cache.match_prefix(key)
    assert len(m.device_indices) == 0 and m.host_hit_length == 128  # the blocks, where the tree has room
    got = cache.host.read(m.last_host_node.host_value)[:, :, 0]
    assert torch.equal(got.transpose(0, 1), written)
    check_memory_invariant(alloc, cache, [])
    cache.close()


def test_demote_then_load_back_restores_the_kv():
    cache, alloc, pool = make_cache()
    a = list(range(100, 140))
    slots = put(cache, alloc, a)
    original = kv_of(pool, slots)
    assert cache.stats.hicache_backed_up == 40
    assert cache.evict(40) == 40  # demoted to the host, not dropped
    cache.check_invariants()
    assert alloc.available_size() == 64
    m = cache.match_prefix(a + [1, 2])
    assert len(m.device_indices) == 0 and m.host_hit_length == 40
    pool.k_buffer[0][:] = 0  # the device slots get reused for anything
    wait, taken = cache.fetch(a, m, budget=64)
    assert taken == 40 and wait is not None
    cache.check_invariants()
    assert cache.protected_size() == 40  # locked while loading
    cache.poll()
    assert wait.finished and cache.protected_size() == 0
    m = cache.match_prefix(a)
    assert len(m.device_indices) == 40 and m.host_hit_length == 0
    assert torch.equal(kv_of(pool, m.device_indices)[1:], original[1:])
    cache.check_invariants()


def test_write_through_selective_backs_up_at_the_second_hit():
    cache, alloc, _ = make_cache("write_through_selective")
    a = list(range(20))
    put(cache, alloc, a)
    assert cache.stats.hicache_backed_up == 0
    cache.match_prefix(a)  # hit 2 (the insert was the first touch)
    assert cache.stats.hicache_backed_up == 20
    cache.poll()
    cache.check_invariants()


def test_write_back_copies_on_eviction_only():
    cache, alloc, _ = make_cache("write_back")
    a, b = list(range(30)), list(range(50, 80))
    put(cache, alloc, a)
    put(cache, alloc, b)
    assert cache.stats.hicache_backed_up == 0
    cache.evict(30)
    assert cache.stats.hicache_backed_up == 30
    cache.poll()
    cache.check_invariants()
    assert cache.match_prefix(a + [0]).host_hit_length + cache.match_prefix(b + [0]).host_hit_length == 30


def test_write_back_load_back_keeps_its_source_on_the_host():
    """Under write_back, the device eviction that makes room for a load-back
    backs its victim up, and that backup evicts host leaves: never the nodes
    being loaded back, whose host copies the load reads."""
    cache, alloc, pool = make_cache("write_back", size=64, host=32)
    a, b, c = list(range(100, 132)), list(range(200, 232)), list(range(300, 332))
    original = kv_of(pool, put(cache, alloc, a))
    cache.evict(32)  # a's backup fills the host
    put(cache, alloc, b)
    put(cache, alloc, c)  # the device is full; a is the host's only leaf
    m = cache.match_prefix(a + [1])
    assert m.host_hit_length == 32
    wait, _ = cache.fetch(a, m, budget=64)  # evicts b, whose backup finds no host room
    assert wait is not None
    cache.check_invariants()
    cache.poll()
    m = cache.match_prefix(a)
    assert len(m.device_indices) == 32
    assert torch.equal(kv_of(pool, m.device_indices), original)
    assert cache.match_prefix(b + [1]).host_hit_length == 0  # b, with no host copy, left the tree
    assert cache.stats.hicache_backup_skipped == 32 and cache.stats.hicache_host_evicted == 0
    cache.check_invariants()


def test_device_eviction_without_host_room_drops_node_and_host_children():
    cache, alloc, _ = make_cache(size=96, host=32)
    x, a, b = list(range(32)), list(range(100, 132)), list(range(200, 216))
    put(cache, alloc, x)  # backed up: the host is full
    put(cache, alloc, a)  # no host room (x is still on the device): not backed up
    assert cache.stats.hicache_backup_skipped == 32
    cache.evict(32)  # x, the oldest, goes to the host only
    put(cache, alloc, a + b)  # b's backup pushes x out of the host
    assert cache.stats.hicache_host_evicted == 32
    cache.evict(96)  # b is demoted; a, with no host copy, leaves the tree and takes b with it
    cache.check_invariants()
    assert cache.match_prefix(a + b + [0]).host_hit_length == 0
    assert cache.host.allocator.available_size() == 32 and alloc.available_size() == 96


def test_host_lru_eviction_makes_room_for_new_backups():
    cache, alloc, _ = make_cache(size=32, host=64)
    seqs = [list(range(i * 100, i * 100 + 32)) for i in range(4)]
    for s in seqs:
        cache.evict(32)
        put(cache, alloc, s)
        cache.check_invariants()
    # the host holds two sequences: each new backup pushed out the oldest demoted one
    assert cache.stats.hicache_host_evicted == 64
    assert [cache.match_prefix(s + [0]).host_hit_length for s in seqs] == [0, 0, 32, 0]
    assert len(cache.match_prefix(seqs[3] + [0]).device_indices) == 32


def test_insert_over_host_only_nodes_takes_the_callers_slots():
    cache, alloc, pool = make_cache()
    a = list(range(40))
    put(cache, alloc, a)
    cache.evict(40)
    slots = put(cache, alloc, a + list(range(500, 510)))  # recomputed, e.g. no room to load back
    m = cache.match_prefix(a + list(range(500, 510)))
    assert torch.equal(m.device_indices, slots)
    assert cache.evictable_size() == 50
    cache.check_invariants()


def test_page_size_4_splits_both_tiers():
    cache, alloc, _ = make_cache(size=64, page=4, host=128)
    a = list(range(32))
    put(cache, alloc, a)
    cache.evict(32)
    m = cache.match_prefix(a[:16] + [999] * 8)  # ends inside the host-only node: it splits
    assert m.host_hit_length == 16
    wait, _ = cache.fetch(a[:16], m, budget=64)
    cache.poll()
    assert wait.finished
    assert len(cache.match_prefix(a).device_indices) == 16
    cache.check_invariants()


def test_a_device_node_over_host_only_children_is_evicted_in_its_turn():
    cache, alloc, _ = make_cache(size=96)
    p, q, r = list(range(32)), list(range(100, 132)), list(range(200, 232))
    put(cache, alloc, p)
    put(cache, alloc, p + q)
    cache.evict(32)  # q goes to the host: p, its parent, is now a device leaf but no leaf of the tree
    put(cache, alloc, r)
    assert cache.evict(32) == 32  # p, older than r, goes
    assert len(cache.match_prefix(r).device_indices) == 32
    assert cache.match_prefix(p + q + [0]).host_hit_length == 64
    cache.check_invariants()


@pytest.mark.parametrize("eviction", ["lru", "lfu"])
@pytest.mark.parametrize("policy", HICACHE_WRITE_POLICIES)
def test_device_eviction_takes_the_policy_first_of_the_whole_tree(monkeypatch, policy, eviction):
    """Device eviction pops a heap of device leaves kept up to date as the
    tree changes; each node it gives up must be the one a walk of the whole
    tree picks: the least (priority, id) among the unlocked nodes on the
    device without a child there (a node whose children are all host-only
    is one), under random inserts, matches, load-backs, locks and evictions."""
    monkeypatch.setattr(hiradix_cache, "LOAD_BACK_THRESHOLD", 1)
    rng = random.Random(0)
    _, hostpool = make_pools(128, 1, 256)
    alloc = TokenToKVPoolAllocator(128, 1)
    cache = HiRadixCache(ReqToTokenPool(8, 256), alloc, 1, hostpool, policy, eviction)
    demote, given_up, locked = cache._demote, [], []

    def checked_demote(node):
        leaves = [n for n in cache._nodes() if n is not cache.root and n.value is not None and n.lock_ref == 0
                  and all(c.value is None for c in n.children.values())]
        assert (cache._priority(node), node.id) == min((cache._priority(n), n.id) for n in leaves)
        given_up.append(bool(node.children))
        return demote(node)

    cache._demote = checked_demote
    for _ in range(600):
        key = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        op = rng.random()
        if op < 0.4:
            cache.evict(len(key) - alloc.available_size())
            if alloc.available_size() >= len(key):
                put(cache, alloc, key)
        elif op < 0.6:  # a request's match, and the load-back of its host hit
            cache.fetch(key, cache.match_prefix(key), alloc.available_size() + cache.evictable_size())
        elif op < 0.7 and len(locked) < 4:
            locked.append(cache.match_prefix(key).last_node)
            cache.inc_lock_ref(locked[-1])
        elif op < 0.8 and locked:
            cache.dec_lock_ref(locked.pop(rng.randrange(len(locked))))
        else:
            cache.evict(rng.randint(1, 48))
        if rng.random() < 0.5:
            cache.poll()
        cache.check_invariants()
    assert len(given_up) > 100 and sum(given_up) > 10, "too few evictions, or none of a node that is no tree leaf"


def test_admission_counts_what_a_load_back_locks():
    """A load-back takes device slots and locks the device prefix above it:
    both leave the admission budget, which must stay within free + evictable."""
    from radixserve.managers.schedule_batch import Req
    from radixserve.managers.schedule_policy import AddResult, PrefillAdder
    from radixserve.sampling.sampling_params import SamplingParams

    cache, alloc, _ = make_cache(size=96, host=128)
    p, q = list(range(32)), list(range(100, 132))
    put(cache, alloc, p)
    put(cache, alloc, p + q)
    cache.evict(32)  # q goes to the host; p stays on the device, unlocked
    adder = PrefillAdder(cache, alloc.available_size(), [], 0.5, 1000, 1000, 8, 1)
    req = Req("r", p + q + [7, 8], SamplingParams(max_new_tokens=4))
    assert adder.add_one_req(req) == AddResult.WAIT  # until q is back on the device
    assert adder.rem_total == alloc.available_size() + cache.evictable_size() == 32
    cache.poll()
    adder = PrefillAdder(cache, alloc.available_size(), [], 0.5, 1000, 1000, 8, 1)
    assert adder.add_one_req(req) == AddResult.CONTINUE
    assert len(req.prefix_indices) == 64 and req.cached_tokens == 64


# -- the Engine ------------------------------------------------------------------------

SHARED = dict(max_total_tokens=300, max_running_requests=4, disable_tqdm=True, device="cpu", check_invariants=True)


def workload(groups=5, per_group=2, prefix=96, tail=8):
    """Group prefixes that together outgrow the device pool, visited in turn."""
    gen = torch.Generator().manual_seed(0)
    heads = [torch.randint(0, 320, (prefix,), generator=gen).tolist() for _ in range(groups)]
    return [h + torch.randint(0, 320, (tail,), generator=gen).tolist() for _ in range(per_group) for h in heads]


def serve(folder, prompts, **kw):
    eng = radixserve.Engine(model_path=folder, **SHARED, **kw)
    try:
        outs = [eng.generate(input_ids=[p], sampling_params=GREEDY)[0] for p in prompts]
        eng.scheduler.check_memory()
        return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs], eng.get_stats()
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tiers_off(llama):
    return serve(llama[0], workload())


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_engine_outputs_identical_with_host_tier(llama, tiers_off, policy):
    folder, hf = llama
    prompts = workload()
    outs, cached, stats = serve(folder, prompts, enable_hierarchical_cache=True, hicache_ratio=4,
                                hicache_write_policy=policy)
    assert outs == tiers_off[0]
    assert outs[0] == hf_greedy(hf, prompts[0], GREEDY["max_new_tokens"])
    assert sum(tiers_off[1]) == 0  # the device alone keeps no group prefix until it comes round again
    assert stats["hicache_loaded_back"] > 0 and sum(cached) > 0
    if policy != "write_through_selective":  # selective: the second visit is the first backup
        assert cached[5:] == [96] * 5


def test_file_tier_survives_a_restart(llama, tiers_off, tmp_path):
    folder, _ = llama
    prompts = workload()
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
                hicache_storage_dir=str(tmp_path))
    outs, _, stats = serve(folder, prompts[:5], **tier)
    assert outs == tiers_off[0][:5] and stats["hicache_storage_writes"] == 5  # one 64-token block per prefix
    outs, cached, stats = serve(folder, prompts[5:], **tier)  # a new engine: empty device and host tiers
    assert outs == tiers_off[0][5:]
    assert cached == [64] * 5 and stats["hicache_storage_prefetched"] == 5 * 64


def test_file_tier_prefetch_starts_when_a_request_arrives(llama, tiers_off, tmp_path):
    """A queued request's blocks on file are read while it waits, as SGLang
    prefetches at arrival: before any step runs they reach the host tier,
    and at admission they are a cache hit."""
    folder, _ = llama
    prompts = workload()
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
                hicache_storage_dir=str(tmp_path))
    serve(folder, prompts[:1], **tier)
    eng = radixserve.Engine(model_path=folder, **SHARED, **tier)
    try:
        s = eng.scheduler
        req = s.new_req("queued", prompts[5], SamplingParams(**GREEDY))
        s.add_request(req)
        storage = s.tree_cache.storage
        s.tree_cache.poll()  # where the next step begins; no step has run
        assert storage.busy()  # the read started at arrival
        storage.drain()
        s.tree_cache.poll()
        assert s.tree_cache.match_prefix(prompts[5]).host_hit_length == 64  # in the host tier, not admitted yet
        while not req.finished():
            s.step()
        assert req.output_ids == tiers_off[0][5] and req.cached_tokens == 64
    finally:
        eng.shutdown()


def test_file_tier_size_cap(llama, tmp_path):
    folder, _ = llama
    cap = 80_000  # two 64-token blocks of this model (32 KiB of KV each, plus headers), not three
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
                hicache_storage_dir=str(tmp_path), hicache_storage_backend_extra_config=f'{{"max_gb": {cap / 2**30}}}')
    _, _, stats = serve(folder, workload()[:5], **tier)
    assert stats["hicache_storage_writes"] == 5 and stats["hicache_storage_evicted"] == 3
    assert stats["hicache_storage_bytes"] <= cap and len(list(tmp_path.rglob("*.kv"))) == 2


def test_corrupt_file_is_a_miss_never_served(llama, tiers_off, tmp_path):
    folder, _ = llama
    prompts = workload()
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
                hicache_storage_dir=str(tmp_path))
    serve(folder, prompts[:1], **tier)
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert len(files) == 1
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF  # one flipped byte of KV
    files[0].write_bytes(bytes(data))
    outs, cached, stats = serve(folder, prompts[5:6], **tier)
    assert outs == tiers_off[0][5:6] and cached == [0]
    assert stats["hicache_storage_corrupt"] == 1 and stats["hicache_storage_prefetched"] == 0


def test_engine_with_copies_that_take_steps_under_overlap(llama):
    """Copies that finish a few steps after they are issued (as on a GPU),
    overlap scheduling, chunked prefill and a crowded pool: every request
    runs to its length with the tokens of the tiers off, and no admitted
    prefill runs out of KV (a load-back's locks count against admission)."""
    from test_hicache_properties import LaggingEvent

    folder, _ = llama
    gen = torch.Generator().manual_seed(1)
    heads = [torch.randint(0, 320, (100,), generator=gen).tolist() for _ in range(24)]
    batch = [h + torch.randint(0, 320, (8,), generator=gen).tolist() for h in heads for _ in range(8)]
    batch = [batch[i] for i in torch.randperm(len(batch), generator=gen).tolist()]
    # fcfs over the shuffled queue: groups interleave, so their prefixes go down to the host and come back
    # (lpm would run each group together once the queue is long).
    options = dict(SHARED, max_total_tokens=500, max_running_requests=64, chunked_prefill_size=32,
                   schedule_policy="fcfs")
    outs, stats = {}, {}
    for tiers in (False, True):
        eng = radixserve.Engine(model_path=folder, enable_hierarchical_cache=tiers, hicache_ratio=6, **options)
        eng.scheduler.overlap = True
        if tiers:
            eng.scheduler.tree_cache._copy = lambda stream, issue, after: (issue(), LaggingEvent(4))[1]
        try:
            outs[tiers] = eng.generate(input_ids=batch, sampling_params=GREEDY)
            stats[tiers] = eng.get_stats()
        finally:
            eng.shutdown()
    assert [o["output_ids"] for o in outs[True]] == [o["output_ids"] for o in outs[False]]
    assert all(len(o["output_ids"]) == GREEDY["max_new_tokens"] for o in outs[True])
    assert stats[True]["hicache_loaded_back"] > 0


def test_flags_are_checked():
    with pytest.raises(ValueError, match="hicache_write_policy"):
        ServerArgs(enable_hierarchical_cache=True, hicache_write_policy="sometimes")
    with pytest.raises(ValueError, match="enable-hierarchical-cache"):
        ServerArgs(hicache_storage_backend="file")
    with pytest.raises(ValueError, match="disable-radix-cache"):
        ServerArgs(enable_hierarchical_cache=True, disable_radix_cache=True)
    with pytest.raises(ValueError, match="hicache_ratio"):
        ServerArgs(enable_hierarchical_cache=True, hicache_ratio=1.0)
    with pytest.raises(ValueError, match="max_gb must be a positive number"):
        ServerArgs(enable_hierarchical_cache=True, hicache_storage_backend="file",
                   hicache_storage_backend_extra_config='{"max_gb": 0}')
