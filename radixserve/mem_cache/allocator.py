"""Paged allocation of KV slots.

Slots are handed out in pages of ``page_size``; page 0 is the dummy page (see
``memory_pool.py``). A page goes back to the free list only once every slot in
it that was handed out has been freed, so callers may free any subset of slots
in any order (a finished request's tail page, radix-cache duplicates, evicted
leaves) without tracking pages themselves.
"""

from __future__ import annotations

import torch


# The engine's only page rounding (docs/architecture.md), for ints and int
# tensors alike (floor division rounds down for both).
def pages_for(tokens: int, page_size: int) -> int:
    """Pages that hold ``tokens`` tokens (the last one possibly part full)."""
    return -(-tokens // page_size)


def page_aligned(tokens: int, page_size: int) -> int:
    """``tokens`` rounded up to whole pages, in tokens."""
    return pages_for(tokens, page_size) * page_size


def page_floor(tokens: int, page_size: int) -> int:
    """``tokens`` rounded down to whole pages, in tokens (the full pages only)."""
    return tokens // page_size * page_size


class TokenToKVPoolAllocator:
    """Allocates KV slots in whole pages.

    ``size`` usable slots (rounded down to whole pages) live on pages
    ``1 .. num_pages``. ``alloc_extend`` fills the last partial page of each
    request before taking new pages; ``alloc_decode`` takes a new page only at
    a page boundary. Allocation returns ``None`` when memory is short, so the
    scheduler can evict or retract and try again.
    """

    elastic = False  # memory mapped as used (elastic_allocator.py) or allocated whole

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu"):
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.size = page_floor(size, page_size)
        self.num_pages = self.size // page_size
        if self.num_pages < 1:
            raise ValueError(f"KV pool of {size} slots holds no whole page of {page_size}")
        self.device = torch.device(device)
        num_slots = (self.num_pages + 1) * page_size
        self.slot_in_use = torch.zeros(num_slots, dtype=torch.bool, device=self.device)
        self.page_used = torch.zeros(self.num_pages + 1, dtype=torch.int64, device=self.device)
        self.clear()

    # -- state -------------------------------------------------------------
    def clear(self) -> None:
        """Return every page; the caller must drop all references to slots."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)
        self._released: list[torch.Tensor] = []
        self._group: list[torch.Tensor] | None = None
        self.slot_in_use.zero_()
        self.page_used.zero_()

    def available_size(self) -> int:
        """Free slots, counted in whole free pages."""
        return (len(self.free_pages) + sum(len(p) for p in self._released)) * self.page_size

    def free_size(self) -> int:
        """Every free slot (the memory invariant's count): here, all available."""
        return self.available_size()

    def ensure_mapped(self, n: int) -> bool:
        """Whether the next ``n`` slots need no memory mapped first: always,
        for a pool allocated whole (the elastic pool maps here)."""
        return True

    def rebalance(self, evict=None, busy: bool = False) -> None:
        """Once a scheduler step: nothing to do for a pool allocated whole
        (the elastic pool gives back empty pages here, and evicts cached KV
        with ``evict`` to meet its run-time limit)."""

    def close(self) -> None:
        """The engine is stopping: nothing to let go of here (the elastic pool leaves its registry)."""

    def over_limit(self) -> bool:
        """Whether admissions wait for memory to go back under a run-time
        limit: never for a pool allocated whole (see the elastic pool)."""
        return False

    def limit_binds(self) -> bool:
        """Whether a run-time limit, not the pool's size, is what is short."""
        return False

    def pool_stats(self) -> dict[str, float]:
        """Figures of the pool's memory beyond slot counts (the elastic pool's)."""
        return {}

    def _take_pages(self, n: int) -> torch.Tensor | None:
        if n > len(self.free_pages) and self._released:
            # Sorting keeps allocations contiguous-ish, which helps gathers.
            self.free_pages = torch.cat([self.free_pages, *self._released]).sort().values
            self._released = []
        if n > len(self.free_pages):
            return None
        pages, self.free_pages = self.free_pages[:n], self.free_pages[n:]
        return pages

    def _mark_used(self, slots: torch.Tensor) -> torch.Tensor:
        self.slot_in_use[slots] = True
        self.page_used.index_add_(0, slots // self.page_size, torch.ones_like(slots))
        return slots

    # -- allocation --------------------------------------------------------
    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots on ``ceil(n / page_size)`` fresh pages, or None."""
        pages = self._take_pages(pages_for(n, self.page_size))
        if pages is None:
            return None
        offsets = torch.arange(self.page_size, device=self.device)
        return self._mark_used((pages[:, None] * self.page_size + offsets).flatten()[:n])

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        seq_lens: torch.Tensor,
        last_loc: torch.Tensor,
    ) -> torch.Tensor | None:
        """Slots for positions ``prefix_lens[i] .. seq_lens[i]-1`` of each request.

        ``last_loc[i]`` is the slot of position ``prefix_lens[i]-1`` (any value
        when the prefix is empty). Positions that fall in the request's last,
        partially filled page continue it; the rest get fresh pages. Returns
        the slots concatenated in batch order, or None if pages are short (in
        which case nothing was allocated).
        """
        p = self.page_size
        prefix_lens, seq_lens, last_loc = (t.to(self.device, torch.int64) for t in (prefix_lens, seq_lens, last_loc))
        pages_before = pages_for(prefix_lens, p)
        new_pages = pages_for(seq_lens, p) - pages_before
        pages = self._take_pages(int(new_pages.sum()))
        if pages is None:
            return None
        ext = seq_lens - prefix_lens
        req = torch.repeat_interleave(torch.arange(len(ext), device=self.device), ext)
        tok_start = torch.cumsum(ext, 0) - ext
        pos = torch.arange(len(req), device=self.device) - tok_start[req] + prefix_lens[req]
        in_last_page = pos < pages_before[req] * p
        slot_old = last_loc[req] + (pos - prefix_lens[req] + 1)
        page_start = torch.cumsum(new_pages, 0) - new_pages
        rank = pos // p - pages_before[req] + page_start[req]
        slot_new = pages[rank.clamp(min=0, max=max(len(pages) - 1, 0))] * p + pos % p if len(pages) else slot_old
        return self._mark_used(torch.where(in_last_page, slot_old, slot_new))

    def alloc_decode(self, seq_lens: torch.Tensor, last_loc: torch.Tensor | None) -> torch.Tensor | None:
        """One slot per request for position ``seq_lens[i]-1`` (host tensor):
        the slot after ``last_loc[i]`` in its last page, or a fresh page's
        first slot at a page boundary (``last_loc`` may be None when every
        request is at one, as always with ``page_size`` 1). Decided on the
        host, so a decode step allocates without waiting for the device."""
        p = self.page_size
        fresh = (seq_lens.cpu() - 1) % p == 0
        pages = self._take_pages(int(fresh.sum()))
        if pages is None:
            return None
        if bool(fresh.all()):
            return self._mark_used(pages * p)
        last_next = last_loc.to(self.device, torch.int64) + 1
        if len(pages) == 0:
            return self._mark_used(last_next)
        rank = (torch.cumsum(fresh, 0) - 1).clamp(min=0).to(self.device)
        return self._mark_used(torch.where(fresh.to(self.device), pages[rank] * p, last_next))

    # -- freeing -----------------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        """Free any set of slots; pages whose slots are all free return."""
        if slots.numel() == 0:
            return
        if self._group is not None:
            self._group.append(slots)
            return
        slots = slots.to(self.device, torch.int64)
        if bool((slots < self.page_size).any()) or bool((~self.slot_in_use[slots]).any()):
            bad = slots[(slots < self.page_size) | ~self.slot_in_use[slots.clamp(min=0)]]
            raise RuntimeError(f"KV allocator: freeing slots not in use (dummy page or double free): {bad[:8].tolist()}")
        if len(torch.unique(slots)) != len(slots):
            raise RuntimeError("KV allocator: the same slot freed twice in one call")
        self.slot_in_use[slots] = False
        pages = slots // self.page_size
        self.page_used.index_add_(0, pages, -torch.ones_like(pages))
        touched = torch.unique(pages)
        emptied = touched[self.page_used[touched] == 0]
        if len(emptied):
            self._released.append(emptied)

    def free_group_begin(self) -> None:
        """Collect frees until :meth:`free_group_end`, then free them in one call."""
        self._group = []

    def free_group_end(self) -> None:
        group, self._group = self._group, None
        if group:
            self.free(torch.cat(group))

    # -- checks ------------------------------------------------------------
    def used_pages(self) -> int:
        return int((self.page_used > 0).sum())

    def check_invariants(self) -> None:
        """Page counts match slot marks; every page is free xor in use, once."""
        problems = self._problems()
        if problems:
            raise AssertionError("KV allocator invariant violated: " + "; ".join(problems))

    def _backed_pages(self) -> int:
        """Pages that are either free or in use: all of them (the elastic pool's: the mapped ones)."""
        return self.num_pages

    def _problems(self) -> list[str]:
        p = self.page_size
        per_page = self.slot_in_use.view(-1, p).sum(dim=1)
        problems = []
        if not torch.equal(per_page, self.page_used):
            problems.append("page_used disagrees with slot_in_use")
        if bool(self.slot_in_use[:p].any()) or int(self.page_used[0]) != 0:
            problems.append("dummy page 0 is marked in use")
        free = torch.cat([self.free_pages, *self._released]) if self._released else self.free_pages
        if len(torch.unique(free)) != len(free):
            problems.append("a page is on the free list twice")
        if len(free) and bool((self.page_used[free] != 0).any()):
            problems.append("a free page has slots in use")
        if len(free) + self.used_pages() != self._backed_pages():
            problems.append(f"free pages {len(free)} + used pages {self.used_pages()} != {self._backed_pages()}")
        return problems
