"""The file tier under the host pool (``--hicache-storage-backend file``).

Blocks of ``block_tokens`` consecutive tokens, counted from a sequence's
first token, are stored under the chained SHA-256 digest of the tokens up to
the block's end (the KV events' block digests, ``kv_events.chain_digests``),
so a block's key names its whole prefix and a server restarted on the same
directory finds what an earlier one stored.

- **Backups**: when a node's host copy is complete, and those of the nodes
  above it (a block may start there), the blocks that end in it go to
  files. The nodes holding them are pinned (``cache.pin_host``) until this
  tier's thread has read their host slots; the backend writes on a thread
  of its own.
- **Prefetch**: a request whose match stops short of blocks that are on
  file gets host slots for them, and this tier's thread reads the files into
  those slots. The request waits in the queue until ``poll`` puts the blocks
  into the tree as host-only nodes (the load-back then moves them to the
  device), or until ``PREFETCH_TIMEOUT_S`` has passed: it then runs with
  what is cached, and the prefetch still lands for later requests.
- **Misses**: a prefetch that ends short of what was on file (a block that
  failed to read, whatever the backend makes of it) puts what it read into
  the tree, and the block it stopped at is not prefetched again until it is
  backed up anew: admission asks for a prefetch at every step, and a failure
  that repeats would hold the request in the queue for good.
- **Tensor parallelism**: each rank reads and writes the files of its own KV
  heads, and its thread finishes when it does. What the tree does with the
  results is agreed over the ranks (``TPGroup.agree_mins``): how many blocks
  a prefetch starts from (the fewest any rank has on file), how many of the
  thread's tasks are taken back (they finish in submission order, so the
  same ones), how many tokens each read brought (the fewest), and when a
  prefetch has timed out (as soon as it has on any rank).

Corrupt or partial files are the backend's to detect (``storage/file_backend.py``):
they read as misses, and a prefetch stops at the first one.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from radixserve.mem_cache.allocator import page_aligned
from radixserve.mem_cache.host_pool import HostKVPool
from radixserve.mem_cache.kv_events.events import chain_digests
from radixserve.mem_cache.storage import HiCacheFile

logger = logging.getLogger(__name__)

PREFETCH_TIMEOUT_S = 5.0
PREFETCH_THRESHOLD = 64  # tokens on file worth waiting for
MISSES_KEPT = 4096  # blocks a prefetch stopped at, remembered (oldest forgotten first)
STORAGE_BLOCK_TOKENS = 64  # rounded up to whole pages


def storage_block_tokens(page_size: int) -> int:
    return page_aligned(STORAGE_BLOCK_TOKENS, page_size)


@dataclass(eq=False)
class Prefetch:
    """Blocks being read from file into host slots for ``tokens[start:]``."""

    tokens: list[int]
    start: int  # the first token to fetch (the match's end)
    host_slots: torch.Tensor  # for tokens[start:]
    blocks: list[tuple[bytes, int]]  # (key, the block's first token), in order
    timeout_at: float  # time.monotonic() after which a request stops waiting for it
    deadline: float  # what admission reads: timeout_at, or under TP inf until the ranks agree it passed
    generation: int
    fetched: int = 0  # tokens read so far, from start
    finished: bool = False


@dataclass(eq=False)
class _Backup:
    pin: object  # the host copies read, held until done (HiRadixCache.pin_host)
    blocks: list[tuple[bytes, list[int], torch.Tensor]] = field(default_factory=list)  # key, tokens, host slots
    generation: int = 0


class FileTier:
    def __init__(self, backend: HiCacheFile, host: HostKVPool, page_size: int, tp_group=None):
        self.backend = backend
        self.host = host
        self.block = storage_block_tokens(page_size)
        self.tp_group = tp_group if tp_group is not None and tp_group.size > 1 else None
        self._generation = 0  # a reset drops what is in flight
        self._tasks: queue.Queue = queue.Queue()
        self._done: deque = deque()  # finished by the thread, in submission order
        self._done_signal = threading.Event()
        self._in_flight = 0  # tasks handed to the thread and not yet polled back (alike on every rank)
        self._prefetches: dict[bytes, Prefetch] = {}  # by their first block's key
        self._misses: dict[bytes, None] = {}  # keys of blocks a prefetch stopped at, oldest first
        self._held = 0  # host slots of prefetches not yet in the tree
        self.prefetched_tokens = 0
        self._thread = threading.Thread(target=self._run, name="hicache-file-tier", daemon=True)
        self._thread.start()

    # -- the scheduler's side --------------------------------------------------------
    def backup(self, cache, node, n_tokens: int) -> None:
        """Queue for files the blocks that end in the last ``n_tokens`` up to
        the end of ``node`` (the host copies of its whole path complete)."""
        path = cache.host_path(node)
        if path is None:
            return
        tokens, slots = path
        b, end = self.block, len(tokens)
        first, last = (end - n_tokens) // b, end // b  # blocks [first, last) end in those tokens
        if last <= first:
            return
        digests = chain_digests(tokens[: last * b], b)
        blocks = [(digests[k], tokens[k * b : (k + 1) * b], slots[k * b : (k + 1) * b]) for k in range(first, last)]
        for key, _, _ in blocks:
            self._misses.pop(key, None)  # its file is written anew if it is not there: worth a read again
        self._submit(_Backup(cache.pin_host(node, end - first * b), blocks, self._generation))

    def prefetch(self, cache, key: list[int], matched: int) -> Prefetch | None:
        """Start reading the file blocks that continue a match of ``matched``
        tokens of ``key``, if enough are on file and the host has room."""
        b = self.block
        first = matched // b
        if (len(key) // b) * b - matched < PREFETCH_THRESHOLD:
            return None
        digests = chain_digests(key[: len(key) // b * b], b)
        running = self._prefetches.get(digests[first])
        if running is not None:
            return running
        on_file = self._agree([self._on_file(digests[first:])])[0]
        end = (first + on_file) * b
        if end - matched < PREFETCH_THRESHOLD:
            return None
        host_slots = cache.host_alloc(end - matched)
        if host_slots is None:
            return None
        timeout_at = time.monotonic() + PREFETCH_TIMEOUT_S
        p = Prefetch(list(key[:end]), matched, host_slots, [(digests[k], k * b) for k in range(first, first + on_file)],
                     timeout_at, timeout_at if self.tp_group is None else math.inf, self._generation)
        self._prefetches[digests[first]] = p
        self._held += len(host_slots)
        self._submit(p)
        return p

    def _on_file(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` are on file, up to one a prefetch stopped at."""
        n = self.backend.exists_prefix(keys)
        return next((i for i, key in enumerate(keys[:n]) if key in self._misses), n)

    def _missed(self, p: Prefetch) -> None:
        """Remember the block ``p`` stopped at, if it stopped short."""
        stopped = (p.start + p.fetched - p.blocks[0][1]) // self.block
        if stopped < len(p.blocks):
            self._misses[p.blocks[stopped][0]] = None
            if len(self._misses) > MISSES_KEPT:
                del self._misses[next(iter(self._misses))]

    def _submit(self, task) -> None:
        self._in_flight += 1
        self._tasks.put(task)

    def _agree(self, values: list[int]) -> list[int]:
        return values if self.tp_group is None else self.tp_group.agree_mins(values)

    def poll(self, cache) -> None:
        """Take back what the thread finished: unpin backed-up nodes, put
        prefetched blocks into the tree; under TP, what every rank finished,
        and time prefetches out together."""
        if not self._in_flight:
            return
        waiting = list(self._prefetches.values())
        now = time.monotonic()
        n, *alive = self._agree([len(self._done), *(int(now < p.timeout_at) for p in waiting)])
        for p, ok in zip(waiting, alive):
            if not ok:
                p.deadline = -math.inf
        tasks = [self._done.popleft() for _ in range(n)]
        reads = [t for t in tasks if isinstance(t, Prefetch)]
        for p, fetched in zip(reads, self._agree([p.fetched for p in reads]) if reads else []):
            p.fetched = fetched
        for task in tasks:
            self._in_flight -= 1
            if isinstance(task, _Backup):
                cache.unpin_host(task.pin)
                continue
            task.finished = True
            if task.generation != self._generation:
                continue  # its host slots went with the reset
            self._prefetches.pop(task.blocks[0][0], None)
            self._missed(task)
            self._held -= len(task.host_slots)
            cache.host.allocator.free(task.host_slots[task.fetched :])
            if task.fetched:
                got = cache.attach_host(task.tokens[: task.start + task.fetched], task.host_slots[: task.fetched],
                                        task.start)
                self.prefetched_tokens += got
                cache.stats.hicache_storage_prefetched += got

    def busy(self) -> bool:
        return self._in_flight > 0

    def wait(self, timeout: float) -> None:
        """Block until the thread finishes a task, for at most ``timeout`` s."""
        if not self._done:
            self._done_signal.wait(timeout)
        self._done_signal.clear()

    def host_slots_held(self) -> int:
        return self._held

    def drain(self) -> None:
        """Wait until the thread has finished every task handed to it."""
        self._tasks.join()

    def reset(self) -> None:
        """Drop what is in flight (the host pool is being cleared)."""
        self.drain()
        self._generation += 1
        self._prefetches.clear()
        self._held = 0

    def stats(self) -> dict[str, int]:
        return {f"hicache_storage_{k}": v for k, v in self.backend.stats().items()}

    def close(self) -> None:
        self._tasks.put(None)
        self._thread.join(timeout=30)
        self.backend.close()

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            task = self._tasks.get()
            try:
                if task is None:
                    return
                if isinstance(task, _Backup):
                    self._write(task)
                else:
                    self._read(task)
            except Exception:  # a failing disk costs hits, never the scheduler
                logger.exception("hicache file tier: %s failed", type(task).__name__)
            finally:
                if task is not None:
                    self._done.append(task)
                    self._done_signal.set()
                self._tasks.task_done()

    def _write(self, task: _Backup) -> None:
        for key, tokens, slots in task.blocks:
            if self.backend.exists_prefix([key]) == 0:
                self.backend.put_async(key, tokens, self.host.read(slots))

    def _read(self, p: Prefetch) -> None:
        b, shape = self.block, (self.block, *self.host.token_shape)
        for key, block_start in p.blocks:
            kv = self.backend.get(key, p.tokens[block_start : block_start + b])
            if kv is None or tuple(kv.shape) != shape or kv.dtype != self.host.dtype:
                return
            skip = max(p.start - block_start, 0)  # tokens of the first block already cached
            n = b - skip
            self.host.write(p.host_slots[p.fetched : p.fetched + n], kv[skip:])
            p.fetched += n
