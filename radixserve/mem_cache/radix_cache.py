"""RadixCache: a radix tree over token ids whose nodes hold KV slot indices.

Keys are compared in whole pages: a match is truncated to a multiple of
``page_size`` and every edge label (``node.key``) is page-aligned, so each node
owns whole pages of the KV pool. Children are indexed by their first page
(a token id when ``page_size == 1``, else a tuple of ``page_size`` ids).

A key may live in a *namespace* (a LoRA adapter's uid, docs/lora.md): KV
computed under one adapter must never serve another, or the base model. A
node's namespace is its whole branch's, and it is part of its index
(``(namespace, first page)``), so a walk in one namespace never enters
another's nodes; the default namespace, None, indexes by the page alone.
"""

from __future__ import annotations

import heapq
import itertools
from typing import TYPE_CHECKING, Callable

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_floor
from radixserve.mem_cache.base_prefix_cache import EMPTY_SLOTS, BasePrefixCache, CachedReq, MatchResult, cache_namespace
from radixserve.mem_cache.memory_pool import ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.mem_cache.kv_events import KVEventRecorder


class TreeNode:
    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "hit_count", "id", "kv_blocks",
                 "host_value", "transfer", "host_ref", "namespace")

    def __init__(self, node_id: int, key: list[int], value: torch.Tensor | None, parent: "TreeNode | None"):
        self.children: dict = {}
        self.parent = parent
        self.key = key
        self.value = value  # device KV slots; None while only the host tier holds the node (hiradix_cache.py)
        self.host_value = None  # the host tier's slots, with --enable-hierarchical-cache
        self.transfer = None  # the copy between tiers in flight, if any
        self.host_ref = 0  # readers of the host copy (file-tier backups, a load-back while it evicts)
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self.id = node_id
        self.kv_blocks = None  # the KV event recorder's (kv_events/recorder.py)
        self.namespace = parent.namespace if parent is not None else None  # see the module's docstring

    def is_leaf(self) -> bool:
        return not self.children

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock={self.lock_ref})"


def common_page_len(a: list[int], b: list[int], page: int) -> int:
    """Length of the common prefix of ``a`` and ``b`` in whole pages.

    Slice comparison runs in C; a binary search over page counts keeps a
    mismatch near the end of a 4k-token key cheap.
    """
    n = page_floor(min(len(a), len(b)), page)
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n // page  # lo pages match, hi pages do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[: mid * page] == b[: mid * page]:
            lo = mid
        else:
            hi = mid
    return lo * page


_EVICTION_PRIORITY: dict[str, Callable[[TreeNode], tuple]] = {
    "lru": lambda n: (n.last_access,),
    "lfu": lambda n: (n.hit_count, n.last_access),
}


class EvictionHeap:
    """A set of eviction candidates (``nodes``) and a lazy min-heap of their
    priorities, so that taking the next victim costs a few heap operations,
    not a walk of the tree. Every unlocked member has an entry at its current
    priority: the owner calls :meth:`offer` whenever a member's priority
    changes or its lock count drops to zero. Entries of nodes that left the
    set, were locked or changed priority since are stale and skipped when
    popped; the heap is rebuilt from the members when stale entries outnumber
    them, so it stays within a few times their count."""

    __slots__ = ("nodes", "_priority", "_heap", "_entries")

    def __init__(self, priority: Callable[[TreeNode], tuple]):
        self.nodes: set[TreeNode] = set()
        self._priority = priority
        # (priority, id, entry number, node): the id breaks ties, the entry number keeps nodes uncompared.
        self._heap: list = []
        self._entries = itertools.count()

    def add(self, node: TreeNode) -> None:
        self.nodes.add(node)
        self.offer(node)

    def discard(self, node: TreeNode) -> None:
        self.nodes.discard(node)

    def offer(self, node: TreeNode) -> None:
        """Enter ``node`` at its current priority if it is a member."""
        if node not in self.nodes:
            return
        heapq.heappush(self._heap, self._entry(node))
        if len(self._heap) > 2 * len(self.nodes) + 1024:
            self._heap = [self._entry(n) for n in self.nodes]
            heapq.heapify(self._heap)

    def _entry(self, node: TreeNode) -> tuple:
        return self._priority(node), node.id, next(self._entries), node

    def pop(self) -> TreeNode | None:
        """The unlocked member of least (priority, id), or None; it stays a
        member until its owner removes it."""
        while self._heap:
            priority, _, _, node = heapq.heappop(self._heap)
            if node in self.nodes and node.lock_ref == 0 and priority == self._priority(node):
                return node
        return None

    def problems(self, expected: set[TreeNode], name: str) -> list[str]:
        """What is wrong with the members against ``expected`` (a full
        recomputation) and with the heap: an unlocked member without an
        entry at its priority would never be popped."""
        out = []
        if expected != self.nodes:
            out.append(f"{name} set: {len(self.nodes - expected)} stale, {len(expected - self.nodes)} missing")
        entered = {node for priority, _, _, node in self._heap if priority == self._priority(node)}
        unentered = [n for n in self.nodes if n.lock_ref == 0 and n not in entered]
        if unentered:
            out.append(f"{name} heap: no entry at the current priority of {unentered[:3]}")
        return out


