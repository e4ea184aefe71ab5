"""HiRadixCache: the radix tree over two tiers of KV, the device pool and a
host pool (``host_pool.py``), with an optional file tier below the host
(``hicache_storage.py``). SGLang's HiCache, in our own terms.

Where a node's KV lives (``value`` device slots, ``host_value`` host slots):

    value   host_value
    slots   None         device only (not backed up)
    slots   slots        both: evicting it from the device only frees its device slots
    None    slots        host only: demoted; a match that reaches it loads it back

- **Backups** (device → host) follow ``--hicache-write-policy``: on insert
  (``write_through``), once a node has been hit twice (``write_through_selective``),
  or when the device evicts it (``write_back``).
- **Load-back** (host → device): ``fetch`` gives the host-only nodes a match
  ends in fresh device slots and queues the copy; the request waits in the
  queue, other requests keep running, and the next match after the copy
  finishes finds them on the device.
- **Host eviction**: host-only leaves, least recently used first, when a
  backup or a prefetch needs host slots.

A copy in flight is a ``_Transfer`` on its nodes (``node.transfer``) until
``poll`` sees it done. A load-back locks its nodes (lock references, so
they are protected and the request waiting for them finds them). A backup
locks nothing: its nodes stay evictable, and evicting one while its copy
runs makes the forward stream wait for the write stream, so that no forward
writes the freed slots before the copy has read them (and a load-back
reads the host copy only after the write stream, too). So a backup never
holds device memory that running requests need. On CUDA, backups and loads
run on streams of their own, ordered by stream waits and completed by
events (no host syncs); off CUDA the copies are done when issued and the
same code runs.

Invariants (``check_invariants``): every node has a copy in some tier; the
device nodes form the top of the tree (a device node's parent is on the
device); the device counters (evictable, protected) count device nodes
only; device eviction's candidates, kept as the tree changes, are the
device nodes without a device child; and host slots held by nodes + host
slots being prefetched + free host slots == the host pool's size; and the
host copies pinned (``host_ref``) are those of the readers in flight. KV
events (``kv_events``) count a block as stored while its node is in the
tree, in any tier.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from radixserve.feature_args import HICACHE_WRITE_POLICIES
from radixserve.mem_cache.base_prefix_cache import EMPTY_SLOTS, MatchResult
from radixserve.mem_cache.hicache_file_hooks import FileTierHooks, HostPin
from radixserve.mem_cache.host_pool import HostKVPool
from radixserve.mem_cache.radix_cache import EvictionHeap, RadixCache, TreeNode, common_page_len

SELECTIVE_HITS = 2  # write_through_selective backs a node up at its second hit
LOAD_BACK_THRESHOLD = 16  # host tokens worth a load-back (fewer are recomputed)
WAIT_S = 0.002  # an idle scheduler's wait for the file tier's thread


class TransferKind(enum.Enum):
    WRITE = "write"  # a backup, device -> host
    LOAD = "load"  # a load-back, host -> device


class _Transfer:
    """A copy between tiers in flight: a backup (``WRITE``) or a load-back (``LOAD``) of ``nodes`` (top-down;
    ``tokens`` each, with the parts a split puts above it), done once ``event`` has passed."""

    __slots__ = ("kind", "nodes", "tokens", "event", "keep", "finished", "deadline", "held")

    def __init__(self, kind: TransferKind, nodes: list[TreeNode], keep: tuple):
        self.kind, self.nodes, self.keep = kind, nodes, keep  # keep: its index tensors, alive until done
        self.tokens = [len(n.key) for n in nodes]
        self.held: list[HostPin] = []  # file-tier backups below, waiting for this copy to land
        self.event = None
        self.finished = False
        self.deadline = math.inf  # a load-back is always waited for

    def done(self) -> bool:
        return self.event is None or self.event.query()


class _Walk(NamedTuple):
    """Where a walk down the tree along a key ends, in each tier."""

    device_node: TreeNode  # the deepest node on the device (the root when none)
    device_values: list[torch.Tensor]  # the slots of the device nodes, top-down
    device_len: int  # the tokens they hold
    host_node: TreeNode | None  # the deepest node of the lower tiers' continuation, if any
    host_len: int  # the tokens of that continuation

    @property
    def deepest(self) -> TreeNode:
        """The last node the walk reached, in any tier."""
        return self.host_node or self.device_node


@dataclass
class HiCacheStats:
    """Token counters of the tiers since start (``/metrics``, ``/get_server_info``)."""

    hicache_backed_up: int = 0  # device → host
    hicache_backup_skipped: int = 0  # no host room
    hicache_loaded_back: int = 0  # host → device
    hicache_host_evicted: int = 0
    hicache_storage_prefetched: int = 0  # file tier → host


def _no_namespace(namespace: str | None) -> None:
    """The tiers below the device key KV by content alone: no LoRA namespaces
    (``--enable-lora`` refuses the hierarchical cache)."""
    if namespace is not None:
        raise ValueError("the hierarchical cache does not key prefixes by LoRA adapter")


class HiRadixCache(FileTierHooks, RadixCache):
    def __init__(self, req_to_token_pool, token_to_kv_pool_allocator, page_size: int, host_pool: HostKVPool,
                 write_policy: str = "write_through", eviction_policy: str = "lru", kv_events=None,
                 storage=None, forward_stream=None, tp_group=None):
        if write_policy not in HICACHE_WRITE_POLICIES:
            raise ValueError(f"hicache_write_policy must be one of {list(HICACHE_WRITE_POLICIES)}, "
                             f"got {write_policy!r}")
        self.host = host_pool
        self.write_policy = write_policy
        self.storage = storage  # hicache_storage.FileTier, or None
        # Under tensor parallelism each rank copies its own KV heads, and its
        # copies finish when they do: ``poll`` finishes only those done on
        # every rank, so the ranks' trees stay the same.
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self.stats = HiCacheStats()
        device = host_pool.device_pool.device
        cuda = device.type == "cuda"
        # The stream forwards run on (their KV writes and reads order the copies).
        self._forward_stream = forward_stream or (torch.cuda.current_stream(device) if cuda else None)
        self._write_stream = torch.cuda.Stream(device) if cuda else None
        self._load_stream = torch.cuda.Stream(device) if cuda else None
        self._writes: deque[_Transfer] = deque()
        self._loads: deque[_Transfer] = deque()
        self._arrivals: list[list[int]] = []  # prompts to prefetch from file at the next poll
        # Not cleared by a reset: a backup in flight then releases its pin on the old tree's nodes.
        self._host_pins: set[HostPin] = set()
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, eviction_policy, kv_events)

    def reset(self) -> None:
        """Forget every cached sequence in both tiers (the file tier keeps its
        files: they are keyed by content and stay valid)."""
        self.synchronize()
        super().reset()
        # The device eviction candidates: the nodes on the device without a child there. A node whose
        # children are all host-only is one though it is no leaf of the tree, so these are kept apart.
        self._device_leaves = EvictionHeap(self._priority)
        self.host.allocator.clear()
        self._arrivals = []
        if self.storage is not None:
            self.storage.reset()

    # -- match / insert ------------------------------------------------------------
    def _walk(self, key: list[int]) -> _Walk:
        """Walk down along ``key`` in whole pages, splitting the node the match
        ends inside."""
        p = self.page_size
        node, pos, end = self.root, 0, self._aligned(len(key))
        device_node, device_len, values = self.root, 0, []
        while pos < end:
            child = node.children.get(key[pos] if p == 1 else tuple(key[pos : pos + p]))
            if child is None:
                break
            self._touch(child)
            klen = len(child.key)
            segment = key[pos : pos + klen]
            n = klen if segment == child.key else common_page_len(child.key, segment, p)
            if n < klen:
                child = self._split(child, n)
            ready = child.value is not None and (child.transfer is None or child.transfer.kind is TransferKind.WRITE)
            if ready and node is device_node:
                device_node, device_len = child, pos + n
                values.append(child.value)
            node, pos = child, pos + n
        host_node = node if node is not device_node else None
        return _Walk(device_node, values, device_len, host_node, pos - device_len)

    def match_prefix(self, key: list[int], namespace: str | None = None) -> MatchResult:
        _no_namespace(namespace)
        walk = self._walk(key)
        if self.write_policy == "write_through_selective":
            self._backup(self._chain(walk.device_node, self.root, lambda n: n.hit_count >= SELECTIVE_HITS))
        indices = torch.cat(walk.device_values) if walk.device_values else EMPTY_SLOTS
        return MatchResult(indices, walk.device_node, walk.host_len, walk.host_node)

    def insert(self, key: list[int], value: torch.Tensor, namespace: str | None = None) -> int:
        """As ``RadixCache.insert``; host-only nodes on the way take the
        caller's slots for their tokens (they come back to the device)."""
        _no_namespace(namespace)
        walk = self._walk(key)
        host_chain = self._chain(walk.host_node, walk.device_node) if walk.host_node is not None else []
        if any(n.transfer is not None and n.transfer.kind is TransferKind.LOAD for n in host_chain):
            self._settle()  # a load-back of these tokens is in flight: let it finish, then look again
            return self.insert(key, value)
        pos = walk.device_len
        for n in host_chain:
            self._to_device(n, value[pos : pos + len(n.key)].to(torch.int64).clone())
            pos += len(n.key)
        end = self._aligned(len(key))
        if pos < end:
            leaf = self._add_leaf(walk.deepest, key[pos:end], value[pos:end], pos)
            if self.write_policy == "write_through":
                self._backup([leaf])
        return walk.device_len

    def _add_leaf(self, parent: TreeNode, key: list[int], value: torch.Tensor | None, start: int,
                  namespace: str | None = None) -> TreeNode:
        leaf = super()._add_leaf(parent, key, value, start, namespace)
        if value is not None:
            self._joined_device(leaf)
        return leaf

    def _to_device(self, node: TreeNode, slots: torch.Tensor) -> None:
        """Give host-only ``node`` (under a device node) device ``slots``."""
        node.value = slots
        self._evictable += len(node.key)
        self._joined_device(node)

    def _joined_device(self, node: TreeNode) -> None:
        """``node`` has come onto the device: no child of it is there (the
        device nodes are the top of the tree), and its parent has a device
        child now."""
        self._device_leaves.discard(node.parent)
        self._device_leaves.add(node)

    def _left_device(self, node: TreeNode) -> None:
        """``node`` has left the device (demoted or deleted): its parent may
        have no device child left."""
        self._device_leaves.discard(node)
        parent = node.parent
        if parent is not self.root and self._is_device_leaf(parent):
            self._device_leaves.add(parent)

    @staticmethod
    def _is_device_leaf(node: TreeNode) -> bool:
        return node.value is not None and not any(c.value is not None for c in node.children.values())

    def _offer(self, node: TreeNode) -> None:
        super()._offer(node)
        self._device_leaves.offer(node)

    @staticmethod
    def _chain(bottom: TreeNode, top: TreeNode, keep=lambda n: True) -> list[TreeNode]:
        """The nodes from below ``top`` down to ``bottom`` that ``keep``, top-down."""
        out = []
        while bottom is not top:
            if keep(bottom):
                out.append(bottom)
            bottom = bottom.parent
        return out[::-1]

    # -- backups (device → host) ---------------------------------------------------
    def _backup(self, nodes: list[TreeNode]) -> bool:
        """Queue host copies of ``nodes``' device KV; False when the host pool
        has no room even after evicting from it."""
        nodes = [n for n in nodes if n.value is not None and n.host_value is None and n.transfer is None]
        if not nodes:
            return True
        n_tokens = sum(len(n.key) for n in nodes)
        host_slots = self.host_alloc(n_tokens)
        if host_slots is None:
            self.stats.hicache_backup_skipped += n_tokens
            return False
        device_slots = torch.cat([n.value for n in nodes])
        t = _Transfer(TransferKind.WRITE, nodes, (device_slots, host_slots))
        t.event = self._copy(self._write_stream, lambda: self.host.backup_from_device(device_slots, host_slots), [])
        pos = 0
        for n in nodes:
            n.host_value, n.transfer = host_slots[pos : pos + len(n.key)], t
            pos += len(n.key)
        self._writes.append(t)
        self.stats.hicache_backed_up += n_tokens
        return True

    def _copy(self, stream, issue, after: list) -> Any:
        """Run ``issue`` (it queues copies) on ``stream`` after the current
        stream and the streams ``after``; the event that marks it done, or
        None off CUDA (the copies are done already)."""
        if stream is None:
            issue()
            return None
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        for other in after:
            if other is not None:
                stream.wait_stream(other)
        with torch.cuda.stream(stream):
            issue()
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def host_alloc(self, n: int) -> torch.Tensor | None:
        slots = self.host.allocator.alloc(n)
        if slots is None:
            self._evict_host(n - self.host.allocator.available_size())
            slots = self.host.allocator.alloc(n)
        return slots

    def _host_evictable(self, node: TreeNode) -> bool:
        return (node.value is None and not node.children and node.transfer is None and node.host_ref == 0
                and node is not self.root)

    def _evict_host(self, num_tokens: int) -> None:
        def drop(leaf: TreeNode) -> None:
            self.host.allocator.free(leaf.host_value)
            self._delete_leaf(leaf)

        self.stats.hicache_host_evicted += self._evict_by_policy(num_tokens, self._host_evictable, drop)

    # -- device eviction -------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free device slots of unlocked device leaves (nodes on the device
        without a child there; a load-back in flight is locked, a backup in
        flight may be evicted), by policy, until ``num_tokens`` are freed or
        none is left; a call costs what it evicts, not the tree."""
        copying = False
        freed = 0
        self.allocator.free_group_begin()
        try:
            while freed < num_tokens and (node := self._device_leaves.pop()) is not None:
                copying |= self._demote(node)
                freed += len(node.key)
        finally:
            self.allocator.free_group_end()
        if copying and self._write_stream is not None:
            self._forward_stream.wait_stream(self._write_stream)  # no forward writes a slot still being copied
        return freed

    def _demote(self, node: TreeNode) -> bool:
        """Free the device slots of ``node``, a device leaf: with a host copy
        it stays on the host; without one (``write_back`` backs it up first,
        when the host has room) it leaves the tree with the host-only nodes
        under it. True if a backup is still reading the freed slots."""
        if node.host_value is None and self.write_policy == "write_back":
            self._backup([node])
        copying = node.transfer is not None
        self.allocator.free(node.value)
        if node.host_value is not None:
            node.value = None
            self._evictable -= len(node.key)
        else:
            self._delete_subtree(node)
        self._left_device(node)
        return copying

    def _delete_subtree(self, node: TreeNode) -> None:
        """Remove ``node`` (its device slots already freed) and the host-only
        nodes under it, freeing their host slots."""
        below = [n for n in self._nodes_under(node)]
        if any(n.transfer is not None or n.host_ref for n in below):
            # Their host slots are being written or read. Wait without polling: a poll would put prefetched
            # blocks into the tree, under or through ``node``; the next step's poll finishes these copies.
            self._drain()
        for n in below:
            self._leaves.discard(n)
            self.host.allocator.free(n.host_value)
            if self.kv_events is not None:
                self.kv_events.on_evict(n)
        self._delete_leaf(node)

    def _nodes_under(self, node: TreeNode):
        stack = list(node.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # -- load-back (host → device) ----------------------------------------------------
    def fetch(self, key: list[int], match: MatchResult, budget: int):
        """Bring the lower tiers' part of ``key`` to the device: a load-back of
        the host-only nodes ``match`` ends in, else a prefetch from the file
        tier of the blocks after the match (see ``BasePrefixCache.fetch``)."""
        if match.last_host_node is not None:
            chain = self._chain(match.last_host_node, match.last_node)
            loading = next((n.transfer for n in chain
                            if n.transfer is not None and n.transfer.kind is TransferKind.LOAD), None)
            if loading is not None:
                return loading, 0
            # Locking the load also locks the unlocked device nodes above it: they leave the budget too.
            unlocked_above = sum(len(n.key) for n in self._chain(match.last_node, self.root) if n.lock_ref == 0)
            if LOAD_BACK_THRESHOLD <= match.host_hit_length <= budget - unlocked_above:
                room = self.allocator.available_size() + self._evictable
                load = self._load_back(chain, match.last_node, match.host_hit_length)
                if load is not None:
                    return load, room - self.allocator.available_size() - self._evictable
            return None, 0
        if self.storage is not None:
            return self.storage.prefetch(self, key, len(match.device_indices)), 0
        return None, 0

    def prefetch(self, key: list[int]) -> None:
        """The file tier's blocks of ``key`` past what the device and host
        hold start coming into host memory at the request's arrival (as
        SGLang's storage prefetch does); ``fetch`` at its admission then finds
        them in the tree or still in flight, rather than starting the read.
        The read starts at the next ``poll``, where every TP rank is at the
        same point (under the TP Engine, rank 0 takes a request before the
        other ranks have it)."""
        if self.storage is not None:
            self._arrivals.append(key)

    def _load_back(self, chain: list[TreeNode], device_node: TreeNode, n_tokens: int) -> _Transfer | None:
        # Keep what the load goes under while evicting, and the chain's host copies (its source): under
        # write_back an eviction backs its victim up, which may evict host leaves.
        self.inc_lock_ref(device_node)
        pin = self.pin_host(chain[-1], n_tokens)
        try:
            short = n_tokens - self.allocator.available_size()
            if short > 0:
                self.evict(short)
            slots = self.allocator.alloc(n_tokens)
        finally:
            self.dec_lock_ref(device_node)
            self.unpin_host(pin)
        if slots is None:
            return None
        host_slots = torch.cat([n.host_value for n in chain])
        t = _Transfer(TransferKind.LOAD, chain, (slots, host_slots))
        t.event = self._copy(self._load_stream, lambda: self.host.load_to_device(host_slots, slots),
                             [self._forward_stream, self._write_stream])
        pos = 0
        for n in chain:
            self._to_device(n, slots[pos : pos + len(n.key)])
            n.transfer = t
            pos += len(n.key)
        self.inc_lock_ref(chain[-1])
        self._loads.append(t)
        self.stats.hicache_loaded_back += n_tokens
        return t

    # -- completion ---------------------------------------------------------------------
    def poll(self) -> None:
        """Finish the copies that are done, in order (each step); under
        tensor parallelism, those done on every rank (the queues are alike
        on every rank, so all of them take part in the agreement or none)."""
        queues = (self._writes, self._loads)
        done = [next((i for i, t in enumerate(q) if not t.done()), len(q)) for q in queues]
        if self.tp_group is not None and any(queues):
            done = self.tp_group.agree_mins(done)
        for queue, n in zip(queues, done):
            for _ in range(n):
                self._finish(queue.popleft())
        if self.storage is not None:
            self.storage.poll(self)
            arrivals, self._arrivals = self._arrivals, []
            for key in arrivals:
                walk = self._walk(key)
                self.storage.prefetch(self, key, walk.device_len + walk.host_len)

    def _finish(self, t: _Transfer) -> None:
        for bottom, n_tokens in zip(t.nodes, t.tokens):
            node, covered = bottom, 0
            while covered < n_tokens:  # its parts (a load-back may have taken over one's transfer)
                if node.transfer is t:
                    node.transfer = None
                covered += len(node.key)
                node = node.parent
        if t.kind is TransferKind.LOAD:
            self.dec_lock_ref(t.nodes[-1])
        t.finished = True
        if self.storage is not None:
            for bottom, n_tokens in zip(t.nodes, t.tokens) if t.kind is TransferKind.WRITE else ():
                self._to_file(bottom, n_tokens)
            for pin in t.held:
                self.unpin_host(pin)
                self._to_file(pin.node, pin.tokens)

    def _to_file(self, node: TreeNode, n_tokens: int) -> None:
        """File the blocks ending in the last ``n_tokens`` up to ``node``'s end once the host copies they read
        (from the root) have landed: until then they wait, pinned, for the nearest copy in flight on that path."""
        above = node
        while above is not self.root and above.transfer is None:
            above = above.parent
        if above is self.root:
            self.storage.backup(self, node, n_tokens)
        else:
            above.transfer.held.append(self.pin_host(node, n_tokens))

    def busy(self) -> bool:
        return bool(self._writes or self._loads) or (self.storage is not None and self.storage.busy())

    def wait(self) -> None:
        if self._loads and self._loads[0].event is not None:
            self._loads[0].event.synchronize()  # requests wait for load-backs, which take milliseconds
        elif self.storage is not None and self.storage.busy():
            self.storage.wait(WAIT_S)
        elif self._writes and self._writes[0].event is not None:
            self._writes[0].event.synchronize()

    def close(self) -> None:
        self.tp_group = None  # what is in flight is finished alone: the other ranks may be gone
        if self.storage is not None:
            self.storage.tp_group = None
        self.synchronize()
        if self.storage is not None:
            self.storage.close()
            self.poll()

    def synchronize(self) -> None:
        """Wait for every copy in flight and finish it."""
        if hasattr(self, "root"):  # not while the constructor resets
            self._settle()

    def _settle(self) -> None:
        self._drain()
        self.poll()

    def _drain(self) -> None:
        """Wait until the copies and the file tier's thread have done what
        they were given; ``poll`` has yet to finish it in the tree."""
        for stream in (self._write_stream, self._load_stream):
            if stream is not None:
                stream.synchronize()
        if self.storage is not None:
            self.storage.drain()

    # -- checks ----------------------------------------------------------------------------
    def _check_node(self, node: TreeNode, problems: list[str]) -> None:
        for name, slots in (("value", node.value), ("host_value", node.host_value)):
            if slots is not None and len(slots) != len(node.key):
                problems.append(f"{node}: {name} length {len(slots)} != key length {len(node.key)}")
        if node.value is None and node.host_value is None:
            problems.append(f"{node}: in no tier")
        if node.value is not None and node.parent is not self.root and node.parent.value is None:
            problems.append(f"{node}: on the device under a node that is not")
        if node.value is None and node.lock_ref:
            problems.append(f"{node}: locked but not on the device")
        if node.host_ref < 0 or (node.host_ref and node.host_value is None):
            problems.append(f"{node}: host_ref {node.host_ref} (negative, or pinning no host copy)")

    def check_invariants(self) -> None:
        super().check_invariants()
        nodes = set(self._nodes())
        device_leaves = {n for n in nodes if n is not self.root and self._is_device_leaf(n)}
        problems = self._device_leaves.problems(device_leaves, "device leaf")
        if problems:
            raise AssertionError("HiRadixCache invariant violated: " + "; ".join(problems))
        # A split keeps host_ref on both halves, so host_ref x tokens summed over the tree is what the
        # readers in flight pinned (a reset leaves a backup's pin on the old tree's nodes).
        pinned = sum(n.host_ref * len(n.key) for n in nodes)
        reading = sum(p.tokens for p in self._host_pins if p.node in nodes)
        if pinned != reading:
            raise AssertionError(f"host pins: {pinned} tokens pinned in the tree != {reading} by readers in flight")
        in_nodes = sum(len(n.host_value) for n in nodes if n.host_value is not None)
        prefetching = self.storage.host_slots_held() if self.storage is not None else 0
        used = self.host.size - self.host.allocator.available_size()
        self.host.allocator.check_invariants()
        if in_nodes + prefetching != used:
            raise AssertionError(f"host tier leak: {in_nodes} in nodes + {prefetching} being prefetched "
                                 f"!= {used} host slots in use")

    def tier_stats(self) -> dict[str, int]:
        out = dict(vars(self.stats), hicache_host_used=self.host.size - self.host.allocator.available_size(),
                   hicache_host_size=self.host.size)
        if self.storage is not None:
            out.update(self.storage.stats())
        return out
