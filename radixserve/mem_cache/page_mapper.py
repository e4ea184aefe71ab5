"""Maps an arena's pages ahead of need, and unmaps the pages given back, off
the scheduler's path (kvcached's reserve refilled by a background thread;
docs/elastic_kv.md, "Off the critical path").

The elastic allocator decides which pages to map ahead and which to give
back; a :class:`PageMapper` carries that out, in order, on one background
thread (or at once in the caller, ``background=False``: tests, and the
pools that never want a thread). On CUDA a map ahead is complete (its page
zeroed) before the page counts as mapped, and an unmap first waits for the
device, so a kernel still in flight never loses its page; neither wait is
the scheduler's. The allocator takes a page mapped ahead with
:meth:`map_now`, which costs nothing when the thread got there first and
maps on the spot otherwise (a step that outruns the reserve).

The thread takes the queue in batches: the maps (or the unmaps) asked one
after another, up to ``map_batch`` (``unmap_batch``) pages, go to the arena
in one :meth:`~VirtualArena.map_many` (``unmap_many``) call, so a run of
pages costs one look at the device's free memory, one memset per buffer and
one wait for the zeroing, and an unmap of many pages one device sync. A map
and an unmap are never in one batch, and batches keep the order asked.

Only the allocator's thread calls the public methods; the arena is touched
by at most one thread per page at a time (``_busy``, the pages the thread is
working on outside the lock).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque

from radixserve.mem_cache.virtual_memory import VirtualArena

logger = logging.getLogger(__name__)

# Pages one call maps: a step that needs a page of a batch the thread is on
# waits for the whole batch (on CUDA a few ms a page), so maps go in short runs.
MAP_BATCH = 8
UNMAP_BATCH = 256  # a step waits for an unmap only to take the same page back, which waits for it anyway


class PageMapper:
    """Runs ``arena.map`` ahead of need and ``arena.unmap`` after the device
    is done, in the order asked (see the module docstring)."""

    def __init__(self, arena: VirtualArena, background: bool = True, map_batch: int = MAP_BATCH,
                 unmap_batch: int = UNMAP_BATCH):
        if map_batch < 1 or unmap_batch < 1:
            raise ValueError(f"mapper batches of at least one page: {map_batch}, {unmap_batch}")
        self.arena = arena
        self.map_batch, self.unmap_batch = map_batch, unmap_batch
        self._cond = threading.Condition()
        self._queue: deque[tuple[bool, int]] = deque()  # (map?, page), in the order asked
        self._busy: frozenset[int] = frozenset()  # the pages the thread is mapping or unmapping now
        self._closed = False
        self.error: BaseException | None = None  # what stopped the thread (raised at the next call)
        self.now_maps = 0  # maps the caller waited for: the reserve ran short
        self.now_map_s = 0.0
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._run, name="elastic-kv-mapper", daemon=True)
            self._thread.start()

    # -- the allocator's side --------------------------------------------------------------
    def map_ahead(self, pages: list[int]) -> None:
        """Map ``pages`` soon; a refusal is found out by :meth:`map_now`."""
        self._submit([(True, p) for p in pages])

    def unmap(self, pages: list[int]) -> None:
        """Give ``pages`` back once no kernel can be using them."""
        self._submit([(False, p) for p in pages])

    def map_now(self, page: int) -> bool:
        """``page`` mapped when this returns True (waiting for the thread if it
        is on the page, or is still to give it back); False if the device refuses."""
        start = time.perf_counter()
        with self._cond:
            self._raise()
            self._queue = deque(op for op in self._queue if op != (True, page))  # done here instead
            while page in self._busy or (False, page) in self._queue:
                self._cond.wait()
                self._raise()
            if self.arena.is_mapped(page):
                return True
            ok = self.arena.map(page)
        self.now_maps += 1
        self.now_map_s += time.perf_counter() - start
        return ok

    def pending(self) -> int:
        """Maps and unmaps asked for and not done yet."""
        with self._cond:
            return len(self._queue) + len(self._busy)

    def drain(self) -> None:
        """Wait until everything asked for is done."""
        with self._cond:
            while self._queue or self._busy:
                self._raise()
                self._cond.wait()
            self._raise()

    def close(self) -> None:
        """Finish what was asked and stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    # -- the thread ----------------------------------------------------------------------
    def _submit(self, ops: list[tuple[bool, int]]) -> None:
        if not ops:
            return
        if self._thread is None:
            queue = deque(ops)
            while queue:
                self._do(*self._take(queue))
            return
        with self._cond:
            self._raise()
            self._queue.extend(ops)
            self._cond.notify_all()

    def _take(self, queue: deque[tuple[bool, int]]) -> tuple[bool, list[int]]:
        """The next batch off ``queue``: its first op and the ops of the same
        kind that follow it, up to the batch's size."""
        map_, page = queue.popleft()
        pages, limit = [page], self.map_batch if map_ else self.unmap_batch
        while queue and queue[0][0] == map_ and len(pages) < limit:
            pages.append(queue.popleft()[1])
        return map_, pages

    def _do(self, map_: bool, pages: list[int]) -> None:
        if map_:
            if self.arena.map_many(pages):
                self.arena.settle()  # zeroed before anyone takes them
        else:
            self.arena.unmap_many(pages)  # waits for the device first

    def _run(self) -> None:
        error = self._attempt(self.arena.enter_thread)
        while error is None:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                map_, pages = self._take(self._queue)
                self._busy = frozenset(pages)
            error = self._attempt(self._do, map_, pages)
            with self._cond:  # the failure and the end of the work seen together
                self._busy = frozenset()
                self.error = error
                self._cond.notify_all()
        with self._cond:
            self.error = error
            self._cond.notify_all()

    @staticmethod
    def _attempt(fn, *args) -> BaseException | None:
        """``fn(*args)``; what it raised, for the scheduler's next call to raise: never a silent stop."""
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001
            logger.exception("elastic KV mapper stopped")
            return exc
        return None

    def _raise(self) -> None:
        if self.error is not None:
            raise RuntimeError("the elastic KV mapper thread failed") from self.error
