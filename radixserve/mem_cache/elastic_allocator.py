"""The elastic KV allocator (``--enable-elastic-kv``, docs/elastic_kv.md):
the paged allocator of ``allocator.py`` over a KV pool whose memory is mapped
in *elastic pages* (``virtual_memory.py``) as slots in them are handed out,
and unmapped when every slot in them is free (kvcached's rule).

Region map (``E`` KV pages of ``page_size`` slots per elastic page)::

    KV page:      0    | 1 .. E | E+1 .. 2E | ... | (n-1)E+1 .. num_pages
    elastic page: lead | 0      | 1         | ... | n-1

The dummy KV page 0 (padded tokens write there) is each buffer's *lead*
(``virtual_memory.py``), mapped while the pool holds memory at all: on CUDA
one granule behind every buffer's lead, so a server that gives every page
back keeps 2 MB, not an elastic page.

- Only KV pages of mapped elastic pages are on the free list, so
  ``available_size`` counts *mapped* free slots plus the slots of elastic pages
  that can still be mapped: under the limit (``limit_pages``) and, as far as
  the last look at the device or machine says, in physical memory.
- The allocator *owns* the elastic pages whose KV pages are on its free
  lists or in use. ``_take_pages`` takes the lowest pages it does not own
  when the free ones run short (lower pages first keeps the used slots
  together, so that the high pages empty when load drops): a page mapped
  ahead (below) costs nothing, another is mapped on the spot. A map the
  device refuses makes the allocation fail like a full pool (None), and
  ``available_size`` counts mapped slots only until the next :meth:`rebalance`.
- *Mapped ahead*: a :class:`PageMapper` (``page_mapper.py``) maps the pages
  the allocator will take next on a background thread, and gives back the
  pages it unmaps once the device is done with them, so a step waits for
  the driver only when it outruns that reserve.
- ``ensure_mapped(n)`` maps ahead, so that the next ``n`` slots need no map:
  admission calls it for the tokens it admits, so an admitted prefill never
  meets a refused map.
- :meth:`rebalance`, once a scheduler step, unmaps owned elastic pages with
  every slot free beyond ``max_reserve`` of them (highest first: a slot held
  by a request or a radix node keeps its page), asks for pages mapped ahead
  until free slots and pages mapped ahead make ``min_reserve`` pages, plus
  the most pages one recent step took (``PACE_STEPS``: a burst of prefills
  finds its pages mapped), and looks again at the physical memory. It counts free slots from the free list's length (no
  device sync) and reads the pages' use (a sync) only when there are free
  slots enough to leave more than ``max_reserve`` pages empty. Frees never unmap
  by themselves, so a step never loses a page that it freed and reuses.
- Under tensor parallelism every rank runs the same decisions; each map is
  tried on every rank and counts only as far as it succeeded on all of them
  (``agree_min``), so the ranks' pools stay identical. What each rank maps
  ahead is its own affair: no decision depends on it.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import Callable

import torch

from radixserve.feature_args import ElasticKVConfig
from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_floor, pages_for
from radixserve.mem_cache.elastic_registry import ElasticRegistry, registry_path
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.mem_cache.page_mapper import PageMapper
from radixserve.mem_cache.virtual_memory import VirtualArena, granularity, make_arena

logger = logging.getLogger(__name__)

PACE_STEPS = 16  # the reserve grows by the most elastic pages one of the last steps took
# While a batch is in flight, look for empty pages (a device sync, which
# would stall the overlap of the next batch's scheduling) once in so many steps.
LOOK_STEPS = 32


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
    memory_released = False  # /release_memory_occupation gave every page back: nothing maps until resume()

    def __init__(self, size: int, page_size: int, device: str | torch.device, arena: VirtualArena,
                 epage_slots: int, min_reserve: int = 1, max_reserve: int = 2,
                 agree_min: Callable[[int], int] | None = None, registry: ElasticRegistry | None = None,
                 floor_pages: int = 1, background: bool = False):
        if epage_slots % page_size:
            raise ValueError(f"an elastic page of {epage_slots} slots holds no whole number of {page_size}-slot pages")
        if not 0 <= min_reserve <= max_reserve:
            raise ValueError(f"reserve pages: need 0 <= min ({min_reserve}) <= max ({max_reserve})")
        if any(arena.lead_bytes * epage_slots != page_size * b for b in arena.page_bytes):
            raise ValueError(f"the arena's buffers must start with the dummy page: a lead of {page_size} slots "
                             f"of {arena.page_bytes[0] // epage_slots} bytes, not {arena.lead_bytes} bytes")
        self.arena = arena
        self.epage_slots = epage_slots
        self.kv_pages_per_epage = epage_slots // page_size
        self.min_reserve, self.max_reserve = min_reserve, max_reserve
        self._agree_min = agree_min or (lambda value: value)
        num_pages = page_floor(size, page_size) // page_size  # the pool's whole pages, as the base class counts
        self.num_epages = pages_for(num_pages, self.kv_pages_per_epage)
        if self.num_epages > arena.num_pages:
            raise ValueError(f"the arena has {arena.num_pages} pages, the pool needs {self.num_epages}")
        self.limit_pages = self.num_epages  # elastic pages that may be mapped at once (a run-time limit lowers it)
        self._can_map = self.num_epages  # more elastic pages believed mappable now
        self._dirty = True  # slots freed (or pages mapped) since the last rebalance
        self._unlooked = 0  # calls since the last look for empty pages, while busy
        self.registry = registry  # the other servers on this device (elastic_registry.py), or None
        self.floor_pages = max(floor_pages, 0)  # what another server's ask leaves mapped
        self.given_pages = self.asks = 0
        self.mapper = PageMapper(arena, background)
        self._owned: set[int] = set()  # elastic pages whose KV pages are free-listed or in use
        self._ahead: list[int] = []  # pages asked of the mapper, not owned yet, ascending (this rank's own)
        self._taken = 0  # elastic pages taken since the last rebalance
        self._pace: deque[int] = deque([0], maxlen=PACE_STEPS)
        super().__init__(size, page_size, device)

    # -- geometry ----------------------------------------------------------
    def _kv_pages(self, epages: list[int]) -> torch.Tensor:
        """The KV pages of ``epages``."""
        e = self.kv_pages_per_epage
        ranges = [torch.arange(1 + p * e, min(1 + (p + 1) * e, self.num_pages + 1)) for p in epages]
        return torch.cat(ranges).to(self.device) if ranges else torch.empty(0, dtype=torch.int64, device=self.device)

    def epage_of(self, kv_pages: torch.Tensor) -> torch.Tensor:
        """The elastic page of each of ``kv_pages`` (never the dummy page 0)."""
        return (kv_pages - 1) // self.kv_pages_per_epage

    def epage_used(self) -> torch.Tensor:
        """KV pages in use in each elastic page."""
        padded = torch.zeros(self.num_epages * self.kv_pages_per_epage, dtype=torch.int64, device=self.device)
        padded[: self.num_pages] = (self.page_used[1:] > 0).to(torch.int64)
        return padded.view(self.num_epages, -1).sum(dim=1)

    def mapped_epages(self) -> list[int]:
        """The elastic pages the allocator owns (mapped, their slots free or in use)."""
        return sorted(self._owned)

    def _held(self) -> int:
        """Elastic pages owned or mapped ahead: what the limit bounds."""
        return len(self._owned) + len(self._ahead)

    def _held_bytes(self) -> int:
        """What this pool holds for the registry: pages given back count as
        gone at once, although the mapper may still be unmapping them."""
        return self._held() * self.arena.bytes_per_page

    # -- state -------------------------------------------------------------
    def clear(self) -> None:
        """Every slot free; elastic pages beyond the reserve unmapped."""
        if not self.arena.map_lead():  # the dummy page: padded tokens write there
            raise MemoryError("elastic KV pool: the device has no memory for the dummy page")
        self._released: list[torch.Tensor] = []
        self._group = None
        self.slot_in_use.zero_()
        self.page_used.zero_()
        self.free_pages = self._kv_pages(self.mapped_epages())
        self._dirty = True
        self.rebalance()
        self.mapper.drain()  # a flush gives its memory back before it returns

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
        page holds ``kv_pages_per_epage`` but the last, which the
        lowest-first order reaches last."""
        owned = self._owned
        unowned = self.num_epages - len(owned)
        room = max(min(n_epages, self.limit_pages - len(owned), unowned), 0)
        pages = room * self.kv_pages_per_epage
        last = self.num_epages - 1
        if room and room == unowned and last not in owned:
            pages -= (last + 1) * self.kv_pages_per_epage - self.num_pages
        return pages

    def _unowned(self, n: int, skip: set[int] | list[int] = ()) -> list[int]:
        """The ``n`` lowest elastic pages not owned (nor in ``skip``)."""
        out, skip = [], set(skip)
        for e in range(self.num_epages):
            if len(out) >= n:
                break
            if e not in self._owned and e not in skip:
                out.append(e)
        return out

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
        short = pages_for(n, self.page_size) - len(self.free_pages) - sum(len(p) for p in self._released)
        return short <= 0 or self._map_more(short)

    def _map_more(self, kv_pages: int, ask: bool = True) -> bool:
        """Take the fewest lowest elastic pages not owned that hold ``kv_pages``
        more KV pages, on every rank (mapped ahead, or mapped now); their pages
        join the free list. If the device or the group's budget refuses,
        ``ask`` the other servers."""
        if self.memory_released:
            return False
        want, held = [], 0
        for e in self._unowned(max(self.limit_pages - len(self._owned), 0)):
            if held >= kv_pages:
                break
            want.append(e)
            held += len(self._kv_pages([e]))
        wanted, per_page = len(want), self.arena.bytes_per_page
        if self.registry is not None and want:  # the group's budget, claimed before the device is asked
            ahead = set(self._ahead)
            fresh = [i for i, e in enumerate(want) if e not in ahead]  # those mapped ahead were claimed then
            granted = self.registry.claim(len(fresh) * per_page, self._held_bytes()) // per_page
            if granted < len(fresh):
                want = want[: fresh[granted]]
        done = 0
        for e in want:
            if not self.mapper.map_now(e):
                break
            done += 1
        agreed = self._agree_min(done)
        taken = want[:agreed]
        # mapped here but refused on another rank: this rank keeps them mapped ahead
        self._ahead = sorted((set(self._ahead) | set(want[agreed:done])) - set(taken))
        if agreed:
            self._owned.update(taken)
            self._released.append(self._kv_pages(taken))
            self._taken += agreed
            self._dirty = True
        if self.registry is not None:
            self.registry.publish(self._held_bytes())
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

    def rebalance(self, evict: Callable[[int], int] | None = None, busy: bool = False) -> None:
        """Unmap owned elastic pages with every slot free beyond
        ``max_reserve`` (highest first), ask for pages mapped ahead (see the
        module docstring), and, after a refused map, look at the physical
        memory again; over the run-time limit, first :meth:`shrink` to it
        with ``evict``. Nothing to do when no slot was taken or freed and no
        map refused since the last call. Finding empty pages reads the
        device: while ``busy`` (a batch in flight) only every
        ``LOOK_STEPS`` calls. Same on every rank."""
        if self.memory_released:  # /release_memory_occupation: nothing maps until resume()
            return
        if self.over_limit() and evict is not None:
            self.shrink(self.limit_pages, evict)
        self._pace.append(self._taken)
        self._taken = 0
        if not self._dirty and self._can_map > 0:
            return
        self._dirty = False
        e = self.kv_pages_per_epage
        free = len(self.free_pages) + sum(len(p) for p in self._released)  # owned and free: known without a sync
        if free >= (self.max_reserve + 1) * e:  # maybe more empty pages than the reserve keeps: look (a sync)
            if busy and self._unlooked < LOOK_STEPS:
                self._unlooked += 1
                self._dirty = True  # look at a later call
            else:
                self._unlooked = 0
                empty = self._empty_epages()
                if len(empty) > self.max_reserve:
                    self._unmap(empty[self.max_reserve:])  # the highest: the low pages hold the used slots
        self._plan_ahead(free // e)
        per_page = self.arena.bytes_per_page
        physical = len(self._ahead) + self.arena.physical_free() // per_page
        room = min(self.limit_pages - len(self._owned), physical)
        if self.registry is not None and (budget := self.registry.room(self._held_bytes())) is not None:
            room = min(room, len(self._ahead) + budget // per_page)
        self._can_map = self._agree_min(max(room, 0))

    def _plan_ahead(self, free_epages: int) -> None:
        """Keep ``min_reserve`` pages, plus the recent pace, in free slots and
        pages mapped ahead; give back those mapped ahead beyond that and the
        reserve's slack (``max_reserve - min_reserve``), unless the free
        pages and those mapped ahead are no more than ``max_reserve``: empty
        pages are the reserve, mapped ahead or not. Never asks the other
        servers: the reserve is no one's need."""
        want = max(self.min_reserve + max(self._pace) - free_epages, 0)
        keep = max(want + (self.max_reserve - self.min_reserve if want else 0), self.max_reserve - free_epages)
        if len(self._ahead) > keep:
            self._drop_ahead(len(self._ahead) - keep)
        room = min(want - len(self._ahead), self.limit_pages - self._held())
        if room <= 0 or self._can_map <= 0 and not self._device_has_room():
            return
        pages = self._unowned(room, skip=self._ahead)
        if self.registry is not None and pages:
            pages = pages[: self.registry.claim(len(pages) * self.arena.bytes_per_page, self._held_bytes())
                          // self.arena.bytes_per_page]
        self._ahead = sorted(self._ahead + pages)
        self.mapper.map_ahead(pages)

    def _device_has_room(self) -> bool:
        """After a refused map: whether the device seems to have a page's room again."""
        return self.arena.physical_free() >= self.arena.bytes_per_page

    def _drop_ahead(self, n: int) -> None:
        """Give back the ``n`` highest pages mapped ahead."""
        if n > 0:
            drop, self._ahead = self._ahead[len(self._ahead) - n:], self._ahead[: len(self._ahead) - n]
            self.mapper.unmap(drop)

    def _empty_epages(self) -> list[int]:
        """Mapped elastic pages with every slot free, lowest first."""
        used = self.epage_used().tolist()
        return [e for e in self.mapped_epages() if used[e] == 0]

    def _unmap(self, epages: list[int]) -> None:
        """Give owned, empty ``epages`` back (the mapper unmaps them once the device is done)."""
        if epages:
            self._drop_free(set(epages))
            self._owned.difference_update(epages)
            self.mapper.unmap(sorted(epages, reverse=True))
            if self.registry is not None:
                self.registry.publish(self._held_bytes())

    # -- servers that share the device (elastic_registry.py) --------------------------
    def pages_to_keep(self, cached_slots: int, idle: bool) -> int | None:
        """Between steps, on the rank that decides: publish this pool's
        figures when due, and, if other servers on the device asked for
        memory since the last look, the elastic pages to keep: the floor
        when this server is ``idle`` (its whole cache goes at the first ask,
        so a busy neighbour does not wait for it page by page), else what
        the ask leaves, never under the floor; None when there is nothing
        to give."""
        if self.registry is None or not self.registry.due():  # looks every HEARTBEAT_S (100 ms)
            return None
        per_page = self.arena.bytes_per_page
        used = int((self.epage_used() > 0).sum()) * per_page
        self.registry.publish(self._held_bytes(), used, cached_slots * per_page // self.epage_slots)
        want = self.registry.demand()
        mapped = self._held()
        keep = self.floor_pages if idle else max(self.floor_pages, mapped - -(-want // per_page))
        return keep if want and keep < mapped else None

    def close(self) -> None:
        self.mapper.close()
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
        at least one (a pool that may map none would hold every admission
        for ever). Applied by the next :meth:`rebalance`."""
        self.limit_pages = self.num_epages if epages is None else min(max(int(epages), 1), self.num_epages)
        self._dirty = True

    def set_limit_bytes(self, limit: int | None) -> None:
        """The limit in bytes of KV memory (all layers), rounded down to whole elastic pages."""
        self.set_limit(None if limit is None else limit // self.arena.bytes_per_page)

    def apply_limit(self, evict: Callable[[int], int]) -> None:
        """Apply the limit now (:meth:`rebalance`) and wait for the unmaps it
        queued, so the figures read next are the ones it leaves."""
        self.rebalance(evict)
        self.mapper.drain()

    def limit_state(self) -> dict:
        """The limit and what it bounds, for ``/get_kv_limit`` and ``kvctl``."""
        per_page = self.arena.bytes_per_page
        return {**self.pool_stats(), "elastic_kv_max_bytes": self.num_epages * per_page,
                "elastic_kv_page_bytes": per_page, "elastic_kv_over_limit": self.over_limit()}

    def over_limit(self) -> bool:
        """More pages held than the run-time limit allows (admissions wait)."""
        return self._held() > self.limit_pages

    def limit_binds(self) -> bool:
        """Whether the run-time limit, not the pool's size or the device, stops the next map."""
        return self.limit_pages < self.num_epages and len(self._owned) >= self.limit_pages

    def shrink(self, epages: int, evict: Callable[[int], int]) -> int:
        """Unmap empty pages, and evict cached KV in the cache's own order
        (``evict(n)`` frees up to ``n`` slots, returns how many) to empty
        more, until at most ``epages`` elastic pages are mapped or nothing
        more can go: a slot held by a running request or a locked node keeps
        its page; pages mapped ahead go first. Returns the pages unmapped."""
        before = self._held()
        self._drop_ahead(len(self._ahead))
        while True:
            empty = self._empty_epages()
            over = len(self._owned) - max(epages, 0)
            self._unmap(empty[len(empty) - min(over, len(empty)):] if over > 0 else [])
            over -= min(max(over, 0), len(empty))
            if over <= 0 or not evict(over * self.epage_slots):
                break
        self._dirty = True
        return before - self._held()

    def _drop_free(self, epages: set[int]) -> None:
        """Take the KV pages of ``epages`` (all free) off the free lists."""
        free = torch.cat([self.free_pages, *self._released]) if self._released else self.free_pages
        keep = ~torch.isin(self.epage_of(free),
                           torch.tensor(sorted(epages), dtype=torch.int64, device=self.device))
        self.free_pages, self._released = free[keep].sort().values, []

    # -- all of its memory given back (/release_memory_occupation) -------------------
    def release(self) -> None:
        """Every slot free, as :meth:`clear` (the caller emptied the cache and
        no request holds KV), and every elastic page given back, and the
        dummy page's lead, by the time this returns; nothing maps until
        :meth:`resume` (the scheduler admits nothing meanwhile). Same on
        every rank."""
        self._group = None
        self.slot_in_use.zero_()
        self.page_used.zero_()
        self._drop_ahead(len(self._ahead))
        self._unmap(self.mapped_epages())
        self.mapper.drain()
        self.arena.unmap_lead()
        self.memory_released, self._can_map = True, 0

    def resume(self) -> bool:
        """Map the dummy page's lead back and refill the reserve
        (:meth:`clear`); False, and still released, when the device of any
        rank refuses the lead."""
        if not self._agree_min(int(self.arena.map_lead())):
            self.arena.unmap_lead()
            return False
        self.memory_released = False
        self.clear()
        return True

    # -- figures and checks ------------------------------------------------------
    def pool_stats(self) -> dict[str, float]:
        """Bytes reserved, mapped and used (pages holding a used slot, and
        the dummy page's lead: padding writes there), the empty mapped pages
        (the reserve), map and unmap counts and seconds."""
        s, per_page, arena = self.arena.stats, self.arena.bytes_per_page, self.arena
        used_pages = int((self.epage_used() > 0).sum())
        lead = arena.lead_physical_bytes() if arena.lead_mapped else 0
        return {"elastic_kv_reserved_bytes": arena.reserved_bytes(),
                "elastic_kv_mapped_bytes": arena.mapped_bytes(),
                "elastic_kv_used_bytes": used_pages * per_page + lead,
                "elastic_kv_lead_bytes": lead,
                "elastic_kv_reserve_pages": len(s.mapped) - used_pages,
                "elastic_kv_limit_bytes": self.limit_pages * per_page,
                "elastic_kv_maps": s.maps, "elastic_kv_unmaps": s.unmaps, "elastic_kv_failed_maps": s.failed_maps,
                "elastic_kv_map_seconds": round(s.map_s, 6), "elastic_kv_unmap_seconds": round(s.unmap_s, 6),
                "elastic_kv_floor_bytes": self.floor_pages * per_page, "elastic_kv_given_pages": self.given_pages,
                "elastic_kv_asks": self.asks, "elastic_kv_ahead_pages": len(self._ahead),
                "elastic_kv_step_maps": self.mapper.now_maps,
                "elastic_kv_step_map_seconds": round(self.mapper.now_map_s, 6)}

    def _backed_pages(self) -> int:
        return len(self._kv_pages(self.mapped_epages()))

    def _problems(self) -> list[str]:
        """The paged allocator's invariant over the mapped pages, and
        kvcached's rule: no used slot and no free-listed page in an unmapped
        elastic page; the dummy page's lead mapped."""
        problems = super()._problems()
        mapped = torch.zeros(self.num_epages, dtype=torch.bool, device=self.device)
        mapped[self.mapped_epages()] = True
        if not self.arena.lead_mapped and not self.memory_released:
            problems.append("the dummy page's lead is unmapped")
        if any(not self.arena.is_mapped(p) for p in self._owned):
            problems.append("an owned elastic page is not mapped")
        if self._owned.intersection(self._ahead):
            problems.append("an owned elastic page is also mapped ahead")
        free = torch.cat([self.free_pages, *self._released]) if self._released else self.free_pages
        if len(free) and not bool(mapped[self.epage_of(free)].all()):
            problems.append("a free-listed page lies in an unmapped elastic page")
        used_pages = torch.nonzero(self.page_used).flatten()
        used_pages = used_pages[used_pages > 0]  # the dummy page 0 is the lead's, checked above
        if len(used_pages) and not bool(mapped[self.epage_of(used_pages)].all()):
            problems.append("a used slot lies in an unmapped elastic page")
        return problems


def build_elastic_pool(size: int, page_size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                       device: torch.device, config: ElasticKVConfig,
                       agree_min: Callable[[int], int] | None = None, tenant: int = 0, keep_free: int = 0,
                       ) -> tuple[MHATokenToKVPool, ElasticTokenToKVPoolAllocator]:
    """A KV pool of ``size`` slots over a virtual arena (its K and V buffers
    reserved, nothing mapped beyond the dummy page's lead and the reserve) and its
    allocator, a member of the device's registry (``config.group``) for the
    server ``tenant``; a map never leaves the device less than ``keep_free``
    bytes. The pool keeps the arena (``pool.arena``)."""
    slot_bytes = head_num * head_dim * dtype.itemsize
    epage_slots = elastic_page_slots([slot_bytes], page_size, granularity(torch.device(device)),
                                     int(config.page_mb * 2**20))
    num_epages = pages_for(page_floor(size, page_size), epage_slots)
    arena = make_arena([epage_slots * slot_bytes] * (2 * layer_num), num_epages, torch.device(device), keep_free,
                       lead_bytes=page_size * slot_bytes)  # the dummy page
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
                                              config.max_reserve_pages, agree_min, registry, floor, background=True)
    logger.info("elastic KV pool: %d pages of %d slots (%.1f MB each, %.2f GiB reserved), %d mapped",
                num_epages, epage_slots, arena.bytes_per_page / 2**20, arena.reserved_bytes() / 2**30,
                len(arena.stats.mapped))
    return pool, allocator