class RadixCache(BasePrefixCache):
    """Prefix cache over a paged KV pool (see ``base_prefix_cache`` for the
    ownership contract). ``evictable_size`` and ``protected_size`` are counters
    kept by every operation; :meth:`check_invariants` recomputes them.

    ``kv_events``, when given, hears of every node inserted, split and
    evicted, and of every reset (this constructor's too), to publish KV
    events for routers (docs/kv_events.md)."""

    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool | None,
        token_to_kv_pool_allocator: TokenToKVPoolAllocator | None,
        page_size: int = 1,
        eviction_policy: str = "lru",
        kv_events: "KVEventRecorder | None" = None,
    ):
        if eviction_policy not in _EVICTION_PRIORITY:
            raise ValueError(f"eviction_policy must be one of {sorted(_EVICTION_PRIORITY)}, got {eviction_policy!r}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self._priority = _EVICTION_PRIORITY[eviction_policy]
        self.kv_events = kv_events
        self.reset()

    # -- basics ------------------------------------------------------------
    def reset(self) -> None:
        """Forget every cached sequence (the caller clears the allocator)."""
        self._next_id = 0
        self._clock = 0
        self.root = self._new_node([], EMPTY_SLOTS, None)
        self.root.lock_ref = 1  # the root is never evicted
        self._leaves = EvictionHeap(self._priority)  # every node but the root without children
        self._evictable = 0
        self._protected = 0
        if self.kv_events is not None:
            self.kv_events.on_reset()

    def _new_node(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        node = TreeNode(self._next_id, key, value, parent)
        self._next_id += 1
        return node

    def _child_key(self, key: list[int], namespace: str | None = None):
        page = key[0] if self.page_size == 1 else tuple(key[: self.page_size])
        return page if namespace is None else (namespace, page)

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        node.last_access = self._clock
        node.hit_count += 1
        self._offer(node)

    def _offer(self, node: TreeNode) -> None:
        """``node`` changed priority or was unlocked: re-enter it in the
        eviction heaps it is a candidate of."""
        self._leaves.offer(node)

    def _aligned(self, n: int) -> int:
        return page_floor(n, self.page_size)

    def evictable_size(self) -> int:
        return self._evictable

    def protected_size(self) -> int:
        return self._protected

    # -- match / insert ----------------------------------------------------
    def _descend(self, key: list[int], namespace: str | None = None) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Walk down along ``key`` (whole pages only) in ``namespace``, splitting
        the node the match ends inside. Returns the deepest matched node, the
        matched length and the matched nodes' slot tensors. Walks by offset (no
        key copies) and inlines the hot path: this loop runs once per tree level."""
        p = self.page_size
        node, pos, values, end = self.root, 0, [], self._aligned(len(key))
        touched = None
        while pos < end:
            page = key[pos] if p == 1 else tuple(key[pos : pos + p])
            child = node.children.get(page if namespace is None else (namespace, page))
            if child is None:
                break
            self._clock += 1
            child.last_access = self._clock
            child.hit_count += 1
            touched = child  # only the last one touched can be a leaf (the lower half after a split)
            klen = len(child.key)
            segment = key[pos : pos + klen]
            n = klen if segment == child.key else common_page_len(child.key, segment, p)
            if n < klen:
                child = self._split(child, n)
            values.append(child.value)
            node, pos = child, pos + n
        if touched is not None:
            self._offer(touched)
        return node, pos, values

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        """Longest cached prefix of ``key`` in whole pages, in ``namespace``;
        splits a node the match ends inside, so the returned node covers
        exactly the match."""
        node, _, values = self._descend(key, namespace)
        indices = torch.cat(values) if values else EMPTY_SLOTS
        return MatchResult(device_indices=indices, last_node=node)

    def _split(self, child: TreeNode, n: int) -> TreeNode:
        """Cut ``child``'s edge after ``n`` tokens; returns the new upper node."""
        value = child.value
        upper = self._new_node(child.key[:n], None if value is None else value[:n], child.parent)
        upper.lock_ref, upper.last_access, upper.hit_count = child.lock_ref, child.last_access, child.hit_count
        upper.namespace = child.namespace
        upper.transfer, upper.host_ref = child.transfer, child.host_ref
        if child.host_value is not None:
            upper.host_value, child.host_value = child.host_value[:n], child.host_value[n:]
        upper.children[self._child_key(child.key[n:], child.namespace)] = child
        child.parent.children[self._child_key(upper.key, child.namespace)] = upper
        child.key, child.value, child.parent = child.key[n:], None if value is None else value[n:], upper
        if self.kv_events is not None:
            self.kv_events.on_split(upper, child)
        return upper

    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int:
        """Insert ``key`` (truncated to whole pages) with its slots ``value``
        in ``namespace``.

        Returns how many leading tokens were already cached: the caller owns
        ``value[:returned]`` still and must free the ones that differ from the
        cached slots (duplicates)."""
        node, present, _ = self._descend(key, namespace)
        end = self._aligned(len(key))
        if present < end:
            self._add_leaf(node, key[present:end], value[present:end], present, namespace)
        return present

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor | None, start: int,
                  namespace: str | None = None) -> TreeNode:
        """A new leaf under ``parent`` at depth ``start``, on the device when
        ``value`` (its slots) is given; ``namespace`` is its branch's when
        ``parent`` is the root (below it, the parent's)."""
        leaf = self._new_node(list(key), None if value is None else value.to(torch.int64).clone(), parent)
        if parent is self.root:
            leaf.namespace = namespace
        parent.children[self._child_key(leaf.key, leaf.namespace)] = leaf
        self._leaves.discard(parent)
        self._touch(leaf)
        self._leaves.add(leaf)
        if value is not None:
            self._evictable += len(leaf.key)
        if self.kv_events is not None:
            self.kv_events.on_insert(leaf, start)
        return leaf

    # -- locks -------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"RadixCache: unlocking {node} which is not locked")
            if node.lock_ref == 1:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._offer(node)
            node = node.parent

    # -- eviction ----------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Evict unlocked leaves (by policy) until ``num_tokens`` slots are
        freed or nothing is evictable; returns the number freed."""
        self.allocator.free_group_begin()
        freed = 0
        try:
            while freed < num_tokens and (node := self._leaves.pop()) is not None:
                self._drop_leaf(node)  # its parent enters the heap if it is now a leaf
                freed += len(node.key)
            return freed
        finally:
            self.allocator.free_group_end()

    def _drop_leaf(self, leaf: TreeNode) -> None:
        self.allocator.free(leaf.value)
        self._delete_leaf(leaf)

    def _evict_by_policy(self, num_tokens: int, evictable: Callable[[TreeNode], bool],
                         remove: Callable[[TreeNode], None]) -> int:
        """``remove`` the ``evictable`` leaves (a call costs the leaves and
        what it evicts, not the whole tree) in eviction-policy order until
        their keys add up to ``num_tokens``; a node's parent is considered
        once it has been removed. Returns the tokens removed."""
        heap = [(self._priority(n), n.id, n) for n in self._leaves.nodes if evictable(n)]
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            remove(node)
            freed += len(node.key)
            if evictable(parent):
                heapq.heappush(heap, (self._priority(parent), parent.id, parent))
        return freed

    def _delete_leaf(self, leaf: TreeNode) -> TreeNode:
        parent = leaf.parent
        del parent.children[self._child_key(leaf.key, leaf.namespace)]
        self._leaves.discard(leaf)
        if not parent.children and parent is not self.root:
            self._leaves.add(parent)
        if leaf.value is not None:
            self._evictable -= len(leaf.key)
        if self.kv_events is not None:
            self.kv_events.on_evict(leaf)
        return parent

    def _nodes(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # -- request life cycle --------------------------------------------------
    def _req_slots(self, req: CachedReq) -> tuple[list[int], torch.Tensor]:
        tokens = (req.origin_input_ids + req.output_ids)[: req.kv_len]
        slots = self.req_to_token_pool.req_to_token[req.req_pool_idx, : req.kv_len].to(torch.int64)
        return tokens, slots

    def _insert_req(self, req: CachedReq) -> tuple[list[int], torch.Tensor, int]:
        """Insert the request's page-aligned tokens (in its adapter's
        namespace); free its duplicate slots."""
        tokens, slots = self._req_slots(req)
        aligned = self._aligned(len(tokens))
        present = self.insert(tokens[:aligned], slots[:aligned], cache_namespace(req))
        # Slots before cache_protected_len already are the tree's; the request's
        # own slots for tokens that someone else cached meanwhile are duplicates.
        self.allocator.free(slots[req.cache_protected_len : present])
        return tokens, slots, aligned

    def cache_finished_req(self, req: CachedReq) -> None:
        """Give a finished request's KV to the tree, free the rest and its row."""
        _, slots, aligned = self._insert_req(req)
        self.allocator.free(slots[aligned:])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)
        req.req_pool_idx, req.last_node = None, None
        req.prefix_indices, req.cache_protected_len = EMPTY_SLOTS, 0

    def cache_unfinished_req(self, req: CachedReq) -> None:
        """Insert a chunked or running request's KV so far and move its lock to
        the new deepest node; the request keeps its partial last page."""
        tokens, slots, aligned = self._insert_req(req)
        match = self.match_prefix(tokens[:aligned], cache_namespace(req))
        new_slots = match.device_indices
        self.req_to_token_pool.write(req.req_pool_idx, req.cache_protected_len, new_slots[req.cache_protected_len :])
        self.inc_lock_ref(match.last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices, req.last_node, req.cache_protected_len = new_slots, match.last_node, len(new_slots)

    # -- checks --------------------------------------------------------------
    def check_invariants(self) -> None:
        """Recompute sizes and verify the tree's structure; raise on a violation."""
        evictable = protected = 0
        problems = []
        for node in self._nodes():
            if node is self.root:
                continue
            self._check_node(node, problems)
            if len(node.key) == 0 or len(node.key) % self.page_size:
                problems.append(f"{node}: key length {len(node.key)} is not a positive multiple of {self.page_size}")
            if node.parent.children.get(self._child_key(node.key, node.namespace)) is not node:
                problems.append(f"{node}: not indexed under its first page in its parent")
            if node.parent is not self.root and node.namespace != node.parent.namespace:
                problems.append(f"{node}: namespace {node.namespace!r} under its parent's {node.parent.namespace!r}")
            if node.lock_ref < 0 or (node.parent is not self.root and node.parent.lock_ref < node.lock_ref):
                problems.append(f"{node}: lock_ref {node.lock_ref} exceeds its parent's {node.parent.lock_ref}")
            if node.value is None:  # not on the device: not in the device counters
                continue
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        if (evictable, protected) != (self._evictable, self._protected):
            problems.append(
                f"counters evictable={self._evictable} protected={self._protected} "
                f"!= recomputed {evictable} / {protected}"
            )
        problems += self._leaves.problems({n for n in self._nodes() if n is not self.root and not n.children}, "leaf")
        if problems:
            raise AssertionError("RadixCache invariant violated: " + "; ".join(problems[:5]))

    def _check_node(self, node: TreeNode, problems: list[str]) -> None:
        """Append what is wrong with ``node``'s slots to ``problems``."""
        if node.value is None or len(node.value) != len(node.key):
            problems.append(f"{node}: value {None if node.value is None else len(node.value)} "
                            f"!= key length {len(node.key)}")

    def all_values(self) -> torch.Tensor:
        values = [n.value for n in self._nodes() if n is not self.root and n.value is not None]
        return torch.cat(values) if values else EMPTY_SLOTS

    def pretty_print(self) -> str:
        lines = []

        def walk(node: TreeNode, depth: int) -> None:
            for child in node.children.values():
                head = child.key[:8]
                more = "..." if len(child.key) > 8 else ""
                lines.append(f"{'  ' * depth}[{len(child.key)}] {head}{more} lock={child.lock_ref}")
                walk(child, depth + 1)

        walk(self.root, 0)
        lines.append(f"#tokens: {self.total_size()} (evictable {self._evictable}, protected {self._protected})")
        text = "\n".join(lines)
        print(text)
        return text
