"""Buffers whose address range is reserved once and whose physical memory is
mapped and unmapped in pages, for the elastic KV pool (kvcached's design,
``--enable-elastic-kv``, docs/elastic_kv.md).

A :class:`VirtualArena` holds several buffers (a model's per-layer K and V)
that are cut into the same number of *pages*; page ``e`` of the arena is page
``e`` of every buffer (each buffer's page is ``page_bytes[i]`` long), mapped
and unmapped together. Each buffer is seen as one ``uint8`` tensor over its
whole range that never moves, so kernels, views and CUDA graphs made once stay
valid; touching an unmapped page is the caller's bug (on a GPU, an illegal
address).

A buffer may start with a *lead* of ``lead_bytes`` before its page 0 (the
KV pool's dummy page, where padded tokens write), mapped apart from the
pages: :meth:`VirtualArena.map_lead` backs the leads of all the buffers with
one physical allocation on CUDA (each lead in a granule of its own range,
all of them aliases of the same memory: what padding writes there is never
read as anyone's KV), so the lead costs one granule, not one page per buffer.

- :class:`CpuArena`: one anonymous ``mmap`` per buffer (``MAP_NORESERVE``:
  nothing is committed until written); unmapping is ``madvise(MADV_DONTNEED)``,
  so resident memory falls and the page reads as zeros again. Mapping asks
  the kernel to fault the page in at once where it can (``MADV_POPULATE_WRITE``),
  and fails when the machine's available memory would fall below a margin.
- :class:`CudaArena`: the driver's virtual memory API through cuda-python
  (``cuMemAddressReserve`` once per buffer; per page and buffer
  ``cuMemCreate``, ``cuMemMap`` and at once ``cuMemRelease`` (the mapping
  keeps the memory until it is unmapped), then ``cuMemSetAccess``; one
  ``cuMemUnmap`` gives it back), exposed to torch through
  ``__cuda_array_interface__``. A ``cuMemCreate`` that finds no memory
  (another process took it) fails the map, never a kernel. A page comes
  as the driver gives it unless the arena zeroes pages (``zero_pages``).

:meth:`VirtualArena.map_many` and :meth:`VirtualArena.unmap_many` take
several pages at once and work in runs of adjacent pages: on CUDA one look
at the device's free memory (and one memset per buffer, if zeroing) for a run, and one
device sync for all the pages an unmap gives back; where the driver takes a
range over several adjacent mappings (probed once per arena), one
``cuMemSetAccess`` and one ``cuMemUnmap`` per buffer and run. On a CPU one
``madvise`` per buffer and run. The stats count pages either way. Unmaps run
on one thread: sharing a run's buffers out over 4 or 8 threads made the
driver's unmaps slower on an H200, not faster (benchmarks/README.md, "What a
growing pool pays for").
"""

from __future__ import annotations

import abc
import logging
import mmap
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python's module lacks the name
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL) and the page faults in on first write
CPU_MIN_AVAILABLE = 512 << 20  # a CPU map fails rather than leave the machine less than this
FREE_LOOK_S = 0.05  # a CUDA arena asks the driver for free memory at most this often between maps


def page_runs(pages: Iterable[int]) -> list[tuple[int, int]]:
    """``pages`` (any order, repeats ignored) as runs of adjacent pages,
    ``(first, count)``, lowest first."""
    runs: list[list[int]] = []
    for page in sorted(set(pages)):
        if runs and runs[-1][0] + runs[-1][1] == page:
            runs[-1][1] += 1
        else:
            runs.append([page, 1])
    return [(first, count) for first, count in runs]


@dataclass
class ArenaStats:
    """Pages of the arena mapped and unmapped (and refused), and the seconds
    the calls took; a call over several pages counts each of them."""

    maps: int = 0
    unmaps: int = 0
    failed_maps: int = 0
    map_s: float = 0.0
    unmap_s: float = 0.0
    mapped: set[int] = field(default_factory=set)


