"""The file storage tier (SGLang's ``--hicache-storage-backend file``): one
file per KV block under ``storage_dir/<namespace>/``, named by the block's key.

A block file reads, in order::

    magic b"RSKV" | version u16 | header_len u32 | blake2b-128(header + payload)
    header: msgpack {"dtype", "shape", "token_ids", "payload_len"}
    payload: the tensor's raw bytes (payload_len of them, then end of file)

A file is served only when all of it checks out: magic, version, digest,
length and the token ids the caller asks for. Anything else (a torn or
truncated file, flipped bits, another format version, a stale block under
the same key) is deleted, counted as ``corrupt`` and reported as a miss, so the
next ``put_async`` of that key can write it again. A path that cannot be read
at all (a directory, a FIFO or socket, EACCES, EIO: any OSError) is a miss
too, counted as ``unreadable`` and deleted. Either is logged once: what
cannot be deleted (a read-only directory, a directory with files in it) is
skipped by every later read and ``exists_prefix`` until a write succeeds there.

With ``max_bytes`` the files are capped: after each write the least recently
written or read files are deleted until the rest fit. The order survives a
restart (a hit refreshes a file's modification time; the directory is
indexed by it at start), and so does the cap's count of this process's own
files only: servers that share a directory each keep to the cap by
themselves. Temporary files (``.<uuid>.tmp``) that a crashed writer left are
deleted at start when they are over an hour old (only with a cap: without
one the directory is never scanned).
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import logging
import os
import re
import stat
import struct
import threading
import time
import uuid

import msgpack
import torch

logger = logging.getLogger(__name__)

MAGIC = b"RSKV"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<4sHI16s")  # magic, version, header_len, digest
_MAX_HEADER_LEN = 1 << 24
_KEY_LEN = 32
STALE_TMP_S = 3600  # a temporary file this old is a crashed writer's
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class _Corrupt(Exception):
    """A block file that must not be served."""


def _open_without_waiting(path: str, flags: int) -> int:
    # Opening a FIFO for reading waits for a writer, which may never come. O_NONBLOCK
    # does not change how a regular file reads.
    return os.open(path, flags | os.O_NONBLOCK)


def safe_namespace(namespace: str) -> str:
    """``namespace`` as one directory name: every character outside
    ``[A-Za-z0-9._-]`` becomes ``_``, so no separator (and so no ``..``
    component) survives. Names that are only dots are refused."""
    name = _UNSAFE.sub("_", namespace)
    if not name.strip("."):
        raise ValueError(f"namespace {namespace!r} names no directory")
    return name


def _digest(header: bytes, payload: bytes | bytearray) -> bytes:
    h = hashlib.blake2b(header, digest_size=16)
    h.update(payload)
    return h.digest()


def _tensor_bytes(kv: torch.Tensor) -> bytearray:
    """The raw bytes of a contiguous CPU tensor, any dtype (torch tensors do
    not expose the buffer protocol, so copy into one that does)."""
    flat = kv.reshape(-1).view(torch.uint8)
    buf = bytearray(flat.numel())
    if buf:
        torch.frombuffer(buf, dtype=torch.uint8).copy_(flat)
    return buf


def encode_block(token_ids: list[int], kv: torch.Tensor) -> tuple[bytes, bytearray]:
    """The file's bytes as (prefix + header, payload)."""
    payload = _tensor_bytes(kv)
    header = msgpack.packb(
        {
            "dtype": str(kv.dtype).removeprefix("torch."),
            "shape": list(kv.shape),
            "token_ids": list(token_ids),
            "payload_len": len(payload),
        }
    )
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, len(header), _digest(header, payload))
    return prefix + header, payload


def _read_exact(f, n: int) -> bytearray:
    buf = bytearray(n)
    if f.readinto(buf) != n:
        raise _Corrupt("short file")
    return buf


def decode_block(f, token_ids: list[int]) -> torch.Tensor:
    """The KV tensor of the open block file ``f``; raises _Corrupt unless the
    whole file checks out and stores exactly ``token_ids``."""
    size = os.fstat(f.fileno()).st_size
    magic, version, header_len, digest = _PREFIX.unpack(_read_exact(f, _PREFIX.size))
    if magic != MAGIC or version != FORMAT_VERSION or header_len > _MAX_HEADER_LEN:
        raise _Corrupt(f"magic {magic!r}, version {version}, header_len {header_len}")
    header_bytes = _read_exact(f, header_len)
    try:
        header = msgpack.unpackb(header_bytes)
        dtype, shape = getattr(torch, header["dtype"]), header["shape"]
        stored_ids, payload_len = header["token_ids"], header["payload_len"]
    except (AttributeError, KeyError, TypeError, ValueError, msgpack.UnpackException) as e:
        raise _Corrupt(f"bad header: {e}") from e
    # checked before reading, so a damaged length never sizes an allocation
    if not isinstance(payload_len, int) or size != _PREFIX.size + header_len + payload_len:
        raise _Corrupt(f"file is {size} bytes, its header says otherwise")
    payload = _read_exact(f, payload_len)
    if _digest(header_bytes, payload) != digest:
        raise _Corrupt("checksum mismatch")
    if stored_ids != list(token_ids):
        raise _Corrupt("the file stores other token ids")
    try:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{header['dtype']!r} is not a dtype")
        if not payload:
            return torch.empty(shape, dtype=dtype)
        # frombuffer shares (and keeps alive) the bytearray this call owns
        return torch.frombuffer(payload, dtype=dtype).reshape(shape)
    except (TypeError, ValueError, RuntimeError) as e:
        raise _Corrupt(f"bad dtype or shape: {e}") from e


