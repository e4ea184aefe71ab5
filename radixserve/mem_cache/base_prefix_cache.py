"""The contract every prefix cache (radix tree, or none) offers the scheduler.

Ownership: a KV slot is owned either by the cache (it holds a token of a cached
sequence) or by exactly one running request. A request's first
``req.cache_protected_len`` tokens are owned by the cache and locked through
``req.last_node``; the slots after that belong to the request until the cache
takes them in ``cache_finished_req`` / ``cache_unfinished_req``.

Slot indices returned by ``match_prefix`` stay valid only while the returned
node is locked (``inc_lock_ref``); an unlocked node may be evicted.

Keys live in namespaces: a request's is its LoRA adapter's uid
(``cache_namespace``; None for the base model), and a match never crosses
from one namespace into another (docs/lora.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Protocol

import torch

EMPTY_SLOTS = torch.empty(0, dtype=torch.int64)  # the slots of a match of nothing


class CachedReq(Protocol):
    """What the caches read and update on a request."""

    req_pool_idx: int | None
    origin_input_ids: list[int]
    output_ids: list[int]
    kv_len: int  # tokens whose KV slots are allocated in its req_to_token row
    prefix_indices: torch.Tensor  # slots of the cache-owned prefix
    cache_protected_len: int
    last_node: Any


def cache_namespace(req: Any) -> str | None:
    """The namespace of a request's KV: its LoRA adapter's uid, None for the
    base model (or a stand-in request without the attribute)."""
    return getattr(req, "lora_id", None)


@dataclass
class MatchResult:
    device_indices: torch.Tensor  # int64 KV slots of the matched prefix
    last_node: Any  # the deepest matched node; lock it to keep the slots
    # The hierarchical cache's: tokens after the device prefix that a lower
    # tier holds, and the deepest node of them (``fetch`` loads them back).
    host_hit_length: int = 0
    last_host_node: Any = None


class BasePrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult: ...

    @abstractmethod
    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int: ...

    @abstractmethod
    def evict(self, num_tokens: int) -> int: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def cache_finished_req(self, req: CachedReq) -> None: ...

    @abstractmethod
    def cache_unfinished_req(self, req: CachedReq) -> None: ...

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def reset(self) -> None: ...

    def fetch(self, key: list[int], match: MatchResult, budget: int) -> tuple[Any, int]:
        """Start bringing the part of ``key`` that a lower tier holds onto the
        device, taking at most ``budget`` device slots. Returns what the
        request waits for in the queue (something with ``finished`` and
        ``deadline``; None for nothing) and the device slots taken now. A
        one-tier cache has nothing to fetch."""
        return None, 0

    def prefetch(self, key: list[int]) -> None:
        """A request with prompt ``key`` arrived: start reading what only a
        storage tier holds of it into host memory, so that it is in the tree
        by the time the request is admitted. A cache without one has none."""

    def poll(self) -> None:
        """Complete the copies between tiers that have finished (every step)."""

    def busy(self) -> bool:
        """Whether copies between tiers are still in flight."""
        return False

    def wait(self) -> None:
        """Block briefly until some copy between tiers may have finished."""

    def close(self) -> None:
        """Finish what the lower tiers have in flight and stop their threads."""

    def tier_stats(self) -> dict[str, int]:
        """Usage and hit counters of the lower tiers (none here)."""
        return {}

    def total_size(self) -> int:
        return self.evictable_size() + self.protected_size()

    def check_invariants(self) -> None:
        """Raise AssertionError if the cache's own bookkeeping is inconsistent."""

    def pretty_print(self) -> str:
        return f"{type(self).__name__}(evictable={self.evictable_size()}, protected={self.protected_size()})"
