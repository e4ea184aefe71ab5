"""Unit tests of RadixCache and ChunkCache, with page sizes 1 and 16."""

import pytest
import torch

from radixserve.mem_cache import RadixCache, TokenToKVPoolAllocator
from mem_harness import Harness


def seq(n, start=0):
    return list(range(start, start + n))


def make_cache(page_size=1, policy="lru", size=1024):
    alloc = TokenToKVPoolAllocator(size, page_size)
    return RadixCache(None, alloc, page_size, policy), alloc


def insert_fresh(cache, alloc, key):
    """Insert ``key`` with fresh slots, freeing the duplicates as a caller must."""
    slots = alloc.alloc(len(key))
    present = cache.insert(key, slots)
    alloc.free(slots[:present])
    return slots


@pytest.mark.parametrize("p", [1, 16])
def test_match_is_page_aligned_and_splits_inside_a_node(p):
    cache, alloc = make_cache(p)
    slots = insert_fresh(cache, alloc, seq(4 * p))
    key = seq(2 * p) + [9999] * p  # diverges in the third page
    m = cache.match_prefix(key)
    assert m.device_indices.tolist() == slots[: 2 * p].tolist()
    assert len(m.last_node.key) == 2 * p, "the match ended inside the node, which was split"
    assert len(m.last_node.children) == 1
    cache.check_invariants()
    if p > 1:
        # a key that matches 1.5 pages only matches one whole page
        m = cache.match_prefix(seq(p) + seq(p // 2, p))
        assert len(m.device_indices) == p


@pytest.mark.parametrize("p", [1, 16])
def test_insert_returns_the_already_cached_length(p):
    cache, alloc = make_cache(p)
    insert_fresh(cache, alloc, seq(3 * p))
    slots = alloc.alloc(5 * p)
    assert cache.insert(seq(5 * p), slots) == 3 * p
    assert cache.insert(seq(2 * p) + seq(p, 500), slots[: 3 * p]) == 2 * p
    assert cache.evictable_size() == 5 * p + p  # the branch adds one page
    cache.check_invariants()


def test_insert_truncates_to_whole_pages():
    cache, alloc = make_cache(16)
    cache.insert(seq(40), alloc.alloc(40))
    assert cache.total_size() == 32
    cache.check_invariants()


@pytest.mark.parametrize("p", [1, 16])
def test_lru_evicts_least_recently_used_leaf(p):
    cache, alloc = make_cache(p)
    a, b, c = seq(2 * p, 0), seq(2 * p, 1000), seq(2 * p, 2000)
    for key in (a, b, c):
        insert_fresh(cache, alloc, key)
    cache.match_prefix(a)  # a is now the most recent; b the least
    free_before = alloc.available_size()
    assert cache.evict(1) == 2 * p
    assert alloc.available_size() == free_before + 2 * p
    assert len(cache.match_prefix(b).device_indices) == 0
    assert len(cache.match_prefix(a).device_indices) == 2 * p
    assert len(cache.match_prefix(c).device_indices) == 2 * p
    cache.check_invariants()


def test_lfu_evicts_least_frequently_used_leaf():
    cache, alloc = make_cache(1, "lfu")
    a, b = seq(4, 0), seq(4, 1000)
    insert_fresh(cache, alloc, a)
    insert_fresh(cache, alloc, b)
    for _ in range(3):
        cache.match_prefix(a)
    cache.match_prefix(b)  # b most recent, but a more frequent
    cache.evict(1)
    assert len(cache.match_prefix(a).device_indices) == 4
    assert len(cache.match_prefix(b).device_indices) == 0


def test_eviction_cascades_to_parents_that_become_leaves():
    cache, alloc = make_cache(1)
    insert_fresh(cache, alloc, seq(10))
    insert_fresh(cache, alloc, seq(5) + seq(5, 100))  # splits at 5
    assert cache.evict(100) == 15
    assert cache.total_size() == 0 and alloc.available_size() == 1024
    cache.check_invariants()


@pytest.mark.parametrize("p", [1, 16])
def test_locks_protect_from_eviction_and_move_counters(p):
    cache, alloc = make_cache(p)
    insert_fresh(cache, alloc, seq(4 * p))
    m = cache.match_prefix(seq(2 * p))
    cache.inc_lock_ref(m.last_node)
    assert cache.protected_size() == 2 * p and cache.evictable_size() == 2 * p
    assert cache.evict(10**6) == 2 * p, "only the unlocked tail goes"
    assert len(cache.match_prefix(seq(4 * p)).device_indices) == 2 * p
    cache.dec_lock_ref(m.last_node)
    assert cache.protected_size() == 0 and cache.evictable_size() == 2 * p
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(m.last_node)
    cache.check_invariants()


def test_a_leaf_passed_over_while_locked_is_evicted_once_unlocked():
    cache, alloc = make_cache()
    insert_fresh(cache, alloc, seq(4))
    node = cache.match_prefix(seq(2)).last_node
    cache.inc_lock_ref(node)
    assert cache.evict(10**6) == 2  # the tail goes; its parent, now a leaf, is locked
    cache.dec_lock_ref(node)
    assert cache.evict(10**6) == 2 and alloc.available_size() == 1024


@pytest.mark.parametrize("p", [1, 16])
def test_request_life_cycle_shares_prefix_and_returns_memory(p):
    h = Harness(pool_size=64 * p, page_size=p)
    r1 = h.start(seq(5 * p + 3))
    h.check()
    for tok in range(p + 2):
        h.decode(r1, 7000 + tok)
        h.check()
    h.finish(r1)
    h.check()
    cached = h.cache.total_size()
    assert cached == (5 * p + 3 + p + 2) // p * p
    r2 = h.start(seq(5 * p + 3) + [1, 2, 3])
    assert r2.cache_protected_len == (5 * p + 3) // p * p, "the prompt's whole pages are reused"
    h.check()
    h.finish(r2)
    h.check()
    h.cache.evict(10**6)
    h.check()
    assert h.alloc.available_size() == 64 * p


@pytest.mark.parametrize("p", [1, 16])
def test_cache_unfinished_req_moves_lock_and_frees_duplicates(p):
    h = Harness(pool_size=64 * p, page_size=p)
    prompt = seq(6 * p + 5)
    # another request caches the first 4 pages while r is being prefilled in chunks
    r = h.start(prompt[: 2 * p + 1])  # chunk 1
    other = h.start(prompt[: 4 * p])
    h.finish(other)
    h.check()
    h.extend(r, 5 * p + 2)  # chunk 2, own slots duplicate pages 2..3 of the cache
    r.origin_input_ids = prompt
    h.cache.cache_unfinished_req(r)
    h.check()
    n = (5 * p + 2) // p * p
    assert r.cache_protected_len == n
    row = h.req_pool.req_to_token[r.req_pool_idx, :n].to(torch.int64)
    assert torch.equal(row, h.cache.match_prefix(prompt).device_indices[:n])
    assert h.cache.protected_size() == n
    h.extend(r, len(prompt))
    h.finish(r)
    h.check()
    assert h.cache.protected_size() == 0


def test_reset_and_pretty_print(capsys):
    cache, alloc = make_cache(1)
    insert_fresh(cache, alloc, seq(20))
    insert_fresh(cache, alloc, seq(10) + [5, 5, 5])
    text = cache.pretty_print()
    assert "[10]" in text and "[3]" in text and "#tokens: 23" in text
    cache.reset()
    assert cache.total_size() == 0 and len(cache.match_prefix(seq(20)).device_indices) == 0


def test_disabled_cache_never_reuses_and_returns_memory():
    h = Harness(pool_size=128, disable=True)
    r = h.start(seq(20))
    h.check()
    h.extend(r, 30)
    h.cache.cache_unfinished_req(r)
    h.check()
    h.finish(r)
    h.check()
    r2 = h.start(seq(20))
    assert r2.cache_protected_len == 0
    h.finish(r2)
    assert h.alloc.available_size() == 128


def test_invariant_reports_a_leak_with_numbers():
    h = Harness(pool_size=64)
    r = h.start(seq(10))
    h.live.remove(r)  # forget a live request: its 10 slots are unaccounted
    with pytest.raises(AssertionError, match=r"free 54 \+ evictable 0 \+ protected 0 \+ held by requests 0"):
        h.check()
