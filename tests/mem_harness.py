"""A minimal request life cycle over the memory subsystem, for cache tests:
what the scheduler does, without a model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, rule

from radixserve.mem_cache import (
    ChunkCache,
    RadixCache,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    check_memory_invariant,
)


@dataclass
class FakeReq:
    origin_input_ids: list[int]
    output_ids: list[int] = field(default_factory=list)
    req_pool_idx: int | None = None
    kv_len: int = 0
    prefix_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    cache_protected_len: int = 0
    last_node: object = None


class Harness:
    def __init__(self, pool_size=256, page_size=1, max_reqs=16, max_len=512, policy="lru", disable=False,
                 allocator=None):
        self.page_size = page_size
        self.req_pool = ReqToTokenPool(max_reqs, max_len)
        self.alloc = allocator if allocator is not None else TokenToKVPoolAllocator(pool_size, page_size)
        cls = ChunkCache if disable else RadixCache
        kwargs = {} if disable else {"eviction_policy": policy}
        self.cache = cls(self.req_pool, self.alloc, page_size, **kwargs)
        self.live: list[FakeReq] = []

    def check(self):
        check_memory_invariant(self.alloc, self.cache, self.live)

    def start(self, tokens: list[int]) -> FakeReq | None:
        """Admit a request: match, lock, allocate the rest (evicting if needed)."""
        req = FakeReq(list(tokens))
        m = self.cache.match_prefix(tokens)
        req.prefix_indices, req.last_node = m.device_indices, m.last_node
        req.cache_protected_len = len(m.device_indices)
        self.cache.inc_lock_ref(m.last_node)
        req.req_pool_idx = self.req_pool.alloc(1)[0]
        self.req_pool.write(req.req_pool_idx, 0, m.device_indices)
        req.kv_len = len(m.device_indices)
        self.live.append(req)
        if not self.extend(req, len(tokens)):
            self.abort(req)
            return None
        return req

    def _last_loc(self, req: FakeReq) -> int:
        return int(self.req_pool.req_to_token[req.req_pool_idx, req.kv_len - 1]) if req.kv_len else 0

    def extend(self, req: FakeReq, new_len: int) -> bool:
        """Allocate KV for positions kv_len .. new_len-1."""
        args = (torch.tensor([req.kv_len]), torch.tensor([new_len]), torch.tensor([self._last_loc(req)]))
        slots = self.alloc.alloc_extend(*args)
        if slots is None:
            need = -(-new_len // self.page_size) * self.page_size
            self.cache.evict(need)
            slots = self.alloc.alloc_extend(*args)
        if slots is None:
            return False
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        req.kv_len = new_len
        return True

    def decode(self, req: FakeReq, token: int) -> bool:
        req.output_ids.append(token)
        return self.extend(req, req.kv_len + 1)

    def finish(self, req: FakeReq):
        self.live.remove(req)
        self.cache.cache_finished_req(req)

    def abort(self, req: FakeReq):
        """Abort frees the request's own KV without caching it."""
        self.live.remove(req)
        own = self.req_pool.req_to_token[req.req_pool_idx, req.cache_protected_len : req.kv_len].to(torch.int64)
        self.alloc.free(own)
        self.req_pool.free(req.req_pool_idx)
        self.cache.dec_lock_ref(req.last_node)


# Keys from a tiny alphabet, so that random requests share prefixes often.
request_tokens = st.lists(st.integers(0, 2), min_size=1, max_size=24)
MAX_LIVE = 5  # requests running at once in the rules below


class RequestRules(RuleBasedStateMachine):
    """Hypothesis rules for the request life cycle over ``self.h`` (a
    ``Harness``, made by the subclass's ``@initialize`` rule): requests start,
    decode, finish and abort, and keys are matched.

    Every rule is always enabled and draws the same values whatever the
    state (a request is picked by an index into the live ones; a rule with
    none to act on does nothing): whether a request got in can depend on a
    background thread's timing (the elastic pool's mapper), and Hypothesis
    rejects a test whose draws change with something it does not control."""

    @rule(key=request_tokens)
    def start(self, key):
        if len(self.h.live) < MAX_LIVE:
            self.h.start(key)

    def live_request(self, pick: int) -> FakeReq | None:
        """The live request ``pick`` names (an index, wrapped), None if none is live."""
        return self.h.live[pick % len(self.h.live)] if self.h.live else None

    @rule(pick=st.integers(0, MAX_LIVE - 1), token=st.integers(0, 2))
    def decode(self, pick, token):
        req = self.live_request(pick)
        if req is not None and not self.h.decode(req, token):
            req.output_ids.pop()

    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def finish(self, pick):
        if (req := self.live_request(pick)) is not None:
            self.h.finish(req)

    @rule(pick=st.integers(0, MAX_LIVE - 1))
    def abort(self, pick):
        if (req := self.live_request(pick)) is not None:
            self.h.abort(req)

    @rule(key=request_tokens)
    def match(self, key):
        self.h.cache.match_prefix(key)  # splits, hit counts (and the hierarchical cache's selective backups)
