"""A process group of two: one prefill rank (rank 0) and one decode rank (rank 1).

Pairs form at run time, after a bootstrap handshake, while each engine process
may already have its own default (tensor-parallel) group; so a pair is built
directly as ``ProcessGroupGloo`` (CPU pools) or ``ProcessGroupNCCL`` (CUDA
pools) over a ``PrefixStore`` on the prefill rank's ``TCPStore``, never with
``init_process_group``.

Facts about torch.distributed that shape this class:

- a gloo send/recv ``Work`` only reports ``is_completed()`` once ``wait()``
  has been called, so a waiter thread calls ``wait()`` for the posted works,
  in posting order, and ``is_completed()`` is true when the waiter is done
  with them;
- a gloo ``wait()`` that times out poisons the whole group ("Application
  timeout caused pair closure") and a peer that dies closes it ("Connection
  closed by peer"); so any failure marks the pair dead, and a dead pair is
  aborted and never used again (a later transfer forms a new pair);
- NCCL ignores tags and matches point-to-point operations in issue order,
  and creates its communicator on the first operation; so both sides post in
  one order (the prefill side's announcement order) and a warm-up exchange
  runs while the pair forms, in the forming thread.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

PREFILL_RANK, DECODE_RANK = 0, 1
_TAG_SPACE = 1 << 30
DoneCallback = Callable[[str | None], None]  # called with None on success, else the reason it failed


def short_error(e: BaseException) -> str:
    """The first sentence of a c10d error, without its source-file prefix."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)
    return text.split(". This is typically")[0]


def _new_group(store: dist.Store, rank: int, device: torch.device, host: str, timeout: timedelta) -> dist.ProcessGroup:
    if device.type == "cuda":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, 2, opts)
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    opts._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, opts)


class PairGroup:
    """The two-rank group ``pair_id`` and its waiter thread; ``peer`` names
    the other side's rank in messages ("decode rank 1").

    The constructor blocks until the peer has joined and a warm-up message
    went through (at most ``timeout_s``): call it from a background thread.
    """

    def __init__(self, pair_id: int, store: dist.Store, rank: int, device: torch.device, host: str, timeout_s: float,
                 peer: str, on_dead: Callable[[], None] | None = None):
        self.pair_id = pair_id
        self.name = f"pair {pair_id} with {peer}"
        self._on_dead = on_dead
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self._is_nccl = device.type == "cuda"
        self._lock = threading.Lock()  # orders posts (and the prefill side's announcements) on this pair
        self._dead: str | None = None
        self._next_tag = 1
        if self._is_nccl:
            torch.cuda.set_device(device)
        self.pg = _new_group(dist.PrefixStore(f"pair/{pair_id}/pg", store), rank, device, host, timedelta(seconds=timeout_s))
        self._warm_up(timeout_s)
        self._queue: queue.Queue = queue.Queue()
        self._waiter = threading.Thread(target=self._wait_loop, name=f"kv-pair-{pair_id}-waiter", daemon=True)
        self._waiter.start()

    def _warm_up(self, timeout_s: float) -> None:
        token = torch.tensor([self.pair_id if self.rank == PREFILL_RANK else -1], dtype=torch.int64, device=self.device)
        work = self.pg.send([token], self.peer, 0) if self.rank == PREFILL_RANK else self.pg.recv([token], self.peer, 0)
        self._wait(work, time.monotonic() + timeout_s)
        if int(token.item()) != self.pair_id:
            raise RuntimeError(f"{self.name}: the warm-up message carried {int(token.item())}")

    @property
    def dead(self) -> str | None:
        """Why this pair died, or None while it is usable."""
        return self._dead

    def post(self, tensors: list[torch.Tensor], send: bool, first_tag: int | None = None,
             announce: Callable[[int], None] | None = None) -> list[dist.Work]:
        """Post one send (or recv) per tensor, with tags ``first_tag, first_tag + 1, ...``
        (the pair picks ``first_tag`` for sends when None). ``announce(first_tag)``
        runs first, under the same lock, so announcements and posts keep one order.
        Raises RuntimeError when the pair is dead or posting fails (the pair then dies)."""
        with self._lock:
            if self._dead:
                raise RuntimeError(self._dead)
            if first_tag is None:
                first_tag = self._next_tag
                self._next_tag = (self._next_tag + len(tensors)) % _TAG_SPACE or 1
            if announce is not None:
                announce(first_tag)
            op = self.pg.send if send else self.pg.recv
            try:
                return [op([t], self.peer, (first_tag + i) % _TAG_SPACE) for i, t in enumerate(tensors)]
            except Exception as e:  # noqa: BLE001  a closed connection surfaces here
                reason = f"{self.name}: posting failed: {short_error(e)}"
        self.fail(reason)
        raise RuntimeError(reason)

    def watch(self, works: list[dist.Work], timeout_s: float, on_done: DoneCallback) -> None:
        """Have the waiter wait for ``works`` (within ``timeout_s`` of now) and
        then call ``on_done`` from its thread; on a dead pair, call it now with
        the reason. A failure kills the pair."""
        with self._lock:
            if not self._dead:
                self._queue.put((works, time.monotonic() + timeout_s, on_done))
                return
        on_done(self._dead)

    def _wait(self, work: dist.Work, deadline: float) -> None:
        remaining = max(deadline - time.monotonic(), 0.05)
        if not self._is_nccl:
            if not work.wait(timedelta(seconds=remaining)):
                raise RuntimeError("the wait was aborted")
            return
        while not work.is_completed():  # NCCL's is_completed() queries its CUDA event
            if time.monotonic() > deadline:
                raise TimeoutError(f"no completion within {remaining:.1f} s")
            time.sleep(2e-4)

    def _wait_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            works, deadline, on_done = item
            try:
                if self._dead:
                    raise RuntimeError(self._dead)
                for work in works:
                    self._wait(work, deadline)
            except Exception as e:  # noqa: BLE001
                self.fail(self._dead or f"{self.name}: {short_error(e)}")
                on_done(self._dead)
                continue
            on_done(None)

    def fail(self, reason: str, closing: bool = False) -> None:
        """Mark the pair dead: nothing more is posted on it, the waiter fails
        what it still holds and stops, ``on_dead`` runs; only the first call
        acts. The group is aborted, best effort: with gloo a wait already
        blocked still ends only at its timeout or when the connection closes."""
        with self._lock:
            if self._dead:
                return
            self._dead = reason
            self._queue.put(None)
        said = reason if reason.startswith(self.name) else f"{self.name}: {reason}"
        logger.log(logging.INFO if closing else logging.WARNING, "KV transfer pair dropped: %s", said)
        try:
            self.pg.abort()
        except Exception:  # noqa: BLE001  an already broken group may refuse; it is dropped either way
            pass
        if self._on_dead is not None:
            self._on_dead()

    def close(self, reason: str = "closed") -> None:
        """Fail the pair (pending callbacks get ``reason``) and wait a little for its waiter."""
        self.fail(reason, closing=True)
        self._waiter.join(timeout=5)
