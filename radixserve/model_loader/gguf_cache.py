"""The cache of converted GGUF files (``gguf_loader`` converts them).

The converted folder of a ``.gguf`` file lives under ``$RADIXSERVE_CACHE_DIR``
(default ``~/.cache/radixserve``), named by a hash of the file's content, so
copies of one file (every virtual environment's copy of a packaged model)
share one conversion; it appears by an atomic rename, so a crash never leaves
a half-written one. A small record per file (its path, size and mtime)
remembers the hash, so a file is hashed once, not at every load. A conversion
no existing file maps to any more (its files deleted or changed) is removed
the next time a new file is seen: the cache holds what its files still need.
A cache this process cannot write (a read-only mount shared by servers) still
serves the conversions it holds, found by content; nothing is written.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

from radixserve.cache_dir import CACHE_ENV, cache_root
from radixserve.model_loader import gguf_loader

logger = logging.getLogger(__name__)

MARKER_FILE = "radixserve_gguf.json"  # written last: a folder with it is a finished conversion
SOURCES_DIR = ".sources"  # one record per file seen: its path, size, mtime and content key
LOCK_FILE = ".lock"
HASH_CHUNK_BYTES = 8 << 20
# An unfinished conversion untouched this long was left by a killed process
# (a converter writes a shard at least every few minutes).
STALE_CONVERSION_S = 24 * 3600


def _source_identity(gguf_path: str) -> dict[str, Any]:
    path = os.path.abspath(gguf_path)
    stat = os.stat(path)
    return {"source": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def content_key(gguf_path: str) -> str:
    """16 hex digits naming a conversion: the file's bytes and CONVERTER_VERSION."""
    digest = hashlib.sha256(f"radixserve-gguf-v{gguf_loader.CONVERTER_VERSION}\n".encode())
    with open(gguf_path, "rb") as f:
        while chunk := f.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()[:16]


def converted_dir(gguf_path: str, root: str | None = None) -> str:
    """The cache folder for ``gguf_path`` (it need not exist yet).

    A file not seen before (a new path, size or mtime) is hashed and recorded
    by one process at a time (the ranks of a tensor-parallel server hash it
    once), then conversions no existing file maps to are removed (``prune``)."""
    cache = os.path.join(root or cache_root(), "gguf")
    identity = _source_identity(gguf_path)
    record = _record_path(cache, identity)
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    if not _writable(cache):  # a shared, read-only cache still serves what it holds
        key = _known_key(record, identity) or content_key(gguf_path)
        return os.path.join(cache, _folder_for_key(cache, key) or f"{stem}-{key}")
    with _cache_lock(cache, fcntl.LOCK_SH):  # no prune runs between the record and the lookup
        key = _known_key(record, identity)
        folder = key and _folder_for_key(cache, key)
    if key is None:
        with _cache_lock(cache, fcntl.LOCK_EX):
            key = _known_key(record, identity)
            if key is None:
                key = content_key(gguf_path)
                _write_json_atomically(record, {**identity, "key": key})
                _prune_locked(cache)
            folder = _folder_for_key(cache, key)
    return os.path.join(cache, folder or f"{stem}-{key}")


def _writable(cache: str) -> bool:
    """Whether this process can keep records and conversions in ``cache``
    (creating it and its lock file if need be)."""
    sources = os.path.join(cache, SOURCES_DIR)
    try:
        os.makedirs(sources, exist_ok=True)
        open(os.path.join(cache, LOCK_FILE), "a").close()
    except OSError:
        return False
    return os.access(cache, os.W_OK) and os.access(sources, os.W_OK)  # a read-only mount, an immutable folder


def prune(cache: str) -> list[str]:
    """Remove what no existing file needs: records whose file is gone or changed,
    then finished conversions that no record names and whose own file is gone
    or changed (the path-keyed folders of the layout before this one among
    them), and conversions left by a killed process. Returns the finished
    folders removed."""
    with _cache_lock(cache, fcntl.LOCK_EX):
        return _prune_locked(cache)


def _prune_locked(cache: str) -> list[str]:
    live, removed = set(), []
    sources = os.path.join(cache, SOURCES_DIR)
    for name in os.listdir(sources):
        if name.startswith("."):
            continue  # a record being written
        path = os.path.join(sources, name)
        known = _read_json(path)
        try:
            current = _source_identity(known["source"]) if known else None
        except (OSError, KeyError, TypeError):
            current = None
        key = _known_key(path, current) if current else None
        if key is None:
            os.remove(path)
        else:
            live.add(key)
    for name in os.listdir(cache):
        folder = os.path.join(cache, name)
        if name.startswith(".tmp-") and os.path.isdir(folder) and _age_s(folder) > STALE_CONVERSION_S:
            shutil.rmtree(folder, ignore_errors=True)  # a conversion whose process was killed
            continue
        if name.startswith(".") or not is_converted(folder) or name.rsplit("-", 1)[-1] in live:
            continue  # records, the lock, unfinished conversions, and what is in use
        if _source_unchanged(folder):
            continue  # its file is still there as converted: another radixserve (an older layout) may use it
        shutil.rmtree(folder, ignore_errors=True)
        removed.append(folder)
    if removed:
        logger.info("removed %d GGUF conversions no existing file needs: %s", len(removed), removed)
    return removed


