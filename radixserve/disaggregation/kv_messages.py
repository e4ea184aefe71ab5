"""How a request's pages become a few large messages, and back into a pool.

Both sides build a :class:`KVMessageLayout` from their own :class:`KVArgs`;
the transfer is only allowed when their ``KVArgs.layout()`` agree (dtype,
page size, layers, head dims), so the bytes of one head of one slot are the
same on both. A transfer carries a block of consecutive KV heads of the
sending rank (all of them when both servers run the same tp size), which
land in a block of consecutive heads of the receiving rank
(``head_map.HeadSlice``).

Region map of one transfer (``n`` pages, ``P = page_size`` slots a page,
heads ``h0 .. h0 + c - 1`` of the sender)::

    request pages   p[0] p[1] ... p[n-1]            (any order, not contiguous)
    message 0       pages p[0 : c0]                 c_i = pages_per_message, the
    message 1       pages p[c0 : c0 + c1]             last message takes the rest
    ...
    aux message     row aux_index of each aux buffer, as raw bytes, concatenated
                    (only from the one source that sends it)

    one KV message  [slot 0 | slot 1 | ... | slot c_i*P - 1]   slots of its pages in order
    one slot        [K layer 0 | ... | K layer L-1 | V layer 0 | ... | V layer L-1]
                    each the heads h0 .. h0+c-1 of the pool's [heads, dim],
                    [c, dim] elements in the pool's dtype

In the pool a head block of a slot is not contiguous (the other heads lie
between slots), so :meth:`gather` copies it into one contiguous message and
:meth:`scatter` writes it back through a strided view. A message is a flat
``uint8`` tensor, so any pool dtype moves unchanged.
"""

from __future__ import annotations

import torch

from radixserve.disaggregation.base import KVArgs
from radixserve.mem_cache.memory_pool import copy_view


class KVMessageLayout:
    """Gathers head blocks of pages of ``args``' buffers into messages and scatters them back."""

    def __init__(self, args: KVArgs, max_message_bytes: int):
        self.args = args
        self.max_message_bytes = max_message_bytes
        dims = [b.shape[2] for b in args.kv_buffers]
        self.head_bytes = sum(dims) * args.k_buffers[0].element_size()  # one head of one slot, every buffer
        self.aux_bytes = sum(b[0].numel() * b.element_size() for b in args.aux_buffers)
        self._page_offsets = torch.arange(args.page_size, device=args.device)

    def check_pages(self, pages) -> torch.Tensor:
        """``pages`` as a 1-D int64 tensor on the pool's device; ValueError when
        empty or out of the pool."""
        pages = torch.as_tensor(pages, dtype=torch.int64).reshape(-1)
        if pages.numel() == 0:
            raise ValueError("a transfer needs at least one page")
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 0 or hi >= self.args.num_pages:
            raise ValueError(f"page indices must be in [0, {self.args.num_pages}), got [{lo}, {hi}]")
        return pages.to(self.args.device)

    def check_heads(self, heads: range) -> None:
        """ValueError unless ``heads`` are heads of this rank's pool."""
        if heads.start < 0 or heads.stop > self.args.local_kv_heads:
            raise ValueError(f"KV heads {heads.start}..{heads.stop - 1} are not in this rank's "
                             f"{self.args.local_kv_heads}")

    def message_pages(self, num_pages: int, num_heads: int) -> list[int]:
        """Pages in each KV message of a transfer of ``num_pages`` pages of
        ``num_heads`` heads (none when no heads are sent)."""
        if num_heads == 0:
            return []
        per_message = max(1, self.max_message_bytes // self.message_bytes(1, num_heads))
        full, rest = divmod(num_pages, per_message)
        return [per_message] * full + ([rest] if rest else [])

    def message_bytes(self, pages_in_message: int, num_heads: int) -> int:
        return pages_in_message * self.args.page_size * num_heads * self.head_bytes

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.args.page_size + self._page_offsets).reshape(-1)

    def gather(self, pages: torch.Tensor, heads: range) -> torch.Tensor:
        """Heads ``heads`` of ``pages`` as one flat uint8 message (a copy)."""
        slots = self._slots(pages)
        parts = [copy_view(b).narrow(1, heads.start, len(heads)).index_select(0, slots).reshape(slots.numel(), -1)
                 for b in self.args.kv_buffers]
        return torch.cat(parts, dim=1).view(torch.uint8).reshape(-1)

    def scatter(self, pages: torch.Tensor, message: torch.Tensor, heads: range) -> None:
        """Write a message made by :meth:`gather` into heads ``heads`` of ``pages`` of the pool."""
        slots = self._slots(pages)
        values = message.view(copy_view(self.args.k_buffers[0]).dtype).view(slots.numel(), -1)
        col = 0
        for buf in map(copy_view, self.args.kv_buffers):
            block = buf.narrow(1, heads.start, len(heads))
            width = len(heads) * buf.shape[2]
            block.index_copy_(0, slots, values[:, col : col + width].reshape(slots.numel(), len(heads), buf.shape[2]))
            col += width

    def pack_aux(self, index: int) -> torch.Tensor:
        """Row ``index`` of every aux buffer as one flat uint8 tensor on the pool's device."""
        rows = [b[index].reshape(-1).view(torch.uint8) for b in self.args.aux_buffers]
        return torch.cat(rows).to(self.args.device)

    def unpack_aux(self, index: int, data: torch.Tensor) -> None:
        """Write what :meth:`pack_aux` made into row ``index`` of every aux buffer."""
        start = 0
        for buf in self.args.aux_buffers:
            nbytes = buf[0].numel() * buf.element_size()
            row = data[start : start + nbytes].to(buf.device).view(buf.dtype)
            buf[index].copy_(row.reshape(buf[index].shape))
            start += nbytes
