"""glibc malloc settings for CPU inference.

A CPU forward allocates and frees multi-MB activations in every layer. With
glibc's defaults, any block over 128 KiB is a fresh ``mmap`` and its free an
``munmap``, so every such tensor pays page faults on first touch: on the
2-core CPU W6 ran 13% faster once freed blocks were kept for reuse (the
effect of tcmalloc or jemalloc, which CPU inference guides preload).
:func:`reuse_freed_memory` asks glibc, through ``mallopt``, to serve blocks up
to 32 MiB from its heap (glibc's own ceiling for its moving threshold) and to
keep freed memory instead of trimming it. Larger blocks stay mmapped: served
from the heap (the threshold was 1 GiB until a soak showed it), prefills'
activations of every size fragment it, and its free memory grew without end
while the memory in use stayed flat; W6 runs as fast either way. Until
2026-12-07 the trim threshold reached glibc as 0 (a value wider than
mallopt's int), so the heap was trimmed at every free at its top and
refaulted at the next allocation: about 1.1 million page faults in a W6 run,
24,000 since, and the run 9% faster. The settings are process-wide: the
offline Engine restores glibc's defaults when it shuts down; the Engine and
a server's scheduler process give the heap's free pages back now and then
(:class:`HeapTrimmer`). Off glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import sys
import time

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# mallopt takes an int: 2**31 - 1 is the highest trim threshold it can be given (a value of 1 << 62 was
# passed as size_t and read as its low 32 bits, 0, which trimmed the heap on every free at its top)
TUNED = {M_MMAP_THRESHOLD: 32 << 20, M_TRIM_THRESHOLD: 2**31 - 1}
GLIBC_DEFAULTS = {M_MMAP_THRESHOLD: 128 * 1024, M_TRIM_THRESHOLD: 128 * 1024}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, looked up once: ``find_library`` runs ``ldconfig -p`` in
    a child process, which a stats request must not pay for every time."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def _libc_function(name: str):
    return getattr(_libc(), name, None)


@functools.cache
def _mallopt():
    mallopt = _libc_function("mallopt")
    if mallopt is None:
        return None
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int  # int mallopt(int, int)
    return mallopt


def reuse_freed_memory(enable: bool = True) -> bool:
    """Apply (``enable``) or undo the settings above; False where malloc is not glibc's."""
    mallopt = _mallopt()
    if mallopt is None:
        return False
    ok = all(mallopt(param, value) == 1 for param, value in (TUNED if enable else GLIBC_DEFAULTS).items())
    logger.debug("glibc malloc: %s freed-memory reuse (%s)", "enabled" if enable else "default", "ok" if ok else "failed")
    return ok


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


class HeapTrimmer:
    """Gives the heap's free pages back to the system (``malloc_trim``) when
    the process goes idle, and every ``interval_s`` while it works. With
    freed blocks kept for reuse (``reuse_freed_memory``), glibc never returns
    them by itself, and a long-running scheduler's heap keeps the high-water
    mark of every batch shape it has seen, fragmented: in a soak of mixed
    requests the heap's free memory grew by 830 MB over 1,800 requests while
    the memory in use stayed flat (benchmarks/README.md). A trim costs about
    0.1 s per GB it returns and 2 ms when there is little; the pages it
    returns fault in again once when next used. Off glibc it does nothing."""

    def __init__(self, interval_s: float = 30.0):
        self.interval_s = interval_s
        self._next = time.monotonic() + interval_s
        self._trim = _libc_function("malloc_trim")
        self.returned_bytes = 0  # resident memory the trims gave back

    def idle(self) -> None:
        self._run()

    def busy(self) -> None:
        if time.monotonic() >= self._next:
            self._run()

    def _run(self) -> None:
        self._next = time.monotonic() + self.interval_s
        if self._trim is None:
            return
        before = _rss_bytes()
        self._trim(0)
        self.returned_bytes += max(before - _rss_bytes(), 0)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def heap_figures() -> dict[str, int]:
    """This process's resident bytes, the blocks Python's own allocator has
    handed out (small objects: ``python_blocks``), and glibc's heap: bytes in
    use by allocations (``malloc_in_use_bytes``, including mmapped blocks)
    and bytes free but kept (``malloc_free_bytes``). A leak of objects grows
    the first two; a fragmented heap, the last. Off glibc (before 2.33), no heap figures."""
    out = {"rss_bytes": _rss_bytes(), "python_blocks": sys.getallocatedblocks()}
    mallinfo2 = _libc_function("mallinfo2")
    if mallinfo2 is None:
        return out
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    out["malloc_in_use_bytes"] = info.uordblks + info.hblkhd
    out["malloc_free_bytes"] = info.fordblks
    return out
