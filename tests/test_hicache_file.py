"""The file storage tier (radixserve.mem_cache.storage.HiCacheFile): blocks
survive a restart, damaged or mismatched files are never served, and the
write queue is bounded without ever blocking the caller; a block no read
succeeds on is a miss once, not on every retry. Under the two-tier tree: a
backup's pin on the host copies it reads is released in full, and a request
over a block that fails to read runs within the prefetch bound."""

import errno
import hashlib
import logging
import os
import shutil
import stat
import threading
import time

import pytest
import torch

from radixserve.mem_cache.storage import HiCacheFile, file_backend
from radixserve.mem_cache.storage.file_backend import FORMAT_VERSION, MAGIC
from test_hicache import llama, tiers_off  # noqa: F401  (fixtures)

# [layers, k/v, block_tokens, kv_heads, head_dim]
SHAPE = (2, 2, 4, 2, 8)


def key_of(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def ids_of(i: int) -> list[int]:
    return list(range(4 * i, 4 * i + 4))


def kv_of(i: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(i)).to(dtype)


@pytest.fixture
def cache(tmp_path):
    c = HiCacheFile(str(tmp_path), "model-bf16-L2-H2-D8-tp0of1-b4")
    yield c
    c.close()


def put_and_flush(cache: HiCacheFile, *blocks: int, dtype=torch.float32) -> None:
    for i in blocks:
        assert cache.put_async(key_of(i), ids_of(i), kv_of(i, dtype))
    assert cache.flush()


def rewrite(cache: HiCacheFile, i: int, edit) -> None:
    """Replace block i's file with edit(its bytes)."""
    path = cache.path(key_of(i))
    with open(path, "rb") as f:
        data = bytearray(f.read())
    with open(path, "wb") as f:
        f.write(edit(data))


def flip(offset: int):
    def edit(data: bytearray) -> bytearray:
        data[offset] ^= 0x01
        return data

    return edit


def assert_discarded(cache: HiCacheFile, i: int) -> None:
    """Block i is a miss, its file is gone and the discard was counted."""
    corrupt = cache.stats()["corrupt"]
    assert cache.get(key_of(i), ids_of(i)) is None
    assert not os.path.exists(cache.path(key_of(i)))
    assert cache.stats()["corrupt"] == corrupt + 1
    assert cache.exists_prefix([key_of(i)]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip(cache, dtype):
    put_and_flush(cache, 0, dtype=dtype)
    got = cache.get(key_of(0), ids_of(0))
    assert got.dtype == dtype and got.shape == SHAPE
    assert torch.equal(got, kv_of(0, dtype))
    got.zero_()  # the caller owns what get returns
    assert torch.equal(cache.get(key_of(0), ids_of(0)), kv_of(0, dtype))
    s = cache.stats()
    nbytes = kv_of(0, dtype).numel() * dtype.itemsize
    assert (s["writes"], s["write_bytes"], s["reads"], s["read_hits"]) == (1, nbytes, 2, 2)
    assert (s["read_bytes"], s["pending"], s["corrupt"]) == (2 * nbytes, 0, 0)
    name = key_of(0).hex()
    assert cache.path(key_of(0)).endswith(os.path.join(name[:2], name + ".kv"))


def test_missing_block_is_a_miss(cache):
    assert cache.get(key_of(0), ids_of(0)) is None
    assert cache.stats()["reads"] == 1 and cache.stats()["read_hits"] == 0


def test_exists_prefix_stops_at_first_gap(cache):
    put_and_flush(cache, 0, 1, 3)
    keys = [key_of(i) for i in range(4)]
    assert cache.exists_prefix(keys) == 2
    assert cache.exists_prefix(keys[:2]) == 2
    assert cache.exists_prefix(keys[2:]) == 0
    assert cache.exists_prefix([]) == 0


def test_restart_reads_what_was_written(tmp_path):
    first = HiCacheFile(str(tmp_path), "ns")
    put_and_flush(first, 0, 1, dtype=torch.bfloat16)
    first.close()
    second = HiCacheFile(str(tmp_path), "ns")
    assert second.exists_prefix([key_of(0), key_of(1)]) == 2
    assert torch.equal(second.get(key_of(1), ids_of(1)), kv_of(1, torch.bfloat16))
    second.close()


def test_truncated_file_is_discarded(cache):
    put_and_flush(cache, 0)
    rewrite(cache, 0, lambda data: data[: len(data) - 7])
    assert_discarded(cache, 0)


def test_truncated_inside_header_is_discarded(cache):
    put_and_flush(cache, 0)
    rewrite(cache, 0, lambda data: data[:20])
    assert_discarded(cache, 0)


def test_flipped_payload_byte_is_discarded(cache):
    put_and_flush(cache, 0)
    rewrite(cache, 0, flip(-3))
    assert_discarded(cache, 0)


@pytest.mark.parametrize("offset", [3, 8, 12, 26, 40])  # magic, header_len, digest, header
def test_flipped_header_byte_is_discarded(cache, offset):
    put_and_flush(cache, 0)
    rewrite(cache, 0, flip(offset))
    assert_discarded(cache, 0)


def test_other_format_version_is_discarded(cache):
    put_and_flush(cache, 0)
    other = (FORMAT_VERSION + 1).to_bytes(2, "little")
    rewrite(cache, 0, lambda data: data[: len(MAGIC)] + other + data[len(MAGIC) + 2 :])
    assert_discarded(cache, 0)


def test_other_token_ids_are_not_served(cache):
    put_and_flush(cache, 0)
    corrupt = cache.stats()["corrupt"]
    assert cache.get(key_of(0), ids_of(1)) is None
    assert cache.stats()["corrupt"] == corrupt + 1
    # a stale block is deleted, so the right one can be stored again
    assert cache.exists_prefix([key_of(0)]) == 0
    put_and_flush(cache, 0)
    assert torch.equal(cache.get(key_of(0), ids_of(0)), kv_of(0))


def test_put_of_stored_or_queued_key_is_skipped(cache):
    put_and_flush(cache, 0)
    assert cache.put_async(key_of(0), ids_of(0), torch.zeros(SHAPE))
    assert cache.flush()
    assert cache.stats()["writes"] == 1
    assert torch.equal(cache.get(key_of(0), ids_of(0)), kv_of(0))


def blocked_writer(cache: HiCacheFile) -> tuple[threading.Event, threading.Event]:
    """Make the writer wait for `release` before each write; `started` is set
    when it holds a block."""
    started, release = threading.Event(), threading.Event()
    write = cache._write

    def wait_then_write(*args):
        started.set()
        assert release.wait(10)
        write(*args)

    cache._write = wait_then_write
    return started, release


def test_pending_cap_drops_without_blocking(tmp_path):
    cache = HiCacheFile(str(tmp_path), "ns", max_pending_writes=2)
    started, release = blocked_writer(cache)
    assert cache.put_async(key_of(0), ids_of(0), kv_of(0))
    assert started.wait(10)  # block 0 is being written, and still pending
    assert cache.put_async(key_of(1), ids_of(1), kv_of(1))
    assert cache.put_async(key_of(1), ids_of(1), kv_of(1))  # already queued
    assert not cache.put_async(key_of(2), ids_of(2), kv_of(2))
    assert cache.stats()["dropped_writes"] == 1 and cache.stats()["pending"] == 2
    assert not cache.flush(timeout=0.01)
    release.set()
    assert cache.flush()
    assert cache.exists_prefix([key_of(i) for i in range(3)]) == 2
    assert cache.stats()["writes"] == 2 and cache.stats()["pending"] == 0
    cache.close()


def test_failed_write_is_dropped_and_leaves_no_file(cache):
    def fail(path, token_ids, kv):
        raise OSError("disk full")

    cache._write = fail
    assert cache.put_async(key_of(0), ids_of(0), kv_of(0))
    assert cache.flush()
    assert cache.stats()["dropped_writes"] == 1 and cache.stats()["writes"] == 0
    assert cache.exists_prefix([key_of(0)]) == 0


def test_namespaces_are_isolated(tmp_path):
    a, b = HiCacheFile(str(tmp_path), "model-a"), HiCacheFile(str(tmp_path), "model-b")
    put_and_flush(a, 0)
    assert b.exists_prefix([key_of(0)]) == 0
    assert b.get(key_of(0), ids_of(0)) is None
    assert a.exists_prefix([key_of(0)]) == 1
    a.close()
    b.close()


@pytest.mark.parametrize("namespace", ["../escape", "a/../../b", "/abs/path", "..\\win"])
def test_namespace_stays_inside_storage_dir(tmp_path, namespace):
    store = tmp_path / "store"
    cache = HiCacheFile(str(store), namespace)
    put_and_flush(cache, 0)
    cache.close()
    assert os.path.dirname(cache.root) == str(store)
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert files and all(store in p.parents for p in files)


@pytest.mark.parametrize("namespace", ["", ".", ".."])
def test_namespace_naming_no_directory_is_refused(tmp_path, namespace):
    with pytest.raises(ValueError):
        HiCacheFile(str(tmp_path), namespace)


def test_close_flushes_and_is_idempotent(tmp_path):
    cache = HiCacheFile(str(tmp_path), "ns")
    started, release = blocked_writer(cache)
    for i in range(3):
        assert cache.put_async(key_of(i), ids_of(i), kv_of(i))
    assert started.wait(10)
    release.set()
    cache.close()
    assert cache.stats()["writes"] == 3 and cache.stats()["pending"] == 0
    cache.close()
    assert not cache.put_async(key_of(9), ids_of(9), kv_of(9))
    assert cache.stats()["dropped_writes"] == 1
    assert not [p for p in tmp_path.rglob("*.tmp")]


def test_reader_and_writer_threads_together(cache):
    """The caller's I/O thread reads while the writer writes: every read is a
    miss or the exact block, never a partial one."""
    n = 32
    bad = []

    def reader():
        for _ in range(20):
            for i in range(n):
                got = cache.get(key_of(i), ids_of(i))
                if got is not None and not torch.equal(got, kv_of(i)):
                    bad.append(i)

    thread = threading.Thread(target=reader)
    thread.start()
    for i in range(n):
        cache.put_async(key_of(i), ids_of(i), kv_of(i))
    thread.join()
    assert cache.flush()
    assert not bad and cache.stats()["corrupt"] == 0
    assert cache.exists_prefix([key_of(i) for i in range(n)]) == n


# -- blocks no read succeeds on ---------------------------------------------------------

UNREADABLE = ["directory", "empty directory", "fifo", "socket"]


def make_unreadable(path: str, kind: str) -> None:
    """Put at a block's ``path`` something no read succeeds on, even as root:
    a directory (with a file in it, one that cannot be removed either), a
    FIFO (opening it for reading waits for a writer), or a socket (opening
    it fails: ENXIO)."""
    if os.path.lexists(path):
        os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)
    else:
        os.mkdir(path)
        if kind == "directory":
            open(os.path.join(path, "not-ours"), "wb").close()


def within(seconds: float, fn):
    """``fn()``, failing the test if it has not returned after ``seconds``."""
    out = []
    thread = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return out[0]


def warnings_about(caplog, path: str) -> int:
    return sum(path in r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


@pytest.mark.parametrize("kind", UNREADABLE)
def test_a_block_no_read_succeeds_on_is_a_miss_once(cache, caplog, kind):
    """Every read of it is a miss at once; the first is counted and logged,
    the path removed if it can be (else skipped), and it no longer counts as
    on file. Once it is gone, the block can be stored again."""
    put_and_flush(cache, 0, 1)
    path = cache.path(key_of(0))
    make_unreadable(path, kind)
    with caplog.at_level(logging.WARNING, logger=file_backend.__name__):
        for _ in range(3):
            assert within(2, lambda: cache.get(key_of(0), ids_of(0))) is None
            assert cache.exists_prefix([key_of(0), key_of(1)]) == 0
    s = cache.stats()
    assert (s["reads"], s["read_hits"], s["unreadable"], s["corrupt"]) == (3, 0, 1, 0)
    assert warnings_about(caplog, path) == 1
    assert os.path.lexists(path) == (kind == "directory")
    assert torch.equal(cache.get(key_of(1), ids_of(1)), kv_of(1))  # the other blocks still serve
    if kind == "directory":
        shutil.rmtree(path)  # the operator clears it
    put_and_flush(cache, 0)
    assert torch.equal(cache.get(key_of(0), ids_of(0)), kv_of(0))
    assert cache.exists_prefix([key_of(0), key_of(1)]) == 2


def test_a_read_error_of_any_errno_is_a_miss_once(cache, caplog, monkeypatch):
    """A regular file whose read fails (a disk's EIO here; EACCES for a user
    other than root) is removed, counted and logged once."""
    put_and_flush(cache, 0)
    path = cache.path(key_of(0))

    def failing_read(f, token_ids):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(file_backend, "decode_block", failing_read)
    with caplog.at_level(logging.WARNING, logger=file_backend.__name__):
        for _ in range(3):
            assert cache.get(key_of(0), ids_of(0)) is None
    assert cache.stats()["unreadable"] == 1 and warnings_about(caplog, path) == 1
    assert not os.path.lexists(path) and cache.exists_prefix([key_of(0)]) == 0


# -- the size cap -------------------------------------------------------------------


def file_size(cache: HiCacheFile, i: int) -> int:
    return os.path.getsize(cache.path(key_of(i)))


def test_size_cap_deletes_least_recently_used_files(tmp_path):
    probe = HiCacheFile(str(tmp_path / "probe"), "ns")
    put_and_flush(probe, 0)
    size = file_size(probe, 0)
    probe.close()
    c = HiCacheFile(str(tmp_path), "ns", max_bytes=3 * size)
    try:
        put_and_flush(c, 0, 1, 2)
        assert c.get(key_of(0), ids_of(0)) is not None  # block 0 is now the most recently used
        put_and_flush(c, 3)
        assert [os.path.exists(c.path(key_of(i))) for i in range(4)] == [True, False, True, True]
        assert c.stats()["evicted"] == 1 and c.stats()["bytes"] == 3 * size
    finally:
        c.close()


def test_size_cap_order_and_total_survive_a_restart(tmp_path):
    c = HiCacheFile(str(tmp_path), "ns", max_bytes=1 << 30)
    put_and_flush(c, 0, 1, 2)
    size = file_size(c, 0)
    for i, age in ((0, 30), (1, 20), (2, 10)):  # 0 oldest
        t = os.path.getmtime(c.path(key_of(i))) - age
        os.utime(c.path(key_of(i)), (t, t))
    c.close()
    stale = os.path.join(c.root, "ab", ".0123.tmp")
    os.makedirs(os.path.dirname(stale), exist_ok=True)
    open(stale, "wb").close()
    os.utime(stale, (1, 1))  # a crashed writer's, long ago
    again = HiCacheFile(str(tmp_path), "ns", max_bytes=3 * size)
    try:
        assert again.stats()["bytes"] == 3 * size and not os.path.exists(stale)
        put_and_flush(again, 3)
        assert [os.path.exists(again.path(key_of(i))) for i in range(4)] == [False, True, True, True]
    finally:
        again.close()


# -- under the two-tier tree ---------------------------------------------------------


@pytest.mark.parametrize("parts, cuts", [([128], [64]), ([32, 128], [16, 96, 112])])
def test_a_backup_releases_its_pin_on_every_part_of_a_split_node(tmp_path, parts, cuts):
    """A file-tier backup pins the host copies of the nodes holding the blocks
    it reads (``host_ref``) until its task is polled back. A split meanwhile
    copies the pin to the new upper half: the release must clear every part,
    or the host tier can never evict them."""
    from test_hicache import file_cache, put

    cache, alloc = file_cache(tmp_path)
    release, write = threading.Event(), cache.storage._write

    def held_write(task):
        assert release.wait(10)
        write(task)

    cache.storage._write = held_write  # the tier's thread holds every backup until released
    tokens = list(range(500, 628))  # two 64-token blocks, read by the backup of the node ending at 128
    for n in parts:
        put(cache, alloc, tokens[:n])
    for cut in cuts:
        cache.match_prefix(tokens[:cut] + [1])  # diverges inside a pinned node: it splits
    nodes = [n for n in cache._nodes() if n is not cache.root]
    assert len(nodes) == len(parts) + len(cuts) and all(n.host_ref == 1 for n in nodes)
    cache.check_invariants()
    release.set()
    cache.storage.drain()
    cache.poll()
    assert not cache.busy() and [n.host_ref for n in nodes] == [0] * len(nodes)
    cache.check_invariants()
    assert cache.evict(128) == 128  # demoted: every part is host-only now
    cache._evict_host(128)
    assert cache.stats.hicache_host_evicted == 128 and not cache.root.children
    cache.check_invariants()
    cache.close()


class HeldCopy:
    """A device -> host copy that lands (runs) only at ``land``, as a GPU copy
    lands when its event passes: until then ``query`` is False and its host
    slots hold what they held before."""

    def __init__(self, issue):
        self.issue = issue

    def land(self) -> None:
        self.issue()
        self.issue = None

    def query(self) -> bool:
        return self.issue is None


def hold_copies(cache) -> list[HeldCopy]:
    copies = []
    cache._copy = lambda stream, issue, after: copies.append(HeldCopy(issue)) or copies[-1]
    cache.host.buffer.fill_(float("nan"))  # what a host slot holds before a copy lands in it
    return copies


def served(tmp_path, tokens):
    """The KV a server restarted on the file tier prefetches for ``tokens``
    (the device pool's layout), or None if it finds not all of them."""
    from test_hicache import file_cache

    reader, _ = file_cache(tmp_path)
    key = tokens + [1]
    reader.prefetch(key)
    reader.poll()
    reader.storage.drain()
    reader.poll()
    m = reader.match_prefix(key)
    kv = reader.host.read(m.last_host_node.host_value)[:, :, 0].transpose(0, 1) if m.host_hit_length else None
    reader.close()
    return kv if m.host_hit_length == len(tokens) else None


def test_a_node_split_while_its_copy_is_in_flight_goes_to_file_whole(tmp_path):
    """The copy's completion finds the node cut in two: the blocks that end in
    either part go to file, not only those ending in the lower part."""
    from test_hicache import file_cache, kv_of, put

    cache, alloc = file_cache(tmp_path)
    copies = hold_copies(cache)
    tokens = list(range(500, 628))  # two 64-token blocks
    written = kv_of(cache.host.device_pool, put(cache, alloc, tokens))
    cache.match_prefix(tokens[:64] + [1])  # splits the node at the first block's end
    copies[0].land()
    cache.poll()
    cache.check_invariants()
    cache.close()
    kv = served(tmp_path, tokens)
    assert kv is not None and torch.equal(kv, written)


def test_a_backup_waits_for_the_host_copies_above_it_to_land(tmp_path):
    """write_back demotes a child, then its parent, copying each. A block
    that ends in the child starts in the parent: it goes to file once the
    parent's copy has landed too, even when the child's lands first."""
    from test_hicache import file_cache, kv_of, put

    cache, alloc = file_cache(tmp_path, policy="write_back")
    tokens = list(range(500, 628))
    written = kv_of(cache.host.device_pool, put(cache, alloc, tokens))
    put(cache, alloc, tokens[:32])  # a parent of 32 tokens; the child's 96 end both blocks
    copies = hold_copies(cache)
    assert cache.evict(128) == 128  # the child is backed up and demoted, then the parent
    child, parent = copies
    child.land()
    cache.poll()  # the child's copy is done, its parent's still in flight
    cache.storage.drain()
    cache.check_invariants()
    parent.land()
    cache.poll()
    cache.check_invariants()
    cache.close()
    kv = served(tmp_path, tokens)
    assert kv is not None and torch.equal(kv, written)


@pytest.mark.parametrize("failure", ["miss", "another layout"])
def test_a_block_that_fails_to_read_is_not_read_again_by_the_next_fetch(tmp_path, failure):
    """A prefetch that ends short of what was on file puts what it read into
    the tree; the fetches after it do not start another read of the block
    that failed (admission retried it at every step, and a failure that
    repeats held the request forever), whatever the backend does with it."""
    from test_hicache import file_cache, put

    tokens = list(range(500, 692))  # three 64-token blocks; the second fails
    writer, alloc = file_cache(tmp_path)
    put(writer, alloc, tokens)
    writer.close()
    cache, _ = file_cache(tmp_path)
    reads, get = [], cache.storage.backend.get

    def failing_get(key, token_ids):
        reads.append(token_ids[0])
        if token_ids[0] != tokens[64]:
            return get(key, token_ids)
        return None if failure == "miss" else torch.zeros(1)

    cache.storage.backend.get = failing_get
    key = tokens + [1]
    first = cache.fetch(key, cache.match_prefix(key), 512)[0]
    cache.storage.drain()
    cache.poll()
    assert first.finished and cache.match_prefix(key).host_hit_length == 64  # the block before the bad one
    load = cache.fetch(key, cache.match_prefix(key), 512)[0]
    cache.poll()
    assert load.finished and len(cache.match_prefix(key).device_indices) == 64
    for _ in range(3):
        assert cache.fetch(key, cache.match_prefix(key), 512)[0] is None
        cache.poll()
    assert reads == [tokens[0], tokens[64]]
    cache.check_invariants()
    cache.close()


@pytest.mark.parametrize("kind", ["directory", "socket"])
def test_a_request_over_a_block_no_read_succeeds_on_runs_within_the_prefetch_bound(llama, tiers_off, tmp_path,
                                                                                    caplog, kind):
    """With something that cannot be read where a request's block should be,
    the request is answered within the prefetch bound, with the tokens of the
    tiers off, and the scheduler logs the block once."""
    import radixserve
    from radixserve.managers.metrics import ServerMetrics
    from radixserve.mem_cache.hicache_storage import PREFETCH_TIMEOUT_S
    from radixserve.sampling.sampling_params import SamplingParams
    from test_hicache import GREEDY, SHARED, serve, workload

    folder, _ = llama
    prompts = workload()
    tier = dict(enable_hierarchical_cache=True, hicache_ratio=4, hicache_storage_backend="file",
                hicache_storage_dir=str(tmp_path))
    serve(folder, prompts[:1], **tier)  # its 64-token block is on file; prompts[5] starts with it
    (block,) = tmp_path.rglob("*.kv")
    make_unreadable(str(block), kind)
    eng = radixserve.Engine(model_path=folder, **SHARED, **tier)
    try:
        s = eng.scheduler
        req = s.new_req("over a bad block", prompts[5], SamplingParams(**GREEDY))
        with caplog.at_level(logging.WARNING, logger=file_backend.__name__):
            s.add_request(req)
            give_up = time.monotonic() + PREFETCH_TIMEOUT_S
            while not req.finished() and time.monotonic() < give_up:
                s.step()
        assert req.finished(), f"no answer within {PREFETCH_TIMEOUT_S} s"
        assert req.output_ids == tiers_off[0][5] and req.cached_tokens == 0
        stats = eng.get_stats()
        assert stats["hicache_storage_unreadable"] == 1 and stats["hicache_storage_prefetched"] == 0
        assert warnings_about(caplog, str(block)) == 1
        metrics = ServerMetrics()  # what /metrics renders from the scheduler's figures
        metrics.update_from_state(stats)
        assert b"radixserve:hicache_storage_unreadable_blocks 1.0" in metrics.render()
    finally:
        eng.shutdown()
