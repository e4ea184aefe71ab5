"""From radix tree changes to KV events: which blocks a change stores or removes.

A block is ``block_size`` consecutive tokens of a cached sequence, counted
from its first token: block k covers depths [k*B, (k+1)*B) of the tree. It is
cached while its last token is, so the recorder files each block under the
node that holds its last token:

    depth  0         B         2B        3B
           |--- b0 ---|--- b1 ---|--- b2 ---|
    nodes  [ n1 ......... ][ n2 ...............][ n3 .. ]
           n1 owns b0; n2 owns b1 and b2; n3 owns none yet

- a new node (``on_insert``) stores the blocks whose last token it holds;
  the first may begin in its ancestors, whose tail tokens and last digest
  it chains from;
- a split (``on_split``) stores and removes nothing: a block's hash depends
  on its tokens and its prefix, never on where the tree cuts the path.
  The two halves only divide the node's blocks between them, so that
  evicting either half later removes exactly its own;
- an evicted leaf (``on_evict``) removes the blocks it owned;
- a reset (``on_reset``) clears them all.

With ``page_size > 1`` a block is a page (SGLang's rule) and node boundaries
fall between blocks; with ``page_size == 1`` a block per token would make
every event a list of single tokens, so blocks are 16 tokens (vLLM's
default block size) unless the config says otherwise.
"""

from __future__ import annotations

from radixserve.mem_cache.kv_events.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    chain_digests,
    hash_id,
)

DEFAULT_BLOCK_SIZE = 16  # with page_size 1


def event_block_size(page_size: int, block_size: int | None = None) -> int:
    """The block size events use; raises ValueError for one that does not
    hold whole pages."""
    if block_size is None:
        return page_size if page_size > 1 else DEFAULT_BLOCK_SIZE
    if block_size < 1 or block_size % page_size:
        raise ValueError(f"kv events block_size must be a positive multiple of the page size {page_size}, "
                         f"got {block_size}")
    return block_size


class NodeBlocks:
    """What the recorder keeps on a tree node (``TreeNode.kv_blocks``): the
    depth its key starts at, and the digests and hashes of the blocks whose
    last token it holds."""

    __slots__ = ("start", "digests", "hashes")

    def __init__(self, start: int, digests: list[bytes], hashes: list[int] | None = None):
        self.start = start
        self.digests = digests
        self.hashes = [hash_id(d) for d in digests] if hashes is None else hashes


class KVEventRecorder:
    """Collects the events of a ``RadixCache`` (which calls the ``on_*``
    hooks) until ``take``. Only the scheduler's thread touches it."""

    def __init__(self, page_size: int, block_size: int | None = None):
        self.block_size = event_block_size(page_size, block_size)
        self._events: list[KVCacheEvent] = []

    def take(self) -> list[KVCacheEvent]:
        """The events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    # -- hooks ------------------------------------------------------------------
    def on_insert(self, node, start: int) -> None:
        """``node`` was just added, its key starting at depth ``start``."""
        b = self.block_size
        first_end = (start // b + 1) * b  # where the first block ending in this node ends
        end = start + len(node.key)
        if first_end > end:
            node.kv_blocks = NodeBlocks(start, [])
            return
        head, prior = self._context(node.parent, first_end - b, start)
        tokens = head + list(node.key[: end // b * b - start])
        node.kv_blocks = info = NodeBlocks(start, chain_digests(tokens, b, prior))
        self._events.append(BlockStored(list(info.hashes), hash_id(prior) if prior is not None else None, tokens, b))

    def on_split(self, upper, lower) -> None:
        """``upper`` (new) took the first ``len(upper.key)`` tokens of ``lower``."""
        info = lower.kv_blocks
        cut = info.start + len(upper.key)
        n = cut // self.block_size - info.start // self.block_size  # blocks ending in the upper part
        upper.kv_blocks = NodeBlocks(info.start, info.digests[:n], info.hashes[:n])
        lower.kv_blocks = NodeBlocks(cut, info.digests[n:], info.hashes[n:])

    def on_evict(self, node) -> None:
        """``node``, a leaf, left the tree."""
        if node.kv_blocks.hashes:
            self._events.append(BlockRemoved(list(node.kv_blocks.hashes)))
        node.kv_blocks = None

    def on_reset(self) -> None:
        """Every node left the tree: what was not taken yet no longer matters."""
        self._events = [AllBlocksCleared()]

    # -- helpers --------------------------------------------------------------------
    def _context(self, node, block_start: int, depth: int) -> tuple[list[int], bytes | None]:
        """The tokens at depths [block_start, depth) above a new node whose
        parent is ``node``, and the digest of the block that ends at
        ``block_start`` (None when that is the root). The walk stops at the
        first ancestor that owns a block: it owns the one ending there, so
        it visits fewer than ``block_size`` tokens' worth of nodes."""
        pieces, need, prior = [], depth - block_start, None
        while node.parent is not None and (need > 0 or (block_start > 0 and prior is None)):
            if need > 0:
                take = min(need, len(node.key))
                pieces.append(list(node.key[len(node.key) - take :]))
                need -= take
            if prior is None and node.kv_blocks.digests:
                prior = node.kv_blocks.digests[-1]
            node = node.parent
        return [t for piece in reversed(pieces) for t in piece], prior
