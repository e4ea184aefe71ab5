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

- :class:`CpuArena`: one anonymous ``mmap`` per buffer (``MAP_NORESERVE``:
  nothing is committed until written); unmapping is ``madvise(MADV_DONTNEED)``,
  so resident memory falls and the page reads as zeros again. Mapping asks
  the kernel to fault the page in at once where it can (``MADV_POPULATE_WRITE``),
  and fails when the machine's available memory would fall below a margin.
- :class:`CudaArena`: the driver's virtual memory API through cuda-python
  (``cuMemAddressReserve`` once per buffer; per page ``cuMemCreate``,
  ``cuMemMap``, ``cuMemSetAccess``, and ``cuMemUnmap`` / ``cuMemRelease`` to
  give it back), exposed to torch through ``__cuda_array_interface__``. A
  ``cuMemCreate`` that finds no memory (another process took it) fails the
  map, never a kernel. A page is zeroed when mapped.
"""

from __future__ import annotations

import abc
import logging
import mmap
import os
import threading
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)  # Linux's value; Python's module lacks the name
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL) and the page faults in on first write
CPU_MIN_AVAILABLE = 512 << 20  # a CPU map fails rather than leave the machine less than this
FREE_LOOK_S = 0.05  # a CUDA arena asks the driver for free memory at most this often between maps


@dataclass
class ArenaStats:
    """Map and unmap calls (pages of the arena) and the seconds they took."""

    maps: int = 0
    unmaps: int = 0
    failed_maps: int = 0
    map_s: float = 0.0
    unmap_s: float = 0.0
    mapped: set[int] = field(default_factory=set)


class VirtualArena(abc.ABC):
    """Buffers of ``num_pages`` pages each (see the module docstring).
    Subclasses give the physical side: ``_map_page`` and ``_unmap_page``."""

    def __init__(self, page_bytes: list[int], num_pages: int):
        self.page_bytes = list(page_bytes)
        self.num_pages = num_pages
        self.stats = ArenaStats()
        self._stats_lock = threading.Lock()  # a background mapper (page_mapper.py) maps while the scheduler does
        self.tensors: list[torch.Tensor] = []  # one uint8 tensor per buffer, over its whole range

    @property
    def bytes_per_page(self) -> int:
        """Physical bytes one page of the arena takes (all buffers)."""
        return sum(self.page_bytes)

    def reserved_bytes(self) -> int:
        return self.bytes_per_page * self.num_pages

    def mapped_bytes(self) -> int:
        return self.bytes_per_page * len(self.stats.mapped)

    @abc.abstractmethod
    def physical_free(self) -> int:
        """Bytes that more pages could take now, as far as the device (or the
        machine) says; a map may still be refused if another process is faster."""

    def is_mapped(self, page: int) -> bool:
        return page in self.stats.mapped

    def map(self, page: int) -> bool:
        """Back page ``page`` of every buffer with memory; False (nothing
        mapped) when there is none to be had."""
        if page in self.stats.mapped:
            return True
        start = time.perf_counter()
        ok = self._map_page(page)
        with self._stats_lock:
            self.stats.map_s += time.perf_counter() - start
            if ok:
                self.stats.maps += 1
                self.stats.mapped.add(page)
            else:
                self.stats.failed_maps += 1
        return ok

    def unmap(self, page: int) -> None:
        """Give page ``page`` of every buffer back; its contents are lost."""
        if page not in self.stats.mapped:
            return
        start = time.perf_counter()
        self._unmap_page(page)
        with self._stats_lock:
            self.stats.unmap_s += time.perf_counter() - start
            self.stats.unmaps += 1
            self.stats.mapped.discard(page)

    def close(self) -> None:
        for page in sorted(self.stats.mapped):
            self.unmap(page)

    def enter_thread(self) -> None:
        """Make the calling (background) thread able to map and unmap."""

    def settle(self) -> None:
        """Wait until the pages this thread mapped are ready for any stream
        (on CUDA, zeroed); a map in the scheduler's thread needs no wait."""

    @abc.abstractmethod
    def _map_page(self, page: int) -> bool:
        """Map ``page`` of every buffer, or map none of them and return False."""

    @abc.abstractmethod
    def _unmap_page(self, page: int) -> None:
        """Unmap ``page`` of every buffer."""


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


