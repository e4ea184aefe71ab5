"""The prefix cache with reuse disabled (``--disable-radix-cache``): the same
interface as RadixCache, but nothing is ever cached, so every request owns all
of its KV and returns it when it finishes."""

from __future__ import annotations

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.base_prefix_cache import EMPTY_SLOTS, BasePrefixCache, CachedReq, MatchResult
from radixserve.mem_cache.memory_pool import ReqToTokenPool


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator | None,
        page_size: int = 1,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size

    def reset(self) -> None:
        pass

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        return MatchResult(device_indices=EMPTY_SLOTS, last_node=None)

    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        return 0

    def inc_lock_ref(self, node) -> None:
        pass

    def dec_lock_ref(self, node) -> None:
        pass

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def cache_finished_req(self, req: CachedReq) -> None:
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        self.allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.prefix_indices = None, EMPTY_SLOTS

    def cache_unfinished_req(self, req: CachedReq) -> None:
        # The request keeps owning everything; record it as its "prefix" so the
        # next chunk continues after it.
        req.prefix_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
