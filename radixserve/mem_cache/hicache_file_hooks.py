"""What the file tier (``hicache_storage.py``) asks of HiRadixCache, whose
base this is: a node's tokens and host slots from the root, pins that keep
host copies while its thread reads them off the scheduler's path, and
prefetched KV put into the tree as a host-only leaf. The pins in flight are
the tree's ``_host_pins``, which its invariant check counts."""

from __future__ import annotations

import torch

from radixserve.mem_cache.base_prefix_cache import EMPTY_SLOTS
from radixserve.mem_cache.radix_cache import TreeNode


class HostPin:
    """A reader's hold on the host copies of the last ``tokens`` up to the end
    of ``node`` (whole nodes when taken). A split puts the upper half above
    the node it cut, with its ``host_ref``, and ``node`` stays the lowest
    part: the same walk up over ``tokens`` finds every part to release."""

    __slots__ = ("node", "tokens")

    def __init__(self, node: TreeNode, tokens: int):
        self.node, self.tokens = node, tokens


class FileTierHooks:
    """HiRadixCache's methods for the file tier (it holds ``root``, ``host``,
    ``_host_pins``, ``_walk`` and ``_add_leaf``)."""

    def host_path(self, node: TreeNode) -> tuple[list[int], torch.Tensor] | None:
        """The tokens from the root to the end of ``node`` and their host
        slots, or None if some node on the way has no host copy."""
        keys, slots = [], []
        while node is not self.root:
            if node.host_value is None:
                return None
            keys.append(node.key)
            slots.append(node.host_value)
            node = node.parent
        return [t for k in reversed(keys) for t in k], torch.cat(slots[::-1]) if slots else EMPTY_SLOTS

    def pin_host(self, node: TreeNode, n_tokens: int) -> HostPin:
        """Keep the host copies of the last ``n_tokens`` up to the end of
        ``node`` (the nodes holding them) until ``unpin_host``, whatever
        splits happen meanwhile: a reader reads them off the scheduler's path."""
        pin = HostPin(node, self._add_host_ref(node, n_tokens, 1))
        self._host_pins.add(pin)
        return pin

    def unpin_host(self, pin: HostPin) -> None:
        self._host_pins.remove(pin)
        self._add_host_ref(pin.node, pin.tokens, -1)

    @staticmethod
    def _add_host_ref(node: TreeNode, n_tokens: int, delta: int) -> int:
        """Add ``delta`` to the nodes from ``node`` up that hold the last
        ``n_tokens`` up to its end; returns the tokens of those nodes."""
        covered = 0
        while covered < n_tokens:
            node.host_ref += delta
            covered += len(node.key)
            node = node.parent
        return covered

    def attach_host(self, tokens: list[int], host_slots: torch.Tensor, start: int) -> int:
        """Put prefetched KV (host slots of ``tokens[start:]``) into the tree
        as a host-only leaf after what is cached; frees the slots it does not
        need. Returns the tokens attached."""
        walk = self._walk(tokens)
        have = walk.device_len + walk.host_len
        if have < start or have >= len(tokens):
            self.host.allocator.free(host_slots)
            return 0
        self.host.allocator.free(host_slots[: have - start])
        leaf = self._add_leaf(walk.deepest, tokens[have:], None, have)
        leaf.host_value = host_slots[have - start :]
        return len(leaf.key)
