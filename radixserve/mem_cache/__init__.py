"""The memory subsystem: request rows, the paged KV pool and its allocator,
the prefix caches (radix tree, or none), and the KV events the radix tree
publishes for routers (``kv_events``)."""

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_aligned, page_floor, pages_for
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache, MatchResult
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.invariants import check_memory_invariant, held_by_request
from radixserve.mem_cache.kv_events import KVEventRecorder
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, PoolExhausted, ReqToTokenPool
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode

__all__ = [
    "BasePrefixCache",
    "ChunkCache",
    "KVEventRecorder",
    "MHATokenToKVPool",
    "MatchResult",
    "PoolExhausted",
    "RadixCache",
    "ReqToTokenPool",
    "TokenToKVPoolAllocator",
    "TreeNode",
    "check_memory_invariant",
    "held_by_request",
    "page_aligned",
    "page_floor",
    "pages_for",
]
