"""The memory invariant: every usable KV slot is free, cached (evictable or
protected) or held by exactly one running request."""

from __future__ import annotations

from typing import Iterable

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_aligned
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, CachedReq


def held_by_request(req: CachedReq, page_size: int) -> int:
    """Slots a live request owns: its KV after the cache-owned prefix, in
    whole pages, including slots a queued forward is writing (``kv_inflight``)."""
    if req.req_pool_idx is None:
        return 0
    own = max(req.kv_len + getattr(req, "kv_inflight", 0) - req.cache_protected_len, 0)
    return page_aligned(own, page_size)


def check_memory_invariant(
    allocator: TokenToKVPoolAllocator,
    tree_cache: BasePrefixCache,
    live_reqs: Iterable[CachedReq],
) -> None:
    """Raise AssertionError, with the numbers, unless
    free + evictable + protected + held by live requests == pool size."""
    allocator.check_invariants()
    tree_cache.check_invariants()
    free = allocator.free_size()
    evictable, protected = tree_cache.evictable_size(), tree_cache.protected_size()
    held = sum(held_by_request(r, allocator.page_size) for r in live_reqs)
    if free + evictable + protected + held != allocator.size:
        raise AssertionError(
            f"memory leak: free {free} + evictable {evictable} + protected {protected} "
            f"+ held by requests {held} = {free + evictable + protected + held} != pool size {allocator.size}"
        )