class HiCacheFile:
    """KV blocks in files under storage_dir/<namespace>/, one file per block.

    Keys are 32-byte digests; a block lives at ``<hex[:2]>/<hex>.kv``. Reads run
    on the caller's thread; writes are queued and done by one background
    writer thread, which writes a temporary file in the same directory and
    renames it onto the final name, so the final name only ever holds a
    complete file. Every public method is safe to call from any thread.
    """

    def __init__(self, storage_dir: str, namespace: str, max_pending_writes: int = 256,
                 max_bytes: int | None = None):
        if max_pending_writes < 1:
            raise ValueError(f"max_pending_writes must be at least 1, got {max_pending_writes}")
        if max_bytes is not None and max_bytes <= 0:
            raise ValueError(f"max_bytes must be positive, got {max_bytes}")
        self.root = os.path.join(storage_dir, safe_namespace(namespace))
        os.makedirs(self.root, exist_ok=True)
        self.max_pending_writes = max_pending_writes
        # With a size cap: every block file, least recently written or read
        # first, with its size (read from the directory at start, oldest
        # modification first; a hit refreshes a file's modification time).
        self.max_bytes = max_bytes
        self._lru: collections.OrderedDict[str, int] = collections.OrderedDict()
        self._bytes = 0
        # _cond's lock guards the queue, the stats, the closing flag, and the
        # rename/unlink of final names (so a reader that discards a bad file
        # cannot remove a good one the writer just put in its place)
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[bytes, list[int], torch.Tensor]] = collections.deque()
        self._queued: set[bytes] = set()  # queued or being written
        self._closing = False
        # Paths that failed to read and could not be deleted: never read again (a read of them fails the
        # same way), until a write succeeds there. Changed under _cond; a set's `in` needs no lock.
        self._skipped: set[str] = set()
        self._stats = dict.fromkeys(
            ("writes", "write_bytes", "dropped_writes", "reads", "read_hits", "read_bytes", "corrupt", "unreadable",
             "evicted"), 0
        )
        if max_bytes is not None:
            self._scan()
        self._writer = threading.Thread(target=self._writer_loop, name="hicache-file-writer", daemon=True)
        self._writer.start()

    def path(self, key: bytes) -> str:
        """Where the block of ``key`` lives (whether or not it exists)."""
        if len(key) != _KEY_LEN:
            raise ValueError(f"a key is {_KEY_LEN} bytes, got {len(key)}")
        name = key.hex()
        return os.path.join(self.root, name[:2], name + ".kv")

    def exists_prefix(self, keys: list[bytes]) -> int:
        """How many leading ``keys`` have a file (the count stops at the first
        missing one, or one skipped as unreadable). A file counted here may
        still fail its checks in get."""
        for i, key in enumerate(keys):
            path = self.path(key)
            if path in self._skipped or not os.path.exists(path):
                return i
        return len(keys)

    def get(self, key: bytes, token_ids: list[int]) -> torch.Tensor | None:
        """The block's KV tensor (CPU, owned by the caller), or None when there
        is no valid file for ``key`` holding exactly ``token_ids``."""
        path = self.path(key)
        self._count(reads=1)
        if path in self._skipped:
            return None
        seen = None
        try:
            seen = os.stat(path)
            if not stat.S_ISREG(seen.st_mode):
                raise OSError(f"not a regular file (mode {stat.filemode(seen.st_mode)})")
            with open(path, "rb", opener=_open_without_waiting) as f:
                try:
                    kv = decode_block(f, token_ids)
                except _Corrupt as e:
                    logger.warning("HiCacheFile: discarding %s: %s", path, e)
                    self._discard(path, os.fstat(f.fileno()), "corrupt")
                    return None
        except FileNotFoundError:
            return None
        except OSError as e:  # any errno: a miss, not the caller's crash; deleted or skipped, so read once
            logger.warning("HiCacheFile: cannot read %s, a miss: %s", path, e)
            self._discard(path, seen, "unreadable")
            return None
        self._count(read_hits=1, read_bytes=kv.numel() * kv.element_size())
        if self.max_bytes is not None:
            self._used(path)
        return kv

    def put_async(self, key: bytes, token_ids: list[int], kv: torch.Tensor) -> bool:
        """Queue ``kv`` (a contiguous CPU tensor the backend owns from now on)
        to be written under ``key``. True when the block is queued or already
        stored; False, counted in ``dropped_writes``, when max_pending_writes
        are queued or the backend is closed. Never waits for the writer."""
        if kv.device.type != "cpu" or not kv.is_contiguous():
            raise ValueError("put_async takes a contiguous CPU tensor")
        path = self.path(key)
        if os.path.exists(path):
            return True
        with self._cond:
            if key in self._queued:
                return True
            if self._closing or len(self._queued) >= self.max_pending_writes:
                self._stats["dropped_writes"] += 1
                return False
            self._queued.add(key)
            self._queue.append((key, list(token_ids), kv))
            self._cond.notify_all()
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write is on disk (or has failed and been
        counted as dropped); False when ``timeout`` seconds pass first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queued, timeout)

    def close(self) -> None:
        """Finish the queued writes and stop the writer thread. Idempotent;
        put_async after close drops."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._writer.join()

    def stats(self) -> dict[str, int]:
        """Counters since start: writes and write_bytes (payload bytes) done,
        dropped_writes, reads (get calls), read_hits and read_bytes (payload
        bytes served), corrupt (files discarded), unreadable (paths that
        failed to read, each counted once), evicted (files deleted for the
        size cap), pending (queued now), and with a cap, bytes (on disk now)."""
        with self._cond:
            extra = {"bytes": self._bytes} if self.max_bytes is not None else {}
            return {**self._stats, "pending": len(self._queued), **extra}

    def _count(self, **deltas: int) -> None:
        with self._cond:
            for name, delta in deltas.items():
                self._stats[name] += delta

    def _discard(self, path: str, seen: os.stat_result | None, counter: str) -> None:
        """Count, under ``counter``, a path that must not be read again, and
        delete it; what cannot be deleted, or could not even be looked up
        (``seen`` None), is skipped from now on."""
        with self._cond:
            self._stats[counter] += 1
            if seen is None or not self._delete(path, seen):
                self._skipped.add(path)
                self._bytes -= self._lru.pop(path, 0)

    def _delete(self, path: str, seen: os.stat_result) -> bool:
        """Under ``_cond``: delete ``path`` if it still holds what ``seen``
        found there (a directory only if empty: what is in it is not ours).
        False when it cannot be deleted; True once it is gone, or holds a new
        file the writer has renamed onto it since (left alone)."""
        try:
            now = os.stat(path)
            if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino):
                return True
            try:
                os.unlink(path)
            except IsADirectoryError:
                os.rmdir(path)
        except FileNotFoundError:
            pass
        except OSError as e:  # a read-only directory, a directory with files in it
            logger.debug("HiCacheFile: cannot delete %s: %s", path, e)
            return False
        self._bytes -= self._lru.pop(path, 0)
        return True

    # -- the size cap ------------------------------------------------------------
    def _scan(self) -> None:
        """Index the block files already there, oldest first; delete temporary
        files a crashed writer left (older than an hour: a live writer of
        another process sharing the directory may own a newer one)."""
        found = []
        for entry in os.scandir(self.root):
            if not entry.is_dir():
                continue
            for f in os.scandir(entry.path):
                try:
                    st = f.stat()
                except OSError:
                    continue
                if f.name.endswith(".kv") and stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime, f.path, st.st_size))
                elif f.name.endswith(".tmp") and time.time() - st.st_mtime > STALE_TMP_S:
                    with contextlib.suppress(OSError):
                        os.unlink(f.path)
        with self._cond:
            for _, path, size in sorted(found):
                self._add(path, size)

    def _add(self, path: str, size: int) -> None:
        """Index a new file (under ``_cond``), then delete the least recently
        used others while the files exceed ``max_bytes``."""
        self._bytes += size - self._lru.pop(path, 0)
        self._lru[path] = size
        while self._bytes > self.max_bytes and len(self._lru) > 1:
            victim, victim_size = self._lru.popitem(last=False)
            self._bytes -= victim_size
            self._stats["evicted"] += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(victim)

    def _used(self, path: str) -> None:
        """A hit: the file becomes the most recently used, on disk too."""
        with self._cond:
            if path in self._lru:
                self._lru.move_to_end(path)
        with contextlib.suppress(OSError):
            os.utime(path)

    def _writer_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing)
                if not self._queue:
                    return
                key, token_ids, kv = self._queue.popleft()
            try:
                self._write(self.path(key), token_ids, kv)
                self._count(writes=1, write_bytes=kv.numel() * kv.element_size())
            except Exception:
                logger.exception("HiCacheFile: writing block %s failed", key.hex())
                self._count(dropped_writes=1)
            finally:
                with self._cond:
                    self._queued.discard(key)
                    self._cond.notify_all()

    def _write(self, path: str, token_ids: list[int], kv: torch.Tensor) -> None:
        """Write one block file: a uniquely named temporary file beside
        ``path``, then an atomic rename onto it (no fsync: a block lost in a
        crash is only a cache miss, and a torn one fails its checksum)."""
        head, payload = encode_block(token_ids, kv)
        directory = os.path.dirname(path)
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{uuid.uuid4().hex}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(head)
                f.write(payload)
            with self._cond:
                os.replace(tmp, path)
                self._skipped.discard(path)
                if self.max_bytes is not None:
                    self._add(path, len(head) + len(payload))
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
