"""Prefix groups of the running decode batch, from the radix tree
(docs/prefix_grouped_decode.md).

A running request's ``last_node`` is the deepest radix node it holds locked:
its first ``cache_protected_len`` tokens are that node's path, and its
``req_to_token`` row holds the tree's slots there. Two requests therefore
share exactly the KV of their deepest common node's path, and a decode step
may read that KV once for both (prefix-grouped, or cascade, attention).

Groups are formed deepest first: at each node, from the deepest up, the
requests below it that are in no group yet form one when there are at least
``min_members`` of them and the node is at least ``min_shared_len`` tokens
deep (a page). With pairs allowed, equivalently (the tests check it so):
repeatedly take the longest common cached prefix of any two ungrouped
requests, and group every ungrouped request that has it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from radixserve.model_executor.forward_batch_info import PrefixGroupTable

if TYPE_CHECKING:
    from radixserve.mem_cache.radix_cache import TreeNode


class GroupedReq(Protocol):
    req_pool_idx: int | None
    last_node: "TreeNode | None"


def find_groups(nodes: list["TreeNode | None"], min_shared_len: int,
                min_members: int = 2) -> list[tuple[int, list[int]]]:
    """Groups of the requests whose deepest cached nodes are ``nodes``
    (None: nothing cached), as ``(shared_len, [indices into nodes])``, the
    deepest groups first; a group has ``min_members`` requests at least
    (fewer below a node go up to its parent). Host work: one walk up from
    each node, once."""
    depth: dict[int, int] = {}  # id(node) -> tokens from the root to the end of its key
    parent_of: dict[int, object] = {}
    pending: dict[int, list[int]] = {}  # id(node) -> requests below it not grouped yet

    def depth_of(node) -> int:
        chain = []
        while node is not None and id(node) not in depth:
            chain.append(node)
            node = node.parent
        d = 0 if node is None else depth[id(node)]
        for n in reversed(chain):
            d += len(n.key)
            depth[id(n)], parent_of[id(n)] = d, n.parent
        return depth[id(chain[0])] if chain else d

    for i, node in enumerate(nodes):
        if node is None or node.parent is None:  # nothing cached beyond the root
            continue
        depth_of(node)
        pending.setdefault(id(node), []).append(i)
    groups = []
    for key in sorted(depth, key=depth.__getitem__, reverse=True):  # children before parents
        members = pending.pop(key, None)
        if not members:
            continue
        if len(members) >= min_members and depth[key] >= min_shared_len:
            groups.append((depth[key], sorted(members)))
        elif parent_of[key] is not None and id(parent_of[key]) in depth:
            pending.setdefault(id(parent_of[key]), []).extend(members)
    return groups


def build_table(reqs: list[GroupedReq], min_shared_len: int, min_members: int = 2) -> PrefixGroupTable | None:
    """The table of ``reqs``'s groups in batch order; None when none share a prefix."""
    groups = find_groups([r.last_node for r in reqs], min_shared_len, min_members)
    if not groups:
        return None
    suffix_starts = [0] * len(reqs)
    for shared, members in groups:
        for i in members:
            suffix_starts[i] = shared
    sizes = [len(m) for _, m in groups]
    t = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
    return PrefixGroupTable(
        prefix_rows=t([reqs[m[0]].req_pool_idx for _, m in groups]),
        prefix_lens=t([s for s, _ in groups]),
        member_starts=t([0] + torch.tensor(sizes).cumsum(0).tolist()),
        members=t([i for _, m in groups for i in m]),
        suffix_starts=t(suffix_starts),
        prefix_lens_cpu=[s for s, _ in groups],
        members_cpu=[m for _, m in groups],
    )


# The fewest requests a group has. On an H200 (benchmarks/README.md, "Prefix-
# grouped decode"), 128 groups of two decoded slower grouped than plain
# (560 against 459 us a layer: the plain kernel finds a pair's prefix in L2,
# and a tile of two members leaves most of its query rows empty), 64 groups
# of four 1.18x faster.
MIN_GROUP_MEMBERS = 4


class PrefixGrouper:
    """The running batch's prefix groups, rebuilt only when the batch's
    requests, their order or their deepest cached nodes change (a request
    joins, finishes or is retracted; a prefilled prompt is cached), not at
    every step. A step that changes nothing costs one tuple of the batch's
    (row, node id) pairs."""

    def __init__(self, page_size: int, min_members: int | None = None):
        self.min_shared_len = page_size
        self.min_members = MIN_GROUP_MEMBERS if min_members is None else min_members
        self._key: tuple | None = None
        self._table: PrefixGroupTable | None = None
        self.rebuilds = 0  # for tests: how often the table was recomputed

    def table(self, reqs: list[GroupedReq]) -> PrefixGroupTable | None:
        key = tuple((r.req_pool_idx, None if r.last_node is None else r.last_node.id) for r in reqs)
        if key != self._key:
            self._key, self._table = key, build_table(reqs, self.min_shared_len, self.min_members)
            self.rebuilds += 1
        return self._table
