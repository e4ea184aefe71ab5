"""Servers whose elastic KV pools share one device, in a small table in
shared memory (kvcached keeps its memory figures in shared memory for its
tools in the same way). docs/elastic_kv.md, "Servers that share a device".

One file per device and group (``--elastic-kv-group``) under ``/dev/shm``
(the temporary directory where there is none): a header and ``SLOTS`` rows,
one per member (a scheduler rank of a server). A row holds::

    member id (16 bytes, zero: free) | tenant | pid | heartbeat | mapped | used | cached | floor | want | want seq

- ``tenant`` is the server (its rank 0's pid): ranks of one server never
  give memory to each other.
- ``mapped``, ``used``, ``cached`` and ``floor`` are bytes; a member writes
  its own, under the file's lock (``flock``), at each map and unmap and at
  least every ``HEARTBEAT_S``.
- ``want`` and ``want seq``: a member that could not map (the device said no,
  or the group's budget is spent) asks for ``want`` bytes and counts the
  ask; the others, each time they look (``demand``), answer each new ask
  once by evicting cached KV and unmapping, down to their floor.
- A group budget (``--elastic-kv-group-gb``) caps what the group's members
  map together: :meth:`claim` reserves bytes under the lock before a map, so
  two members never both take the last of it.

A row whose process is gone, or that has not written for ``STALE_S``, is
free for the next member to join.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import struct
import tempfile
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

from radixserve.feature_args import ELASTIC_KV_GROUP

MAGIC = b"RSEKV001"
ROW = struct.Struct("<16sqqdqqqqqq")  # id, tenant, pid, heartbeat, mapped, used, cached, floor, want, want_seq
SLOTS = 64
HEARTBEAT_S = 0.1
STALE_S = 30.0


@dataclass
class Member:
    id: bytes
    tenant: int
    pid: int
    heartbeat: float
    mapped: int
    used: int
    cached: int
    floor: int
    want: int
    want_seq: int

    def live(self, now: float) -> bool:
        if self.id == bytes(16) or now - self.heartbeat > STALE_S:
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process: alive
            pass
        return True


def registry_path(group: str, device_key: str) -> str:
    if not ELASTIC_KV_GROUP.fullmatch(group):
        raise ValueError(f"elastic_kv_group: letters, digits, '_', '.' and '-' only (at most 64), got {group!r}")
    root = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    return os.path.join(root, f"radixserve-elastic-kv-{group}-{re.sub(r'[^A-Za-z0-9-]', '_', device_key)}")


class ElasticRegistry:
    """This member's row in the group's table, and what it reads of the others'."""

    def __init__(self, path: str, tenant: int, floor_bytes: int = 0, budget_bytes: int | None = None):
        self.path, self.tenant, self.floor, self.budget = path, tenant, floor_bytes, budget_bytes
        self.id = uuid.uuid4().bytes
        self._answered: dict[bytes, int] = {}  # member -> the last ask of it answered
        self._seq = 0
        self._written = 0.0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        with self._locked():
            if os.fstat(self._fd).st_size < len(MAGIC) + SLOTS * ROW.size:
                os.ftruncate(self._fd, len(MAGIC) + SLOTS * ROW.size)
            self._mm = mmap.mmap(self._fd, len(MAGIC) + SLOTS * ROW.size)
            if self._mm[: len(MAGIC)] != MAGIC:
                self._mm[:] = bytes(len(self._mm))
                self._mm[: len(MAGIC)] = MAGIC
            now = time.time()
            free = [i for i, m in enumerate(self._rows()) if not m.live(now)]
            if not free:
                raise RuntimeError(f"the elastic KV registry {path} has {SLOTS} live members already")
            self.slot = free[0]
            self._write(Member(self.id, tenant, os.getpid(), now, 0, 0, 0, floor_bytes, 0, 0))

    # -- the table -------------------------------------------------------------------
    @contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _rows(self) -> list[Member]:
        return [Member(*ROW.unpack_from(self._mm, len(MAGIC) + i * ROW.size)) for i in range(SLOTS)]

    def _write(self, member: Member) -> None:
        ROW.pack_into(self._mm, len(MAGIC) + self.slot * ROW.size, member.id, member.tenant, member.pid,
                      member.heartbeat, member.mapped, member.used, member.cached, member.floor, member.want,
                      member.want_seq)
        self._written = member.heartbeat

    def _mine(self) -> Member:
        return Member(*ROW.unpack_from(self._mm, len(MAGIC) + self.slot * ROW.size))

    def members(self) -> list[Member]:
        """The live members, this one included."""
        now = time.time()
        with self._locked():
            return [m for m in self._rows() if m.live(now)]

    # -- this member ---------------------------------------------------------------------
    def due(self) -> bool:
        """Whether this member's row was last written ``HEARTBEAT_S`` ago or more."""
        return time.time() - self._written >= HEARTBEAT_S

    def publish(self, mapped: int, used: int | None = None, cached: int | None = None) -> None:
        """This member's figures (``None``: as they were) and its heartbeat."""
        with self._locked():
            me = self._mine()
            me.heartbeat, me.mapped = time.time(), mapped
            me.used = me.used if used is None else used
            me.cached = me.cached if cached is None else cached
            self._write(me)

    def claim(self, nbytes: int, mapped: int) -> int:
        """Bytes of ``nbytes`` more that the group's budget leaves this member
        (all of them without a budget), recorded as mapped at once; the
        member then publishes what it did map."""
        with self._locked():
            me = self._mine()
            allowed = nbytes if self.budget is None else max(min(nbytes, self.budget - self._others_mapped() - mapped), 0)
            me.heartbeat, me.mapped = time.time(), mapped + allowed
            self._write(me)
            return allowed

    def room(self, mapped: int) -> int | None:
        """Bytes the group's budget leaves this member beyond ``mapped`` (None: no budget)."""
        if self.budget is None:
            return None
        with self._locked():
            return max(self.budget - self._others_mapped() - mapped, 0)

    def _others_mapped(self) -> int:
        """Bytes the other live members map (under the lock)."""
        now = time.time()
        return sum(m.mapped for i, m in enumerate(self._rows()) if i != self.slot and m.live(now))

    def ask(self, nbytes: int) -> None:
        """Ask the other servers for ``nbytes``: a new ask each call."""
        with self._locked():
            me = self._mine()
            self._seq = me.want_seq + 1
            me.heartbeat, me.want, me.want_seq = time.time(), nbytes, self._seq
            self._write(me)

    def satisfied(self) -> None:
        """A map succeeded: no ask stands any more."""
        if self._mine().want:
            with self._locked():
                me = self._mine()
                me.want = 0
                self._write(me)

    def demand(self) -> int:
        """Bytes other servers asked for since this member last looked (each ask counted once)."""
        now, total = time.time(), 0
        with self._locked():
            rows = self._rows()
        for m in rows:
            if m.tenant == self.tenant or not m.want or not m.live(now):
                continue
            if self._answered.get(m.id, 0) < m.want_seq:
                self._answered[m.id] = m.want_seq
                total += m.want
        return total

    def close(self) -> None:
        """Leave the table (the row is free for the next member)."""
        if self._fd < 0:
            return
        with self._locked():
            self._mm[len(MAGIC) + self.slot * ROW.size: len(MAGIC) + (self.slot + 1) * ROW.size] = bytes(ROW.size)
        self._mm.close()
        os.close(self._fd)
        self._fd = -1
