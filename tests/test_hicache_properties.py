"""A Hypothesis state machine over the two-tier radix tree (docs/hicache.md):
random requests that match, load back, extend, decode, finish and abort,
with device evictions (demotions), host evictions, every write policy and
eviction policy, and copies that complete some steps after they are issued.
After every step: the memory invariant over both tiers, and the KV itself:
every cached token's device and host copies hold what its forward wrote.
Every node the device gives up is, when it goes, the policy's first choice
among the whole tree's unlocked device leaves."""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, rule

from mem_harness import Harness, RequestRules, request_tokens
from radixserve.feature_args import HICACHE_WRITE_POLICIES
from radixserve.mem_cache import MHATokenToKVPool
from radixserve.mem_cache import hiradix_cache
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.host_pool import HostKVPool

LAYERS = 2
THRESHOLD = hiradix_cache.LOAD_BACK_THRESHOLD


def kv_value(token: int, pos: int, layer: int) -> float:
    return token * 1000.0 + pos + 0.25 * layer


class LaggingEvent:
    """A copy's completion event that passes only at its ``lag``-th query,
    as a GPU copy that takes a few scheduler steps would."""

    def __init__(self, lag: int):
        self.lag = lag

    def query(self) -> bool:
        self.lag -= 1
        return self.lag < 0

    def synchronize(self) -> None:
        self.lag = -1


class HiHarness(Harness):
    """The request life cycle of ``mem_harness`` over a HiRadixCache whose
    "forward" writes a KV value that names each token and position, and
    whose copies complete ``lag`` polls after they are issued."""

    def __init__(self, pool_size, page_size, host_size, policy, lag, eviction="lru"):
        super().__init__(pool_size=pool_size, page_size=page_size, max_reqs=6, max_len=128)
        self.kv = MHATokenToKVPool(pool_size, page_size, torch.float32, head_num=1, head_dim=2, layer_num=LAYERS)
        host = HostKVPool(self.kv, host_size)
        self.cache = cache = HiRadixCache(self.req_pool, self.alloc, page_size, host, policy, eviction)
        demote = cache._demote

        def copy(stream, issue, after):
            issue()
            return LaggingEvent(lag)

        def checked_demote(node):
            """The node the device gives up has the least (priority, id) of
            the unlocked device leaves, found by a walk of the whole tree
            (against the cache's incrementally kept heap)."""
            leaves = [m for m in cache._nodes() if m is not cache.root and m.value is not None and m.lock_ref == 0
                      and all(c.value is None for c in m.children.values())]
            assert node in leaves, f"{node} is not an unlocked device leaf"
            assert (cache._priority(node), node.id) == min((cache._priority(m), m.id) for m in leaves)
            return demote(node)

        cache._copy = copy
        cache._demote = checked_demote

    def start(self, tokens):
        m = self.cache.match_prefix(tokens)
        budget = self.alloc.available_size() + self.cache.evictable_size()
        wait, _ = self.cache.fetch(tokens, m, budget)
        while wait is not None and not wait.finished:  # the request waits in the queue
            self.cache.poll()
        return super().start(tokens)

    def extend(self, req, new_len):
        start = req.kv_len
        if not super().extend(req, new_len):
            return False
        seq = req.origin_input_ids + req.output_ids
        slots = self.req_pool.req_to_token[req.req_pool_idx, start:new_len].to(torch.int64)
        for layer in range(LAYERS):
            values = torch.tensor([kv_value(seq[p], p, layer) for p in range(start, new_len)])
            self.kv.k_buffer[layer][slots] = values[:, None, None]
        return True


class HiCacheMachine(RequestRules):
    @initialize(page_size=st.sampled_from([1, 2, 4]), policy=st.sampled_from(HICACHE_WRITE_POLICIES),
                host_pages=st.integers(48, 120), lag=st.integers(0, 3), eviction=st.sampled_from(["lru", "lfu"]))
    def setup(self, page_size, policy, host_pages, lag, eviction):
        hiradix_cache.LOAD_BACK_THRESHOLD = 1  # short keys: load back any host hit (restored in teardown)
        self.h = HiHarness(48 * page_size, page_size, host_pages * page_size, policy, lag, eviction)

    @rule(key=request_tokens)
    def serve(self, key):
        """A request's whole life in one step, so the tree fills up quickly."""
        req = self.h.start(key)
        if req is not None:
            self.h.finish(req)

    @rule(n=st.integers(1, 64))
    def evict(self, n):
        evictable = self.h.cache.evictable_size()
        assert self.h.cache.evict(n) >= min(n, evictable)  # every unlocked device token can go

    @rule()
    def poll(self):
        self.h.cache.poll()

    def teardown(self):
        hiradix_cache.LOAD_BACK_THRESHOLD = THRESHOLD

    @invariant()
    def both_tiers_hold_what_was_written(self):
        if not hasattr(self, "h"):
            return
        self.h.check()
        cache, host = self.h.cache, self.h.cache.host
        stack = [(cache.root, [])]
        while stack:
            node, path = stack.pop()
            for child in node.children.values():
                seq = path + list(child.key)
                want = torch.tensor([[kv_value(t, p, 0)] for p, t in enumerate(seq)][len(path):])
                if child.value is not None and child.transfer is None:
                    assert torch.equal(self.h.kv.k_buffer[0][child.value][:, :, 0], want), f"device KV of {child}"
                if child.host_value is not None and child.transfer is None:
                    assert torch.equal(host.read(child.host_value)[:, 0, 0, :, 0], want), f"host KV of {child}"
                stack.append((child, seq))


HiCacheMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestHiCacheProperties = HiCacheMachine.TestCase
