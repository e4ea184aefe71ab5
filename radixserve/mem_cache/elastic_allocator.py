"""The elastic KV allocator (``--enable-elastic-kv``, docs/elastic_kv.md):
the paged allocator of ``allocator.py`` over a KV pool whose memory is mapped
in *elastic pages* (``virtual_memory.py``) as slots in them are handed out,
and unmapped when every slot in them is free (kvcached's rule).

Region map (``E`` KV pages of ``page_size`` slots per elastic page)::

    KV page:      0 | 1 .. E-1 | E .. 2E-1 | ... | (n-1)E .. num_pages
    elastic page: 0            | 1         | ... | n-1
                  (always mapped: the dummy page 0 lies in it)

- Only KV pages of mapped elastic pages are on the free list, so
  ``available_size`` counts *mapped* free slots plus the slots of elastic pages
  that can still be mapped: under the limit (``limit_pages``) and, as far as
  the last look at the device or machine says, in physical memory.
- ``_take_pages`` maps the lowest unmapped elastic pages when the mapped free
  ones run short (lower pages first keeps the used slots together, so that
  the high pages empty when load drops). A map the device refuses makes the
  allocation fail like a full pool (None), and ``available_size`` counts
  mapped slots only until the next :meth:`rebalance`.
- ``ensure_mapped(n)`` maps ahead, so that the next ``n`` slots need no map:
  admission calls it for the tokens it admits, so an admitted prefill never
  meets a refused map.
- :meth:`rebalance`, once a scheduler step, unmaps elastic pages with every
  slot free beyond ``max_reserve`` of them (highest first: a slot held by a
  request or a radix node keeps its page), maps pages until ``min_reserve``
  pages' worth of slots are free in mapped memory, and looks again at the
  physical memory. It counts free slots from the free list's length (no
  device sync) and reads the pages' use (a sync) only when there are free
  slots enough to leave more than ``max_reserve`` pages empty. Frees never unmap
  by themselves, so a step never loses a page that it freed and reuses.
- Under tensor parallelism every rank runs the same decisions; each map is
  tried on every rank and counts only as far as it succeeded on all of them
  (``agree_min``), so the ranks' pools stay identical.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator
from radixserve.mem_cache.elastic_registry import ElasticRegistry, registry_path
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.mem_cache.virtual_memory import VirtualArena, granularity, make_arena
from radixserve.server_args import ElasticKVConfig

logger = logging.getLogger(__name__)


def elastic_page_slots(slot_bytes: list[int], page_size: int, granularity: int, want_bytes: int) -> int:
    """Slots per elastic page: a whole number of KV pages, and in every
    buffer (one slot of buffer ``i`` is ``slot_bytes[i]`` bytes) a whole
    number of ``granularity`` bytes, about ``want_bytes`` in the largest."""
    unit = page_size
    for b in slot_bytes:
        unit = math.lcm(unit, granularity // math.gcd(granularity, b))
    return unit * max(1, round(want_bytes / (unit * max(slot_bytes))))


class ElasticTokenToKVPoolAllocator(TokenToKVPoolAllocator):
    """``TokenToKVPoolAllocator`` over a :class:`VirtualArena` whose page
    ``e`` holds slots ``e * epage_slots .. (e+1) * epage_slots - 1``."""

    elastic = True

    def __init__(self, size: int, page_size: int, device: str | torch.device, arena: VirtualArena,
                 epage_slots: int, min_reserve: int = 1, max_reserve: int = 2,
                 agree_min: Callable[[int], int] | None = None, registry: ElasticRegistry | None = None,
                 floor_pages: int = 1):
        if epage_slots % page_size:
            raise ValueError(f"an elastic page of {epage_slots} slots holds no whole number of {page_size}-slot pages")
        if not 0 <= min_reserve <= max_reserve:
            raise ValueError(f"reserve pages: need 0 <= min ({min_reserve}) <= max ({max_reserve})")
        self.arena = arena
        self.epage_slots = epage_slots
        self.kv_pages_per_epage = epage_slots // page_size
        self.min_reserve, self.max_reserve = min_reserve, max_reserve
        self._agree_min = agree_min or (lambda value: value)
        num_pages = size // page_size
        self.num_epages = -(-(num_pages + 1) // self.kv_pages_per_epage)
        if self.num_epages > arena.num_pages:
            raise ValueError(f"the arena has {arena.num_pages} pages, the pool needs {self.num_epages}")
        self.limit_pages = self.num_epages  # elastic pages that may be mapped at once (a run-time limit lowers it)
        self._can_map = self.num_epages  # more elastic pages believed mappable now
        self._dirty = True  # slots freed (or pages mapped) since the last rebalance
        self.registry = registry  # the other servers on this device (elastic_registry.py), or None
        self.floor_pages = max(floor_pages, 1)  # what another server's ask leaves mapped
        self.given_pages = self.asks = 0
        super().__init__(size, page_size, device)

    # -- geometry ----------------------------------------------------------
    def _kv_pages(self, epages: list[int]) -> torch.Tensor:
        """The allocatable KV pages of ``epages`` (never the dummy page 0)."""
        e = self.kv_pages_per_epage
        ranges = [torch.arange(max(p * e, 1), min((p + 1) * e, self.num_pages + 1)) for p in epages]
        return torch.cat(ranges).to(self.device) if ranges else torch.empty(0, dtype=torch.int64, device=self.device)

    def epage_used(self) -> torch.Tensor:
        """KV pages in use in each elastic page."""
        padded = torch.zeros(self.num_epages * self.kv_pages_per_epage, dtype=torch.int64, device=self.device)
        padded[: self.num_pages + 1] = (self.page_used > 0).to(torch.int64)
        return padded.view(self.num_epages, -1).sum(dim=1)

    def mapped_epages(self) -> list[int]:
        return sorted(self.arena.stats.mapped)

    # -- state -------------------------------------------------------------
    def clear(self) -> None:
        """Every slot free; elastic pages beyond the reserve unmapped."""
        self.arena.map(0)  # the dummy page: padded tokens write there
        self._released: list[torch.Tensor] = []
        self._group = None
        self.slot_in_use.zero_()
        self.page_used.zero_()
        self.free_pages = self._kv_pages(self.mapped_epages())
        self._dirty = True
        self.rebalance()

    def available_size(self) -> int:
        """Free slots in mapped elastic pages, plus those of the pages that can
        still be mapped (under the limit and, as last seen, in memory)."""
        return super().available_size() + self._mappable_pages(self._can_map) * self.page_size

    def free_size(self) -> int:
        """Every free slot, mapped or not (the memory invariant's count)."""
        return (self.num_pages - self.used_pages()) * self.page_size

    def _mappable_pages(self, n_epages: int) -> int:
        """KV pages in the ``n_epages`` lowest unmapped elastic pages under
        the limit (counted, not listed: admission asks often). Every elastic
        page holds ``kv_pages_per_epage`` but the dummy page's, always
        mapped, and the last, which the lowest-first order reaches last."""
        mapped = self.arena.stats.mapped
        unmapped = self.num_epages - len(mapped)
        room = max(min(n_epages, self.limit_pages - len(mapped), unmapped), 0)
        pages = room * self.kv_pages_per_epage
        last = self.num_epages - 1
        if room and room == unmapped and last not in mapped:
            pages -= (last + 1) * self.kv_pages_per_epage - (self.num_pages + 1)
        return pages

    def _unmapped(self, n: int) -> list[int]:
        mapped = self.arena.stats.mapped
        return [e for e in range(self.num_epages) if e not in mapped][:n]

    # -- allocation --------------------------------------------------------
    def _take_pages(self, n: int) -> torch.Tensor | None:
        short = n - len(self.free_pages) - sum(len(p) for p in self._released)
        if short > 0 and not self._map_more(short):
            return None
        self._dirty = True  # the reserve may be spent
        return super()._take_pages(n)

    def ensure_mapped(self, n: int) -> bool:
        """Map elastic pages until ``n`` slots are free in mapped pages; False
        when the limit or the device refuses (what did map stays mapped)."""
        short = -(-n // self.page_size) - len(self.free_pages) - sum(len(p) for p in self._released)
        return short <= 0 or self._map_more(short)

    def _map_more(self, kv_pages: int, ask: bool = True) -> bool:
        """Map the fewest lowest unmapped elastic pages that hold ``kv_pages``
        more KV pages, on every rank; their pages join the free list. If the
        device or the group's budget refuses, ``ask`` the other servers."""
        want, held = [], 0
        for e in self._unmapped(max(self.limit_pages - len(self.arena.stats.mapped), 0)):
            if held >= kv_pages:
                break
            want.append(e)
            held += len(self._kv_pages([e]))
        wanted, per_page = len(want), self.arena.bytes_per_page
        if self.registry is not None and want:  # the group's budget, claimed before the device is asked
            want = want[: self.registry.claim(len(want) * per_page, self.arena.mapped_bytes()) // per_page]
        done = 0
        for e in want:
            if not self.arena.map(e):
                break
            done += 1
        agreed = self._agree_min(done)
        for e in want[agreed:done]:  # mapped here, refused on another rank
            self.arena.unmap(e)
        if agreed:
            self._released.append(self._kv_pages(want[:agreed]))
            self._dirty = True
        if self.registry is not None:
            self.registry.publish(self.arena.mapped_bytes())
            if done < wanted and ask:  # the device or the group's budget said no: ask the other servers
                self.registry.ask((wanted - done) * per_page)
                self.asks += 1
            else:
                self.registry.satisfied()
        if agreed < wanted or held < kv_pages:
            self._can_map = 0  # full until the next rebalance looks again
            return False
        return True

    # -- giving memory back ----------------------------------------------------
    def free(self, slots: torch.Tensor) -> None:
        super().free(slots)
        self._dirty = True

    def rebalance(self, evict: Callable[[int], int] | None = None) -> None:
        """Unmap empty elastic pages beyond ``max_reserve`` (highest first),
        map empty ones up to ``min_reserve``, and, after a refused map, look
        at the physical memory again; over the run-time limit, first
        :meth:`shrink` to it with ``evict``. Nothing to do when no slot was
        taken or freed and no map refused since the last call. Same on
        every rank."""
        if self.over_limit() and evict is not None:
            self.shrink(self.limit_pages, evict)
        if not self._dirty and self._can_map > 0:
            return
        self._dirty = False
        e = self.kv_pages_per_epage
        free = len(self.free_pages) + sum(len(p) for p in self._released)  # mapped and free: known without a sync
        if free >= (self.max_reserve + 1) * e:  # maybe more empty pages than the reserve keeps: look (a sync)
            empty = self._empty_epages()
            if len(empty) > self.max_reserve:
                self._unmap(empty[self.max_reserve:])  # the highest: the low pages hold the used slots
        elif free < self.min_reserve * e:  # the reserve: a page's worth of free slots mapped per reserve page
            self._map_more(self.min_reserve * e - free, ask=False)  # no one's need: never asks the others
        per_page = self.arena.bytes_per_page
        room = min(self.limit_pages - len(self.arena.stats.mapped), self.arena.physical_free() // per_page)
        if self.registry is not None and (budget := self.registry.room(self.arena.mapped_bytes())) is not None:
            room = min(room, budget // per_page)
        self._can_map = self._agree_min(max(room, 0))

    def _empty_epages(self) -> list[int]:
        """Mapped elastic pages with every slot free, lowest first (never the dummy page's)."""
        used = self.epage_used().tolist()
        return [e for e in self.mapped_epages() if e != 0 and used[e] == 0]

    def _unmap(self, epages: list[int]) -> None:
        if epages:
            self._drop_free(set(epages))
            for e in sorted(epages, reverse=True):
                self.arena.unmap(e)
            if self.registry is not None:
                self.registry.publish(self.arena.mapped_bytes())

    # -- servers that share the device (elastic_registry.py) --------------------------
    def pages_to_keep(self, cached_slots: int) -> int | None:
        """Between steps, on the rank that decides: publish this pool's
        figures when due, and, if other servers on the device asked for
        memory since the last look, the elastic pages to keep (their ask,
        but never under the floor); None when there is nothing to give."""
        if self.registry is None or not self.registry.due():  # looks every HEARTBEAT_S (100 ms)
            return None
        per_page = self.arena.bytes_per_page
        used = int((self.epage_used() > 0).sum()) * per_page
        self.registry.publish(self.arena.mapped_bytes(), used, cached_slots * per_page // self.epage_slots)
        want = self.registry.demand()
        mapped = len(self.arena.stats.mapped)
        keep = max(self.floor_pages, mapped - -(-want // per_page))
        return keep if want and keep < mapped else None

    def close(self) -> None:
        if self.registry is not None:
            self.registry.close()

    def give(self, epages: int, evict: Callable[[int], int]) -> int:
        """:meth:`shrink` for another server's ask (counted); same on every rank."""
        given = self.shrink(epages, evict)
        self.given_pages += given
        return given

    # -- the run-time limit and giving memory to others ------------------------
    def set_limit(self, epages: int | None) -> None:
        """At most ``epages`` elastic pages mapped (None: the pool's size);
        at least the dummy page's. Applied by the next :meth:`rebalance`."""
        self.limit_pages = self.num_epages if epages is None else min(max(int(epages), 1), self.num_epages)
        self._dirty = True

    def set_limit_bytes(self, limit: int | None) -> None:
        """The limit in bytes of KV memory (all layers), rounded down to whole elastic pages."""
        self.set_limit(None if limit is None else limit // self.arena.bytes_per_page)

    def limit_state(self) -> dict:
        """The limit and what it bounds, for ``/get_kv_limit`` and ``kvctl``."""
        per_page = self.arena.bytes_per_page
        return {**self.pool_stats(), "elastic_kv_max_bytes": self.num_epages * per_page,
                "elastic_kv_page_bytes": per_page, "elastic_kv_over_limit": self.over_limit()}

    def over_limit(self) -> bool:
        """More pages mapped than the run-time limit allows (admissions wait)."""
        return len(self.arena.stats.mapped) > self.limit_pages

    def limit_binds(self) -> bool:
        """Whether the run-time limit, not the pool's size or the device, stops the next map."""
        return self.limit_pages < self.num_epages and len(self.arena.stats.mapped) >= self.limit_pages

    def shrink(self, epages: int, evict: Callable[[int], int]) -> int:
        """Unmap empty pages, and evict cached KV in the cache's own order
        (``evict(n)`` frees up to ``n`` slots, returns how many) to empty
        more, until at most ``epages`` elastic pages are mapped or nothing
        more can go: a slot held by a running request or a locked node keeps
        its page. Returns the pages unmapped."""
        before = len(self.arena.stats.mapped)
        while True:
            empty = self._empty_epages()
            over = len(self.arena.stats.mapped) - max(epages, 1)
            self._unmap(empty[len(empty) - min(over, len(empty)):] if over > 0 else [])
            over -= min(max(over, 0), len(empty))
            if over <= 0 or not evict(over * self.epage_slots):
                break
        self._dirty = True
        return before - len(self.arena.stats.mapped)

    def _drop_free(self, epages: set[int]) -> None:
        """Take the KV pages of ``epages`` (all free) off the free lists."""
        free = torch.cat([self.free_pages, *self._released]) if self._released else self.free_pages
        keep = ~torch.isin(free // self.kv_pages_per_epage,
                           torch.tensor(sorted(epages), dtype=torch.int64, device=self.device))
        self.free_pages, self._released = free[keep].sort().values, []

    # -- figures and checks ------------------------------------------------------
    def pool_stats(self) -> dict[str, float]:
        """Bytes reserved, mapped and used (pages holding a used slot), the
        empty mapped pages (the reserve), map and unmap counts and seconds."""
        s, per_page = self.arena.stats, self.arena.bytes_per_page
        used = self.epage_used()
        used_pages = int((used > 0).sum()) + int(used[0] == 0)  # the dummy page's is in use by padding
        return {"elastic_kv_reserved_bytes": self.arena.reserved_bytes(),
                "elastic_kv_mapped_bytes": self.arena.mapped_bytes(),
                "elastic_kv_used_bytes": used_pages * per_page,
                "elastic_kv_reserve_pages": len(s.mapped) - used_pages,
                "elastic_kv_limit_bytes": self.limit_pages * per_page,
                "elastic_kv_maps": s.maps, "elastic_kv_unmaps": s.unmaps, "elastic_kv_failed_maps": s.failed_maps,
                "elastic_kv_map_seconds": round(s.map_s, 6), "elastic_kv_unmap_seconds": round(s.unmap_s, 6),
                "elastic_kv_floor_bytes": self.floor_pages * per_page, "elastic_kv_given_pages": self.given_pages,
                "elastic_kv_asks": self.asks}

    def _backed_pages(self) -> int:
        return len(self._kv_pages(self.mapped_epages()))

    def _problems(self) -> list[str]:
        """The paged allocator's invariant over the mapped pages, and
        kvcached's rule: no used slot and no free-listed page in an unmapped
        elastic page; the dummy page's elastic page mapped."""
        problems, e = super()._problems(), self.kv_pages_per_epage
        mapped = torch.zeros(self.num_epages, dtype=torch.bool, device=self.device)
        mapped[self.mapped_epages()] = True
        if not bool(mapped[0]):
            problems.append("the dummy page's elastic page is unmapped")
        free = torch.cat([self.free_pages, *self._released]) if self._released else self.free_pages
        if len(free) and not bool(mapped[free // e].all()):
            problems.append("a free-listed page lies in an unmapped elastic page")
        used_pages = torch.nonzero(self.page_used).flatten()
        if len(used_pages) and not bool(mapped[used_pages // e].all()):
            problems.append("a used slot lies in an unmapped elastic page")
        return problems


def build_elastic_pool(size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                       device: torch.device, config: ElasticKVConfig,
                       agree_min: Callable[[int], int] | None = None, tenant: int = 0,
                       ) -> tuple[MHATokenToKVPool, ElasticTokenToKVPoolAllocator]:
    """A KV pool of ``size`` slots over a virtual arena (its K and V buffers
    reserved, nothing mapped beyond the dummy page and the reserve) and its
    allocator, a member of the device's registry (``config.group``) for the
    server ``tenant``. The pool keeps the arena (``pool.arena``)."""
    slot_bytes = head_num * head_dim * dtype.itemsize
    epage_slots = elastic_page_slots([slot_bytes], page_size, granularity(torch.device(device)),
                                     int(config.page_mb * 2**20))
    num_epages = -(-(size + page_size) // epage_slots)
    arena = make_arena([epage_slots * slot_bytes] * (2 * layer_num), num_epages, torch.device(device))
    pool = MHATokenToKVPool(size, page_size, dtype, head_num, head_dim, layer_num, device, buffers=arena.tensors)
    pool.arena = arena
    registry = None
    if config.group is not None:
        device = torch.device(device)
        key = "cpu" if device.type == "cpu" else str(torch.cuda.get_device_properties(device).uuid)
        budget = None if config.group_gb is None else int(config.group_gb * 2**30)
        registry = ElasticRegistry(registry_path(config.group, key), tenant, int(config.min_gb * 2**30), budget)
    floor = -(-int(config.min_gb * 2**30) // arena.bytes_per_page)
    allocator = ElasticTokenToKVPoolAllocator(size, page_size, device, arena, epage_slots, config.min_reserve_pages,
                                              config.max_reserve_pages, agree_min, registry, floor)
    logger.info("elastic KV pool: %d pages of %d slots (%.1f MB each, %.2f GiB reserved), %d mapped",
                num_epages, epage_slots, arena.bytes_per_page / 2**20, arena.reserved_bytes() / 2**30,
                len(arena.stats.mapped))
    return pool, allocator
