"""The host tier of the hierarchical cache: a KV pool in host memory, and the
copies between it and the device pool.

Layout: one buffer ``[slots, layers, 2, kv_heads, head_dim]`` (SGLang's
"page first" host layout): all of a token's K and V, every layer, lie
together, so a run of consecutive host slots is one contiguous block. A copy
gathers the device slots of every layer into a contiguous staging tensor on
the device and moves it with one copy per run of consecutive host slots (the
host allocator hands out sorted pages, so runs are long). On CUDA the buffer
is pinned and the copies are asynchronous on the stream they are issued on;
off CUDA both tiers are host tensors and the same code copies at once.

Slots are handed out by a ``TokenToKVPoolAllocator`` over host memory, in the
device pool's page size; page 0 is unused, as on the device.
"""

from __future__ import annotations

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_floor
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, copy_view

# A transfer is staged on the device in pieces of at most this many bytes.
STAGING_BYTES = 256 << 20


def host_pool_tokens(device_tokens: int, page_size: int, bytes_per_token: int, ratio: float, size_gb: float) -> int:
    """Host slots for ``--hicache-ratio`` / ``--hicache-size`` (SGLang's
    rule: the size in GB wins when given), whole pages, at least the device
    pool's."""
    tokens = int(size_gb * 2**30 / bytes_per_token) if size_gb > 0 else int(device_tokens * ratio)
    if tokens < device_tokens:
        raise ValueError(
            f"hicache: the host pool ({tokens} tokens) must be at least as large as the device pool "
            f"({device_tokens} tokens): raise --hicache-ratio above 1 or --hicache-size"
        )
    return page_floor(tokens, page_size)


class HostKVPool:
    """Host copies of KV slots, in ``device_pool``'s page size and dtype."""

    def __init__(self, device_pool: MHATokenToKVPool, size: int):
        self.device_pool = device_pool
        self.page_size = device_pool.page_size
        self.layer_num = device_pool.layer_num
        self.head_num, self.head_dim = device_pool.head_num, device_pool.head_dim
        if device_pool.v_head_dim != device_pool.head_dim:
            raise ValueError("hicache: K and V of different head sizes are not supported")
        self.dtype = device_pool.dtype
        self.allocator = TokenToKVPoolAllocator(size, self.page_size, device="cpu")
        self.size = self.allocator.size
        pin = device_pool.device.type == "cuda"
        self.token_shape = (self.layer_num, 2, self.head_num, self.head_dim)
        self.buffer = torch.empty((self.size + self.page_size, *self.token_shape), dtype=self.dtype, pin_memory=pin)
        self.bytes_per_token = self.buffer[0].numel() * self.dtype.itemsize
        self._copies = copy_view(self.buffer)  # the same bytes, in a dtype every copy kernel takes

    def mem_bytes(self) -> int:
        return self.buffer.numel() * self.dtype.itemsize

    # -- copies --------------------------------------------------------------
    def _pieces(self, n: int):
        step = max(1, STAGING_BYTES // self.bytes_per_token)
        return ((start, min(start + step, n)) for start in range(0, n, step))

    def backup_from_device(self, device_slots: torch.Tensor, host_slots: torch.Tensor) -> None:
        """Copy the device pool's ``device_slots`` into ``host_slots`` (equal
        lengths), issued on the current stream."""
        pool = self.device_pool
        device_slots = device_slots.to(pool.device, torch.int64)
        for start, end in self._pieces(len(device_slots)):
            idx = device_slots[start:end]
            staging = torch.empty((end - start, *self.token_shape), dtype=self._copies.dtype, device=pool.device)
            for layer in range(self.layer_num):
                torch.index_select(copy_view(pool.k_buffer[layer]), 0, idx, out=staging[:, layer, 0])
                torch.index_select(copy_view(pool.v_buffer[layer]), 0, idx, out=staging[:, layer, 1])
            for host_start, offset, length in runs(host_slots[start:end]):
                self._copies[host_start : host_start + length].copy_(staging[offset : offset + length], non_blocking=True)

    def load_to_device(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Copy ``host_slots`` into the device pool's ``device_slots``, issued
        on the current stream."""
        pool = self.device_pool
        device_slots = device_slots.to(pool.device, torch.int64)
        for start, end in self._pieces(len(device_slots)):
            staging = torch.empty((end - start, *self.token_shape), dtype=self._copies.dtype, device=pool.device)
            for host_start, offset, length in runs(host_slots[start:end]):
                staging[offset : offset + length].copy_(self._copies[host_start : host_start + length], non_blocking=True)
            idx = device_slots[start:end]
            for layer in range(self.layer_num):
                copy_view(pool.k_buffer[layer]).index_copy_(0, idx, staging[:, layer, 0])
                copy_view(pool.v_buffer[layer]).index_copy_(0, idx, staging[:, layer, 1])

    def read(self, host_slots: torch.Tensor) -> torch.Tensor:
        """The KV of ``host_slots`` as one ``[n, layers, 2, heads, dim]`` tensor (a copy)."""
        out = torch.empty((len(host_slots), *self.token_shape), dtype=self.dtype)
        for host_start, offset, length in runs(host_slots):
            out[offset : offset + length] = self.buffer[host_start : host_start + length]
        return out

    def write(self, host_slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store ``kv`` (``[n, layers, 2, heads, dim]``) at ``host_slots``."""
        for host_start, offset, length in runs(host_slots):
            self.buffer[host_start : host_start + length] = kv[offset : offset + length]


def runs(slots: torch.Tensor) -> list[tuple[int, int, int]]:
    """``(first slot, offset in slots, length)`` of each run of consecutive
    slots in ``slots`` (a 1-D host tensor), in order."""
    n = len(slots)
    if n == 0:
        return []
    slots = slots.to(torch.int64)
    breaks = torch.nonzero(slots[1:] != slots[:-1] + 1).flatten().add_(1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, n]
    firsts = slots[starts].tolist()
    return [(first, s, e - s) for first, s, e in zip(firsts, starts, ends)]