class VirtualArena(abc.ABC):
    """Buffers of ``num_pages`` pages each (see the module docstring).
    Subclasses give the physical side: ``_map_run`` and ``_unmap_runs``."""

    def __init__(self, page_bytes: list[int], num_pages: int, lead_bytes: int = 0, lead_unit: int = 1):
        self.page_bytes = list(page_bytes)
        self.num_pages = num_pages
        self.lead_bytes = lead_bytes  # each tensor's bytes before its page 0
        self.lead_span = -(-lead_bytes // lead_unit) * lead_unit  # what each range reserves for them
        self.lead_mapped = False
        self.stats = ArenaStats()
        self._stats_lock = threading.Lock()  # a background mapper (page_mapper.py) maps while the scheduler does
        self.tensors: list[torch.Tensor] = []  # one uint8 tensor per buffer: its lead, then its pages

    @property
    def bytes_per_page(self) -> int:
        """Physical bytes one page of the arena takes (all buffers)."""
        return sum(self.page_bytes)

    def reserved_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages + self.lead_span * len(self.page_bytes)

    def mapped_bytes(self) -> int:
        """The pages' bytes mapped, and the leads' (:meth:`lead_physical_bytes`)."""
        return self.bytes_per_page * len(self.stats.mapped) + (self.lead_physical_bytes() if self.lead_mapped else 0)

    def lead_physical_bytes(self) -> int:
        """What the buffers' leads take of memory once mapped."""
        return self.lead_span * len(self.page_bytes)

    def map_lead(self) -> bool:
        """Back every buffer's lead (once; True if it already is); False when
        there is no memory for it."""
        if not self.lead_mapped:
            self.lead_mapped = self._map_lead()
        return self.lead_mapped

    def unmap_lead(self) -> None:
        """Give the leads' memory back (their contents are lost)."""
        if self.lead_mapped:
            self._unmap_lead()
            self.lead_mapped = False

    @abc.abstractmethod
    def _map_lead(self) -> bool:
        """Back the buffers' leads, or map nothing and return False."""

    @abc.abstractmethod
    def _unmap_lead(self) -> None:
        """Give the leads' memory back."""

    @abc.abstractmethod
    def physical_free(self) -> int:
        """Bytes that more pages could take now, as far as the device (or the
        machine) says; a map may still be refused if another process is faster."""

    def is_mapped(self, page: int) -> bool:
        return page in self.stats.mapped

    def map(self, page: int) -> bool:
        """Back page ``page`` of every buffer with memory; False (nothing
        mapped) when there is none to be had."""
        return self.map_many([page]) == 1

    def map_many(self, pages: Iterable[int]) -> int:
        """Map ``pages``, each run of adjacent ones at once; how many of them
        are mapped when this returns. A run refused whole is tried again page
        by page, so as many pages map as one :meth:`map` each would map, and
        a refused page maps in no buffer."""
        pages = set(pages)
        for first, count in page_runs(p for p in pages if p not in self.stats.mapped):
            if not self._timed_map(first, count) and count > 1:
                for page in range(first, first + count):
                    self._timed_map(page, 1)
        return sum(p in self.stats.mapped for p in pages)

    def unmap(self, page: int) -> None:
        """Give page ``page`` of every buffer back; its contents are lost."""
        self.unmap_many([page])

    def unmap_many(self, pages: Iterable[int]) -> None:
        """Give ``pages`` back (those that are mapped); on CUDA after one wait
        for the device, however many they are."""
        runs = page_runs(p for p in pages if p in self.stats.mapped)
        if not runs:
            return
        start = time.perf_counter()
        self._unmap_runs(runs)
        with self._stats_lock:
            self.stats.unmap_s += time.perf_counter() - start
            for first, count in runs:
                self.stats.unmaps += count
                self.stats.mapped.difference_update(range(first, first + count))

    def close(self) -> None:
        self.unmap_many(list(self.stats.mapped))
        self.unmap_lead()

    def enter_thread(self) -> None:
        """Make the calling (background) thread able to map and unmap."""

    def settle(self) -> None:
        """Wait until the pages this thread mapped are ready for any stream
        (on CUDA, zeroed); a map in the scheduler's thread needs no wait."""

    def _timed_map(self, first: int, count: int) -> bool:
        start = time.perf_counter()
        ok = self._map_run(first, count)
        with self._stats_lock:
            self.stats.map_s += time.perf_counter() - start
            if ok:
                self.stats.maps += count
                self.stats.mapped.update(range(first, first + count))
            elif count == 1:  # a longer run refused is tried again page by page, which counts the refusals
                self.stats.failed_maps += 1
        return ok

    @abc.abstractmethod
    def _map_run(self, first: int, count: int) -> bool:
        """Map pages ``first .. first + count - 1`` of every buffer, or map
        none of them and return False."""

    @abc.abstractmethod
    def _unmap_runs(self, runs: list[tuple[int, int]]) -> None:
        """Unmap the pages of ``runs`` (``(first, count)``, all mapped) of every buffer."""


def granularity(device: torch.device) -> int:
    """The smallest page a buffer of ``device`` maps: the OS page on a CPU,
    the driver's minimum allocation granularity on a CUDA device (2 MB on
    current GPUs)."""
    if device.type == "cuda":
        from cuda.bindings import driver

        _check(driver.cuInit(0))
        return _check(driver.cuMemGetAllocationGranularity(
            _cuda_prop(device.index or 0), driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM))
    return mmap.PAGESIZE


def make_arena(page_bytes: list[int], num_pages: int, device: torch.device, keep_free: int = 0,
               zero_pages: bool = False, lead_bytes: int = 0) -> VirtualArena:
    """An arena on ``device`` whose buffers start with ``lead_bytes`` before
    their pages; on CUDA a map never leaves the device less than
    ``keep_free`` bytes free (on a CPU the margin is ``CPU_MIN_AVAILABLE``)."""
    if device.type == "cuda":
        return CudaArena(page_bytes, num_pages, device, keep_free, zero_pages, lead_bytes)
    if device.type == "cpu":
        return CpuArena(page_bytes, num_pages, lead_bytes)
    raise ValueError(f"--enable-elastic-kv: no virtual memory on device {device}")


# -- the CPU ----------------------------------------------------------------------------------------

def available_ram() -> int:
    """Bytes of RAM available to new allocations without swapping (Linux ``MemAvailable``)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


class CpuArena(VirtualArena):
    """A lead needs no mapping: it faults in where it is written (the
    dummy page's few slots), and :meth:`unmap_lead` drops what it holds."""

    def __init__(self, page_bytes: list[int], num_pages: int, lead_bytes: int = 0):
        super().__init__(page_bytes, num_pages, lead_bytes, mmap.PAGESIZE)
        self._maps = [mmap.mmap(-1, self.lead_span + b * num_pages,
                                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE) for b in page_bytes]
        self.tensors = [torch.frombuffer(m, dtype=torch.uint8, offset=self.lead_span - lead_bytes) for m in self._maps]
        self._populate = True  # until the kernel says it cannot

    def physical_free(self) -> int:
        return max(available_ram() - CPU_MIN_AVAILABLE, 0)

    def _map_run(self, first: int, count: int) -> bool:
        if self.physical_free() < count * self.bytes_per_page:
            return False
        if self._populate:
            try:
                for m, b in zip(self._maps, self.page_bytes):
                    m.madvise(MADV_POPULATE_WRITE, self.lead_span + first * b, count * b)
            except OSError:  # an older kernel: the pages fault in when first written
                self._populate = False
        return True

    def _unmap_runs(self, runs: list[tuple[int, int]]) -> None:
        for m, b in zip(self._maps, self.page_bytes):
            for first, count in runs:
                m.madvise(mmap.MADV_DONTNEED, self.lead_span + first * b, count * b)

    def _map_lead(self) -> bool:
        return True  # anonymous memory: it faults in where padding writes

    def _unmap_lead(self) -> None:
        if self.lead_span:
            for m in self._maps:
                m.madvise(mmap.MADV_DONTNEED, 0, self.lead_span)


# -- CUDA ------------------------------------------------------------------------------------------

def _check(result):
    """cuda-python's ``(err, *values)`` as the values, raising on an error."""
    from cuda.bindings import driver

    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise CudaVmmError(err)
    return values[0] if len(values) == 1 else tuple(values) or None


class CudaVmmError(RuntimeError):
    def __init__(self, err):
        self.err = err
        super().__init__(f"CUDA driver: {err}")


def _cuda_prop(device_index: int):
    from cuda.bindings import driver

    prop = driver.CUmemAllocationProp()
    prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    return prop


class _CudaRange:
    """A reserved device address range that torch sees as a uint8 tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.ptr, self.nbytes = ptr, nbytes
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
                                         "strides": None}


class CudaArena(VirtualArena):
    """A :class:`VirtualArena` on a CUDA device (see the module docstring).

    ``span_access`` and ``span_unmap``: whether ``cuMemSetAccess`` and
    ``cuMemUnmap`` are called once over a run of adjacent pages of a buffer
    (several mappings) rather than once a page. The driver documents that an
    unmap must cover whole mappings, not whether one call may cover several:
    :func:`probe_spans` tries it once at start-up, and a call the driver
    refuses later falls back to one a page. ``zero_pages``: new pages are
    zeroed (one memset per buffer and run, on the mapping thread's stream).
    The KV pool does without, as kvcached does: no kernel reads a slot
    before a forward writes it, and on a launch-bound decode the memsets
    cost several percent of the step (benchmarks/README.md, "The mapping
    alone")."""

    def __init__(self, page_bytes: list[int], num_pages: int, device: torch.device, keep_free: int = 0,
                 zero_pages: bool = False, lead_bytes: int = 0):
        from cuda.bindings import driver

        super().__init__(page_bytes, num_pages, lead_bytes, granularity(device))
        self.keep_free = keep_free  # left on the device for activations, this process's and the others'
        self._seen_free, self._looked_at = 0, -FREE_LOOK_S  # the driver's figure, less what was mapped since
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.init()  # the primary context, which torch and the driver calls share
        _check(driver.cuInit(0))
        self._driver = driver
        self._prop = _cuda_prop(self.device.index)
        gran = granularity(self.device)
        if any(b % gran for b in page_bytes):
            raise ValueError(f"elastic KV pages must be multiples of the CUDA granularity ({gran} bytes): {page_bytes}")
        access = driver.CUmemAccessDesc()
        access.location = self._prop.location
        access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self.zero_pages = zero_pages
        self._ranges = []
        with torch.cuda.device(self.device):
            self.span_access, self.span_unmap = probe_spans(self._prop, self._access, gran)
            for b in page_bytes:  # each range: its lead's granules, then its pages
                ptr = int(_check(driver.cuMemAddressReserve(self.lead_span + b * num_pages, gran, 0, 0)))
                self._ranges.append(_CudaRange(ptr, self.lead_span + b * num_pages))
            skip = self.lead_span - lead_bytes
            self.tensors = [torch.as_tensor(_CudaRange(r.ptr + skip, r.nbytes - skip), device=self.device)
                            for r in self._ranges]

    def lead_physical_bytes(self) -> int:
        return self.lead_span  # one allocation behind every buffer's lead

    def physical_free(self) -> int:
        """The device's free memory beyond ``keep_free``, from a look at most
        ``FREE_LOOK_S`` old less what this arena mapped since: the scheduler
        asks every step, and ``cudaMemGetInfo`` is not free. Stale only by
        what other processes did meanwhile, and a map checks afresh."""
        now = time.monotonic()
        if now - self._looked_at > FREE_LOOK_S:
            self._seen_free, self._looked_at = torch.cuda.mem_get_info(self.device)[0], now
        return max(self._seen_free - self.keep_free, 0)

    def enter_thread(self) -> None:
        """The device's primary context, and a stream of the thread's own for
        the zeroing (waited for in :meth:`settle`), so the thread never
        queues work on a stream the forward uses."""
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(torch.cuda.Stream(self.device))

    def settle(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def _map_run(self, first: int, count: int) -> bool:
        """A physical allocation for each page of each buffer (``cuMemMap``
        takes a handle only whole: its offset must be 0), released as soon
        as it is mapped (the driver frees it at the unmap); then the run
        zeroed, one memset per buffer, on the current stream: the forward and
        copy streams wait on that stream before they run (``tp_worker``,
        ``hiradix_cache``), so no host sync. The memsets come after every
        map, so a run refused half way unmaps nothing a memset still writes."""
        driver, need = self._driver, count * self.bytes_per_page
        if self.keep_free:
            self._looked_at = -FREE_LOOK_S  # a fresh look, one for the run
            if self.physical_free() < need:
                return False
        mapped: list[tuple[int, int]] = []  # (address, bytes) of each mapping made: undone if the run fails
        try:
            with torch.cuda.device(self.device):
                for r, b in zip(self._ranges, self.page_bytes):
                    start = self._page_ptr(r, b, first)
                    for ptr in range(start, start + count * b, b):
                        handle = _check(driver.cuMemCreate(b, self._prop, 0))
                        (err,) = driver.cuMemMap(ptr, b, 0, handle, 0)
                        if err == driver.CUresult.CUDA_SUCCESS:
                            mapped.append((ptr, b))
                        _check(driver.cuMemRelease(handle))  # mapped: freed at the unmap; not: freed now
                        _check(err)
                    self._set_access(start, b, count)
                if self.zero_pages:
                    stream = torch.cuda.current_stream().cuda_stream
                    for r, b in zip(self._ranges, self.page_bytes):
                        _check(driver.cuMemsetD8Async(self._page_ptr(r, b, first), 0, count * b, stream))
        except CudaVmmError as exc:
            for ptr, size in reversed(mapped):
                driver.cuMemUnmap(ptr, size)
            if exc.err != driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise
            return False
        self._seen_free -= need
        return True

    def _page_ptr(self, r: _CudaRange, page_bytes: int, page: int) -> int:
        return r.ptr + self.lead_span + page * page_bytes

    def _map_lead(self) -> bool:
        """One allocation of ``lead_span`` bytes, mapped at the start of every
        range (the driver keeps it until its last mapping goes), zeroed if
        pages are."""
        driver = self._driver
        if not self.lead_span:
            return True
        mapped: list[int] = []
        try:
            with torch.cuda.device(self.device):
                handle = _check(driver.cuMemCreate(self.lead_span, self._prop, 0))
                try:
                    for r in self._ranges:
                        _check(driver.cuMemMap(r.ptr, self.lead_span, 0, handle, 0))
                        mapped.append(r.ptr)
                        _check(driver.cuMemSetAccess(r.ptr, self.lead_span, self._access, 1))
                finally:
                    _check(driver.cuMemRelease(handle))
                if self.zero_pages:
                    _check(driver.cuMemsetD8(self._ranges[0].ptr, 0, self.lead_span))
        except CudaVmmError as exc:
            for ptr in mapped:
                driver.cuMemUnmap(ptr, self.lead_span)
            if exc.err != driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise
            return False
        self._seen_free -= self.lead_span
        return True

    def _unmap_lead(self) -> None:
        if self.lead_span:
            torch.cuda.synchronize(self.device)
            for r in self._ranges:
                _check(self._driver.cuMemUnmap(r.ptr, self.lead_span))
            self._seen_free += self.lead_span

    def _set_access(self, start: int, page_bytes: int, count: int) -> None:
        driver = self._driver
        if count > 1 and self.span_access:
            if driver.cuMemSetAccess(start, count * page_bytes, self._access, 1)[0] == driver.CUresult.CUDA_SUCCESS:
                return
        for ptr in range(start, start + count * page_bytes, page_bytes):
            _check(driver.cuMemSetAccess(ptr, page_bytes, self._access, 1))

    def _unmap_runs(self, runs: list[tuple[int, int]]) -> None:
        driver = self._driver
        torch.cuda.synchronize(self.device)  # once for them all: no kernel on any stream may still use them
        for r, b in zip(self._ranges, self.page_bytes):
            for first, count in runs:
                start = self._page_ptr(r, b, first)
                if count > 1 and self.span_unmap:
                    if driver.cuMemUnmap(start, count * b)[0] == driver.CUresult.CUDA_SUCCESS:
                        continue
                for ptr in range(start, start + count * b, b):
                    _check(driver.cuMemUnmap(ptr, b))
        self._seen_free += sum(count for _, count in runs) * self.bytes_per_page

    def close(self) -> None:
        super().close()
        for r in self._ranges:
            self._driver.cuMemAddressFree(r.ptr, r.nbytes)
        self._ranges = []


def probe_spans(prop, access: list, gran: int) -> tuple[bool, bool]:
    """Whether this driver takes one ``cuMemSetAccess``, and one
    ``cuMemUnmap``, over two adjacent mappings: tried on two granules of a
    scratch reservation of the current device. The unmap counts only if
    the whole range is free afterwards (one allocation maps over it)."""
    from cuda.bindings import driver

    ok = driver.CUresult.CUDA_SUCCESS
    base = int(_check(driver.cuMemAddressReserve(2 * gran, gran, 0, 0)))
    mapped: list[tuple[int, int]] = []  # (address, bytes) still mapped: unmapped at the end
    span_access = span_unmap = False
    try:
        for ptr in (base, base + gran):
            handle = _check(driver.cuMemCreate(gran, prop, 0))
            (err,) = driver.cuMemMap(ptr, gran, 0, handle, 0)
            if err == ok:
                mapped.append((ptr, gran))
            _check(driver.cuMemRelease(handle))
            _check(err)
        span_access = driver.cuMemSetAccess(base, 2 * gran, access, 1)[0] == ok
        if driver.cuMemUnmap(base, 2 * gran)[0] == ok:
            handle = _check(driver.cuMemCreate(2 * gran, prop, 0))
            (err,) = driver.cuMemMap(base, 2 * gran, 0, handle, 0)  # refused if a granule is still mapped
            _check(driver.cuMemRelease(handle))
            span_unmap = err == ok
            if span_unmap:
                mapped = [(base, 2 * gran)]
    except CudaVmmError as exc:
        logger.warning("CUDA VMM: the span probe failed (%s); access and unmap a page at a time", exc)
        span_access = span_unmap = False
    finally:
        for ptr, size in mapped:
            driver.cuMemUnmap(ptr, size)  # what the unmap over both left, if it left anything
        driver.cuMemAddressFree(base, 2 * gran)
    logger.info("CUDA VMM: cuMemSetAccess over adjacent pages: %s; cuMemUnmap over adjacent pages: %s",
                "one call a run" if span_access else "one call a page", "one call a run" if span_unmap else "one call a page")
    return span_access, span_unmap
