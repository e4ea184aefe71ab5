"""Property-based tests: random sequences of match / insert / lock / unlock /
evict / finish / chunk / abort against a simple reference (the map from every
cached page-aligned prefix to its KV slots), with every invariant checked
after every operation."""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mem_harness import Harness

# Tokens from a tiny alphabet so that random keys share prefixes often.
tokens = st.lists(st.integers(0, 1), min_size=0, max_size=16)


def tree_contents(cache) -> dict[tuple, list[int]]:
    """Every cached page-aligned prefix -> the slots of its tokens."""
    out = {}

    def walk(node, key, slots):
        for child in node.children.values():
            k, s = key + list(child.key), slots + child.value.tolist()
            for end in range(cache.page_size, len(child.key) + 1, cache.page_size):
                n = len(key) + end
                out[tuple(k[:n])] = s[:n]
            walk(child, k, s)

    walk(cache.root, [], [])
    return out


class CacheMachine(RuleBasedStateMachine):
    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(["lru", "lfu"]))
    def setup(self, page_size, policy):
        self.h = Harness(pool_size=48 * page_size, page_size=page_size, max_reqs=6, max_len=128, policy=policy)
        self.p = page_size
        self.ref: dict[tuple, list[int]] = {}
        self.locks = []  # nodes locked by the test itself, with the prefix they cover

    # -- reference helpers --------------------------------------------------
    def _ref_match(self, key):
        best = []
        for n in range(self.p, len(key) + 1, self.p):
            if tuple(key[:n]) in self.ref:
                best = self.ref[tuple(key[:n])]
        return best

    def _ref_insert(self, key, slots):
        # Cached prefixes keep their slots; a new page extends its parent's.
        for n in range(self.p, len(key) // self.p * self.p + 1, self.p):
            parent = self.ref.get(tuple(key[: n - self.p]), [])
            self.ref.setdefault(tuple(key[:n]), parent + slots[n - self.p : n])

    def _protected_prefixes(self):
        out = set()
        for req in self.h.live:
            out.add(tuple((req.origin_input_ids + req.output_ids)[: req.cache_protected_len]))
        for _, key in self.locks:
            out.add(tuple(key))
        return out

    # -- rules ----------------------------------------------------------------
    @rule(key=tokens)
    def match(self, key):
        got = self.h.cache.match_prefix(key).device_indices.tolist()
        assert got == self._ref_match(key)

    @precondition(lambda self: len(self.h.live) < 5)
    @rule(key=tokens.filter(len))
    def start(self, key):
        expected_prefix = self._ref_match(key)
        req = self.h.start(key)
        if req is not None:
            assert req.prefix_indices.tolist() == expected_prefix
        self._sync_after_possible_eviction()

    @precondition(lambda self: 0 < len(self.h.live) < 5)
    @rule(data=st.data(), extra=tokens)
    def start_sharing(self, data, extra):
        """Start a request that repeats a live one's tokens: when both finish,
        the second one's KV duplicates the first one's."""
        other = data.draw(st.sampled_from(self.h.live))
        self.start(other.origin_input_ids + other.output_ids + extra)

    @precondition(lambda self: self.h.live)
    @rule(data=st.data(), tok=st.integers(0, 2))
    def decode(self, data, tok):
        req = data.draw(st.sampled_from(self.h.live))
        if not self.h.decode(req, tok):
            req.output_ids.pop()
        self._sync_after_possible_eviction()

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.h.live))
        toks = (req.origin_input_ids + req.output_ids)[: req.kv_len]
        slots = self.h.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()
        self.h.finish(req)
        self._ref_insert(toks, slots)

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def chunk(self, data):
        req = data.draw(st.sampled_from(self.h.live))
        toks = (req.origin_input_ids + req.output_ids)[: req.kv_len]
        slots = self.h.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()
        self.h.cache.cache_unfinished_req(req)
        self._ref_insert(toks, slots)
        aligned = len(toks) // self.p * self.p
        assert req.cache_protected_len == aligned
        row = self.h.req_pool.req_to_token[req.req_pool_idx, :aligned].tolist()
        assert row == self.ref.get(tuple(toks[:aligned]), [])

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def abort(self, data):
        self.h.abort(data.draw(st.sampled_from(self.h.live)))

    @rule(key=tokens)
    def lock(self, key):
        m = self.h.cache.match_prefix(key)
        if m.last_node is not self.h.cache.root:
            self.h.cache.inc_lock_ref(m.last_node)
            self.locks.append((m.last_node, key[: len(m.device_indices)]))

    @precondition(lambda self: self.locks)
    @rule(data=st.data())
    def unlock(self, data):
        i = data.draw(st.integers(0, len(self.locks) - 1))
        node, _ = self.locks.pop(i)
        self.h.cache.dec_lock_ref(node)

    @rule(n=st.integers(0, 64))
    def evict(self, n):
        """Each leaf evicted is, when it goes, one of the lowest priority among
        the unlocked leaves of the whole tree (the policy, checked by a walk
        of the tree against the cache's incrementally kept heap)."""
        cache = self.h.cache
        evictable = cache.evictable_size()
        drop = cache._drop_leaf

        def checked_drop(leaf):
            candidates = [m for m in cache._nodes() if m is not cache.root and not m.children and m.lock_ref == 0]
            assert cache._priority(leaf) == min(cache._priority(m) for m in candidates)
            drop(leaf)

        cache._drop_leaf = checked_drop
        try:
            freed = cache.evict(n)
        finally:
            del cache._drop_leaf
        assert freed >= min(n, evictable) or freed == evictable
        self._sync_after_possible_eviction()

    def _sync_after_possible_eviction(self):
        """Eviction may drop any unlocked prefixes: what remains must be a
        subset of the reference, prefix-closed, and keep every locked prefix."""
        now = tree_contents(self.h.cache)
        for k, slots in now.items():
            assert self.ref.get(k) == slots, f"prefix {k} has slots {slots}, reference {self.ref.get(k)}"
        for k in self._protected_prefixes():
            for n in range(self.p, len(k) + 1, self.p):
                assert tuple(k[:n]) in now, f"locked prefix {k[:n]} was evicted"
        self.ref = now

    # -- invariants ---------------------------------------------------------------
    @invariant()
    def memory_accounting(self):
        if hasattr(self, "h"):
            self.h.check()
            assert tree_contents(self.h.cache) == self.ref
            held = torch.cat(
                [self.h.req_pool.req_to_token[r.req_pool_idx, r.cache_protected_len : r.kv_len] for r in self.h.live]
                or [torch.empty(0, dtype=torch.int32)]
            )
            cached = self.h.cache.all_values()
            everything = torch.cat([held.to(torch.int64), cached])
            assert len(torch.unique(everything)) == len(everything), "a slot is owned twice"
            assert bool(self.h.alloc.slot_in_use[everything].all()), "an owned slot is marked free"


CacheMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestRadixCacheProperties = CacheMachine.TestCase


class ChunkCacheMachine(RuleBasedStateMachine):
    """The same request life cycle over ChunkCache (``--disable-radix-cache``):
    nothing is ever cached, so every live request owns all of its KV, a
    finished or aborted one gives all of it back, and an idle pool is whole."""

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.h = Harness(pool_size=48 * page_size, page_size=page_size, max_reqs=6, max_len=128, disable=True)
        self.p = page_size

    def _row(self, req):
        return self.h.req_pool.req_to_token[req.req_pool_idx, : req.kv_len].tolist()

    @rule(key=tokens)
    def match(self, key):
        m = self.h.cache.match_prefix(key)
        assert m.device_indices.tolist() == [] and m.last_node is None

    @rule(key=tokens)
    def insert(self, key):
        slots = self.h.alloc.alloc(len(key)) if key else None
        if slots is not None:
            assert self.h.cache.insert(key, slots) == 0  # nothing is kept: the caller frees
            self.h.alloc.free(slots)

    @precondition(lambda self: len(self.h.live) < 5)
    @rule(key=tokens.filter(len), share=st.booleans())
    def start(self, key, share):
        if share and self.h.live:  # a repeated prompt gets no hit either
            key = self.h.live[0].origin_input_ids + key
        req = self.h.start(key)
        if req is not None:
            assert req.prefix_indices.tolist() == [] and req.kv_len == len(key)

    @precondition(lambda self: self.h.live)
    @rule(data=st.data(), tok=st.integers(0, 2))
    def decode(self, data, tok):
        req = data.draw(st.sampled_from(self.h.live))
        if not self.h.decode(req, tok):
            req.output_ids.pop()

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def chunk(self, data):
        req = data.draw(st.sampled_from(self.h.live))
        free = self.h.alloc.available_size()
        self.h.cache.cache_unfinished_req(req)
        assert req.prefix_indices.tolist() == self._row(req), "the next chunk continues after all of its KV"
        assert req.cache_protected_len == 0 and self.h.alloc.available_size() == free

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(self.h.live))
        free, own = self.h.alloc.available_size(), held_pages(req, self.p)
        self.h.finish(req)
        assert req.req_pool_idx is None
        assert self.h.alloc.available_size() == free + own, "a finished request gives all of its KV back"

    @precondition(lambda self: self.h.live)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(self.h.live))
        free, own = self.h.alloc.available_size(), held_pages(req, self.p)
        self.h.abort(req)
        assert self.h.alloc.available_size() == free + own

    @rule(n=st.integers(0, 64))
    def evict(self, n):
        free = self.h.alloc.available_size()
        assert self.h.cache.evict(n) == 0 and self.h.alloc.available_size() == free

    @invariant()
    def memory_accounting(self):
        if not hasattr(self, "h"):
            return
        self.h.check()
        assert self.h.cache.evictable_size() == self.h.cache.protected_size() == 0
        held = [s for r in self.h.live for s in self._row(r)]
        assert len(set(held)) == len(held), "a slot is owned twice"
        assert bool(self.h.alloc.slot_in_use[torch.tensor(held, dtype=torch.int64)].all())
        if not self.h.live:
            assert self.h.alloc.available_size() == self.h.alloc.size


def held_pages(req, page_size) -> int:
    return -(-req.kv_len // page_size) * page_size


ChunkCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestChunkCacheProperties = ChunkCacheMachine.TestCase
