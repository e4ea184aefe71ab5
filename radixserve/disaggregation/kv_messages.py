"""How a request's pages become a few large messages, and back into a pool.

Both sides build a :class:`KVMessageLayout` from their own :class:`KVArgs`;
the transfer is only allowed when their ``KVArgs.layout()`` agree, so the
byte layout below is the same on both.

Region map of one transfer (``n`` pages, ``P = page_size`` slots a page)::

    request pages   p[0] p[1] ... p[n-1]            (any order, not contiguous)
    message 0       pages p[0 : c0]                 c_i = pages_per_message, the
    message 1       pages p[c0 : c0 + c1]             last message takes the rest
    ...
    aux message     row aux_index of each aux buffer, as raw bytes, concatenated

    one KV message  [slot 0 | slot 1 | ... | slot c_i*P - 1]   slots of its pages in order
    one slot        [K layer 0 | ... | K layer L-1 | V layer 0 | ... | V layer L-1]
                    each the pool's [heads, dim] elements, in the pool's dtype

A message is a flat ``uint8`` tensor, so any pool dtype moves unchanged.
"""

from __future__ import annotations

import torch

from radixserve.disaggregation.base import KVArgs


class KVMessageLayout:
    """Gathers pages of ``args``' buffers into messages and scatters them back."""

    def __init__(self, args: KVArgs, max_message_bytes: int):
        self.args = args
        self.slot_widths = [b[0].numel() for b in args.kv_buffers]  # elements of one slot, per buffer
        self.slot_bytes = sum(self.slot_widths) * args.k_buffers[0].element_size()
        self.page_bytes = self.slot_bytes * args.page_size
        self.pages_per_message = max(1, max_message_bytes // self.page_bytes)
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

    def message_pages(self, num_pages: int) -> list[int]:
        """Pages in each KV message of a transfer of ``num_pages`` pages."""
        full, rest = divmod(num_pages, self.pages_per_message)
        return [self.pages_per_message] * full + ([rest] if rest else [])

    def message_bytes(self, pages_in_message: int) -> int:
        return pages_in_message * self.page_bytes

    def _slots(self, pages: torch.Tensor) -> torch.Tensor:
        return (pages[:, None] * self.args.page_size + self._page_offsets).reshape(-1)

    def gather(self, pages: torch.Tensor) -> torch.Tensor:
        """The KV of ``pages`` as one flat uint8 message (a copy)."""
        slots = self._slots(pages)
        parts = [b.index_select(0, slots).reshape(slots.numel(), -1) for b in self.args.kv_buffers]
        return torch.cat(parts, dim=1).view(torch.uint8).reshape(-1)

    def scatter(self, pages: torch.Tensor, message: torch.Tensor) -> None:
        """Write a message made by :meth:`gather` into ``pages`` of the pool."""
        slots = self._slots(pages)
        values = message.view(self.args.k_buffers[0].dtype).view(slots.numel(), -1)
        col = 0
        for buf, width in zip(self.args.kv_buffers, self.slot_widths):
            buf.index_copy_(0, slots, values[:, col : col + width].reshape(slots.numel(), *buf.shape[1:]))
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