def _known_key(record: str, identity: dict[str, Any]) -> str | None:
    """The content key ``record`` holds, if it describes the file as it is now."""
    known = _read_json(record)
    if known is None or any(known.get(k) != v for k, v in identity.items()):
        return None
    key = known.get("key")
    return key if isinstance(key, str) else None


def _source_unchanged(folder: str) -> bool:
    """Whether the file ``folder`` was converted from is still there, unchanged (its marker says which)."""
    made_from = _read_json(os.path.join(folder, MARKER_FILE)) or {}
    try:
        current = _source_identity(made_from["source"])
    except (OSError, KeyError, TypeError):
        return False
    return all(made_from.get(k) == v for k, v in current.items())


def _age_s(path: str) -> float:
    return time.time() - os.stat(path).st_mtime


def _record_path(cache: str, identity: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(cache, SOURCES_DIR, f"{digest}.json")


def _folder_for_key(cache: str, key: str) -> str | None:
    """An existing conversion of the same bytes, whatever file name it was made from."""
    if not os.path.isdir(cache):
        return None
    return next((name for name in sorted(os.listdir(cache))
                 if not name.startswith(".") and name.endswith(f"-{key}") and is_converted(os.path.join(cache, name))),
                None)


def _read_json(path: str) -> dict[str, Any] | None:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_atomically(path: str, data: dict[str, Any]) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=os.path.dirname(path))
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)


@contextlib.contextmanager
def _cache_lock(cache: str, mode: int) -> Iterator[None]:
    """Records and lookups share the cache; a prune has it alone."""
    with open(os.path.join(cache, LOCK_FILE), "a") as f:
        _flock(f, mode)
        yield


def is_converted(folder: str) -> bool:
    """True when ``folder`` is a finished conversion (its marker is written last)."""
    return os.path.isfile(os.path.join(folder, MARKER_FILE))


def load_gguf(gguf_path: str, root: str | None = None) -> str:
    """Return the converted HF-style folder for ``gguf_path``, converting on a cache miss.

    Processes that miss at once (the ranks of a tensor-parallel server) take
    turns on a lock of the GGUF file itself: one converts, the others then
    find its folder, so only one of them holds the whole model in memory."""
    final = converted_dir(gguf_path, root)
    if is_converted(final):
        return final
    if not _writable(os.path.dirname(final)):
        raise PermissionError(f"{gguf_path} is not converted yet and the GGUF cache {os.path.dirname(final)} cannot "
                              f"be written: point {CACHE_ENV} at a writable folder")
    with open(gguf_path, "rb") as source:
        _lock_if_possible(source)  # released when the file closes
        if not is_converted(final):
            _convert_into(gguf_path, final)
    return final


def _lock_if_possible(file) -> None:
    """The conversion's turn: an exclusive lock on the GGUF file itself (apart
    from the cache's lock, so that tests can hold ranks at this point)."""
    _flock(file, fcntl.LOCK_EX)


def _flock(file, mode: int) -> None:
    with contextlib.suppress(OSError):  # a file system without locks: concurrent conversions still end well (_publish)
        fcntl.flock(file, mode)


def _convert_into(gguf_path: str, final: str) -> None:
    parent = os.path.dirname(final)
    tmp = tempfile.mkdtemp(prefix=f".tmp-{os.path.basename(final)}-", dir=parent)
    try:
        start = time.perf_counter()
        logger.info("converting %s into %s", gguf_path, final)
        gguf_loader.convert_gguf(gguf_path, tmp)
        with open(os.path.join(tmp, MARKER_FILE), "w") as f:
            json.dump({**_source_identity(gguf_path), "converter_version": gguf_loader.CONVERTER_VERSION}, f, indent=2)
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; the cache is readable like any model folder
        _publish(tmp, final)
        logger.info("converted %s in %.1f s", gguf_path, time.perf_counter() - start)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a rename; cleans up after errors


def _publish(tmp: str, final: str) -> None:
    """Move a finished conversion into place; a concurrent winner is kept."""
    if os.path.isdir(final) and not is_converted(final):
        shutil.rmtree(final)  # not ours: a folder without a marker is unfinished
    try:
        os.rename(tmp, final)
    except OSError:
        if not is_converted(final):
            raise