def make_arena(page_bytes: list[int], num_pages: int, device: torch.device, keep_free: int = 0) -> VirtualArena:
    """An arena on ``device``; on CUDA a map never leaves the device less than
    ``keep_free`` bytes free (on a CPU the margin is ``CPU_MIN_AVAILABLE``)."""
    if device.type == "cuda":
        return CudaArena(page_bytes, num_pages, device, keep_free)
    if device.type == "cpu":
        return CpuArena(page_bytes, num_pages)
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
    def __init__(self, page_bytes: list[int], num_pages: int):
        super().__init__(page_bytes, num_pages)
        self._maps = [mmap.mmap(-1, b * num_pages, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE)
                      for b in page_bytes]
        self.tensors = [torch.frombuffer(m, dtype=torch.uint8) for m in self._maps]
        self._populate = True  # until the kernel says it cannot

    def physical_free(self) -> int:
        return max(available_ram() - CPU_MIN_AVAILABLE, 0)

    def _map_page(self, page: int) -> bool:
        if self.physical_free() < self.bytes_per_page:
            return False
        if self._populate:
            try:
                for m, b in zip(self._maps, self.page_bytes):
                    m.madvise(MADV_POPULATE_WRITE, page * b, b)
            except OSError:  # an older kernel: the page faults in when first written
                self._populate = False
        return True

    def _unmap_page(self, page: int) -> None:
        for m, b in zip(self._maps, self.page_bytes):
            m.madvise(mmap.MADV_DONTNEED, page * b, b)


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
    def __init__(self, page_bytes: list[int], num_pages: int, device: torch.device, keep_free: int = 0):
        from cuda.bindings import driver

        super().__init__(page_bytes, num_pages)
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
        self._ranges = []
        with torch.cuda.device(self.device):
            for b in page_bytes:
                ptr = int(_check(driver.cuMemAddressReserve(b * num_pages, gran, 0, 0)))
                self._ranges.append(_CudaRange(ptr, b * num_pages))
            self.tensors = [torch.as_tensor(r, device=self.device) for r in self._ranges]
        self._handles: dict[int, list] = {}  # page -> the physical allocation of each buffer's page

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

    def _map_page(self, page: int) -> bool:
        """A physical allocation for the page of each buffer (``cuMemMap``
        takes a handle only whole: its offset must be 0), zeroed on the
        current stream: the forward and copy streams wait on that stream
        before they run (``tp_worker``, ``hiradix_cache``), so no host sync."""
        driver, handles = self._driver, []
        if self.keep_free:
            self._looked_at = -FREE_LOOK_S  # a fresh look
            if self.physical_free() < self.bytes_per_page:
                return False
        try:
            with torch.cuda.device(self.device):
                stream = torch.cuda.current_stream().cuda_stream
                for r, b in zip(self._ranges, self.page_bytes):
                    handle = _check(driver.cuMemCreate(b, self._prop, 0))
                    handles.append(handle)
                    _check(driver.cuMemMap(r.ptr + page * b, b, 0, handle, 0))
                    _check(driver.cuMemSetAccess(r.ptr + page * b, b, self._access, 1))
                    _check(driver.cuMemsetD8Async(r.ptr + page * b, 0, b, stream))
        except CudaVmmError as exc:
            if exc.err != driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise
            self._release(page, handles)
            return False
        self._handles[page] = handles
        self._seen_free -= self.bytes_per_page
        return True

    def _unmap_page(self, page: int) -> None:
        torch.cuda.synchronize(self.device)  # no kernel on any stream may still use it
        self._release(page, self._handles.pop(page))
        self._seen_free += self.bytes_per_page

    def _release(self, page: int, handles: list) -> None:
        driver = self._driver
        for r, b, handle in zip(self._ranges, self.page_bytes, handles):
            driver.cuMemUnmap(r.ptr + page * b, b)  # fails harmlessly where the map had not happened
            _check(driver.cuMemRelease(handle))

    def close(self) -> None:
        super().close()
        for r in self._ranges:
            self._driver.cuMemAddressFree(r.ptr, r.nbytes)
        self._ranges = []
