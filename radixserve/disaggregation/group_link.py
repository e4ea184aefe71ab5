"""A decode rank's link to one dp group of a prefill server, for the
torch.distributed backend.

One :class:`GroupLink` per prefill bootstrap address and dp group (the
prefill server's replica that serves the rooms ``room % dp_size == group``;
``link_table.py`` keeps them), shared by the receivers of every request
bound there. The store's queues and keys are in ``control_plane.py``. Its thread does the handshake and then listens:

1. ``GET /route?engine_rank=0&target_dp_group=G`` on the bootstrap server:
   the group's tp size and KV layout, which must fit ours
   (``layout_mismatch``: dtype, page size, layers, head dims, the model's KV
   heads); then this decode rank's *sources* (``head_map.decode_sources``):
   the group's ranks it takes heads from, and those it only tells of its rooms;
2. for each source, ``GET /route?engine_rank=R&target_dp_group=G``; connect to that rank's
   ``TCPStore``, take a pair number ``n`` (``add("pairs", 1)``) and push
   ``{"t": "pair", "pair": n, "rank": ours}`` on its control queue; both
   sides then build pair group ``n`` (:class:`PairGroup`, decode is rank 1);
3. one thread per source listens on its announcement queue ``pair/n/ann``:
   for each announced room, post the receives (in announcement order, which
   is that prefill rank's send order) and hand them to the pair's waiter,
   which calls the room's receiver back with the source's rank. A room the
   prefill side gave up once sent (``pair/n/aborted/<room>`` set, or an
   abort announced after it) still takes its messages, but its receiver
   fails at once.

A second thread pushes the receivers' messages (a room's pages, an abort) to
every source's control queue, a room's registration with what that source
sends (its heads, the aux row or not) and how many decode ranks register the
room there, so a receiver's ``init()`` never waits on the network. Any
failure of the link (a store gone, a pair dead) fails every receiver bound
to it; the manager then drops it, and the next receiver bound to that
group forms a new link and new pairs (the links to the server's other groups
live on). A link refused at the handshake (a KV layout that cannot be
received here) tells the group's rank 0 that its receivers' rooms will not
come; the group's ranks agree on it, so the prefill halves end at once too.
"""

from __future__ import annotations

import functools
import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Protocol

import msgpack
import torch
import torch.distributed as dist

from radixserve.disaggregation.base import KVArgs, KVTransferConfig, KVTransferError, layout_mismatch
from radixserve.disaggregation.bootstrap import rank_name, wait_for_prefill_rank
from radixserve.disaggregation.control_plane import (
    CONTROL_QUEUE, LISTEN_TIMEOUT_S, STOP, announcement_queue, open_store, pop_message, sent_abort_key,
)
from radixserve.disaggregation.head_map import HeadSlice, decode_sources, registrations_expected
from radixserve.disaggregation.kv_messages import KVMessageLayout
from radixserve.disaggregation.pair_group import DECODE_RANK, PairGroup, short_error

logger = logging.getLogger(__name__)


# The decode manager and its receivers (torch_dist.py) as a link sees them:
# declared here, below torch_dist.py, which builds the links.
class LinkOwner(Protocol):
    """The decode rank's KV manager: its pool, limits and message layout."""

    args: KVArgs
    config: KVTransferConfig
    layout: KVMessageLayout

    def forget_link(self, link: GroupLink) -> None:
        """Drop a failed link: the next room of its group makes a new one."""


class RoomReceiver(Protocol):
    """A room's receiver, bound to the link of its room's dp group."""

    room: int

    def bind(self, link: GroupLink | None, failure: str | None = None) -> None:
        """Its link, or why there is none."""

    def on_announced(self, prefill_rank: int, message_pages: list[int], buffers: list[torch.Tensor],
                     aux_bytes: int) -> None:
        """The receive buffers posted for its messages from ``prefill_rank``."""

    def on_done(self, prefill_rank: int, reason: str | None) -> None:
        """``prefill_rank``'s messages arrived (None), or why not."""


@dataclass
class _Source:
    """The link's connection to one prefill rank: what it sends this decode
    rank, how many decode ranks register each room there, its stores
    (one to push, one to listen on) and the pair."""

    heads: HeadSlice
    expect: int
    name: str
    out_store: dist.TCPStore
    ann_store: dist.TCPStore
    pair: PairGroup

    def registration(self, message: dict) -> dict:
        """A receiver's message as this source gets it."""
        out = {**message, "pair": self.pair.pair_id}
        if message["t"] == "room":
            out.update(heads=[self.heads.src_start, self.heads.count], aux=self.heads.aux, expect=self.expect)
        return out


class GroupLink:
    """See the module docstring. Built by the decode manager's ``LinkTable``; starts its thread at once."""

    def __init__(self, mgr: LinkOwner, bootstrap_addr: str, dp_group: int, dp_size: int, first: RoomReceiver):
        self.mgr = mgr
        self.bootstrap_addr, self.dp_group, self.dp_size = bootstrap_addr, dp_group, dp_size
        self._sources: list[_Source] = []  # grows as pairs form
        self._paired = False  # every source's pair formed
        self._route: dict | None = None  # the group's rank 0's bootstrap entry, once looked up
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._receivers: dict[int, RoomReceiver] = {first.room: first}  # bound, by room
        self._outbox: queue.Queue = queue.Queue()
        self._threads = [threading.Thread(target=self._run, name=f"kv-link-{bootstrap_addr}-{dp_group}", daemon=True)]
        self._threads[0].start()

    @property
    def key(self) -> tuple[str, int]:
        return self.bootstrap_addr, self.dp_group

    @property
    def ready(self) -> bool:
        return self._paired and self.failure is None

    @property
    def failure(self) -> str | None:
        """Why the link is unusable, or None."""
        return self._failure or next((s.pair.dead for s in self._sources if s.pair.dead), None)

    @property
    def sources(self) -> list[HeadSlice]:
        """What each prefill rank sends this decode rank (all of them once ``ready``)."""
        return [s.heads for s in self._sources]

    @property
    def pair_ids(self) -> tuple[int, ...] | None:
        return tuple(s.pair.pair_id for s in self._sources) if self._paired else None

    def bind(self, rx: RoomReceiver) -> bool:
        """Route announcements and failures of ``rx``'s room to it; False,
        binding nothing, when the link has failed (the caller makes a new one)."""
        with self._lock:
            if self.failure is not None:
                return False
            self._receivers[rx.room] = rx
            return True

    def unregister(self, room: int) -> None:
        with self._lock:
            self._receivers.pop(room, None)

    def send(self, message: dict) -> None:
        """Queue a control message (a bound receiver's pages, an abort) for
        every source (never blocks)."""
        self._outbox.put(message)

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001  any failure to pair is this link's failure
            reason = e.reason if isinstance(e, KVTransferError) else short_error(e)
            rooms = self.fail(f"could not pair with the prefill server behind {self.bootstrap_addr} "
                              f"(dp group {self.dp_group}): {reason}")
            self._refuse(rooms, reason)
            return
        threading.Thread(target=self._push_loop, name=f"kv-link-{self.bootstrap_addr}-out", daemon=True).start()
        for source in self._sources[1:]:
            listener = threading.Thread(target=self._listen_loop, args=(source,), daemon=True,
                                        name=f"kv-link-{source.pair.pair_id}-in")
            self._threads.append(listener)
            listener.start()
        self._listen_loop(self._sources[0])

    def _connect(self) -> None:
        args, cfg = self.mgr.args, self.mgr.config
        deadline = time.monotonic() + cfg.connect_timeout_s
        server = self._route = self._query_route(0, deadline)
        if server["dp_size"] != self.dp_size:  # a prefill server restarted with another --dp-size
            raise KVTransferError(f"it runs {server['dp_size']} dp groups, not the {self.dp_size} its rooms were "
                                  "assigned by")
        mismatch = layout_mismatch(server["layout"], args.layout())
        if mismatch:
            raise KVTransferError(f"the prefill server's KV does not fit the decode server's: {mismatch}")
        prefill_tp = server["tp_size"]
        for heads in decode_sources(args.num_kv_heads, prefill_tp, args.tp_size, args.engine_rank):
            rank = heads.prefill_rank
            route = server if rank == 0 else self._query_route(rank, deadline)
            if (route["tp_size"], route["layout"]) != (prefill_tp, server["layout"]):
                raise KVTransferError(f"{rank_name(rank, self.dp_group)} registered tp size {route['tp_size']} and "
                                      f"KV layout {route['layout']}, its rank 0 {prefill_tp} and {server['layout']}")
            source = self._pair_with(heads, route, registrations_expected(args.num_kv_heads, prefill_tp,
                                                                         args.tp_size, rank))
            with self._lock:
                self._sources.append(source)
                if self._closed:
                    raise RuntimeError("the KV manager was closed")
        with self._lock:
            self._paired = True
        logger.info("decode rank %d paired with prefill ranks %s of dp group %d behind %s (pairs %s)",
                    args.engine_rank, [s.heads.prefill_rank for s in self._sources], self.dp_group,
                    self.bootstrap_addr, self.pair_ids)

    def _pair_with(self, heads: HeadSlice, route: dict, expect: int) -> _Source:
        """Form the pair with the prefill rank of ``route`` (blocks until it joined)."""
        args, cfg = self.mgr.args, self.mgr.config
        host, port = route["rank_ip"], route["rank_port"]
        name = f"{rank_name(heads.prefill_rank, self.dp_group)} behind {self.bootstrap_addr}"
        out_store = open_store(host, port, cfg.connect_timeout_s)
        pair_id = out_store.add("pairs", 1)
        out_store.queue_push(CONTROL_QUEUE, msgpack.packb({"t": "pair", "pair": pair_id, "rank": args.engine_rank}))
        ann_store = open_store(host, port, cfg.connect_timeout_s)
        ann_store.set_timeout(timedelta(seconds=LISTEN_TIMEOUT_S))
        pair = PairGroup(pair_id, open_store(host, port, cfg.connect_timeout_s), DECODE_RANK, args.device,
                         args.transfer_host, cfg.connect_timeout_s, name,
                         on_dead=lambda: _wake_listener(out_store, pair_id))
        return _Source(heads, expect, name, out_store, ann_store, pair)

    def _query_route(self, rank: int, deadline: float) -> dict:
        """The entry of the group's rank ``rank`` (asked again until
        ``deadline`` while it has not registered)."""
        return wait_for_prefill_rank(self.bootstrap_addr, rank, self.dp_group, deadline,
                                     self.mgr.config.http_timeout_s, stop=lambda: self._closed)

    def _refuse(self, rooms: list[int], reason: str) -> None:
        """Tell the group's rank 0 that ``rooms`` will not be received (the link
        failed before pairing), so the prefill halves end now rather than at
        their bootstrap timeout. Best effort: an unreachable rank is not told."""
        if self._route is None or not rooms:
            return
        try:
            store = open_store(self._route["rank_ip"], self._route["rank_port"], self.mgr.config.http_timeout_s)
            for room in rooms:
                store.queue_push(CONTROL_QUEUE, msgpack.packb({"t": "abort", "room": room, "reason": reason}))
        except Exception as e:  # noqa: BLE001
            logger.warning("could not tell dp group %d of the prefill server behind %s that %d rooms will not come: "
                           "%s", self.dp_group, self.bootstrap_addr, len(rooms), short_error(e))

    def _push_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            for source in self._sources:
                try:
                    source.out_store.queue_push(CONTROL_QUEUE, msgpack.packb(source.registration(message)))
                except Exception as e:  # noqa: BLE001
                    self.fail(f"lost {source.name}: {short_error(e)}")
                    return

    def _listen_loop(self, source: _Source) -> None:
        key = announcement_queue(source.pair.pair_id)
        while not self._closed and self.failure is None:
            try:
                message = pop_message(source.ann_store, key)
            except Exception as e:  # noqa: BLE001
                self.fail(f"lost {source.name}: {short_error(e)}")
                return
            if message is not None and message != STOP:
                self._on_announcement(source, message)
        if self.failure is not None:
            self.fail(self.failure)  # a pair died under a transfer: fail the receivers and leave the table

    def _on_announcement(self, source: _Source, message: dict) -> None:
        rank, room = source.heads.prefill_rank, message["room"]
        with self._lock:
            rx = self._receivers.get(room)
        if not message["ok"]:
            if rx is not None:
                rx.on_done(rank, f"the prefill side gave the transfer up: {message['reason']}")
            self._sent_abort(source, room, clear=True)
            return
        layout = self.mgr.layout
        sizes = [layout.message_bytes(n, source.heads.count) for n in message["pages"]]
        sizes += [message["aux"]] if message["aux"] else []
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.mgr.args.device) for n in sizes]
        if rx is not None:
            rx.on_announced(rank, message["pages"], buffers, message["aux"])
            if (reason := self._sent_abort(source, room)) is not None:  # ends now; the messages still come
                rx.on_done(rank, f"the prefill side gave the transfer up: {reason}")
        try:  # a room without a receiver (cleared) still takes its messages, to keep the pair in step
            works = source.pair.post(buffers, send=False, first_tag=message["tag"])
        except RuntimeError as e:
            self.fail(str(e))
            return
        on_done = functools.partial(rx.on_done, rank) if rx is not None else _discard
        source.pair.watch(works, self.mgr.config.transfer_timeout_s, on_done)

    @staticmethod
    def _sent_abort(source: _Source, room: int, clear: bool = False) -> str | None:
        """Why the prefill rank gave ``room`` up once its sends were posted,
        if it did (its flag); ``clear`` deletes the flag. Best effort: a lost
        store fails the link at the listener's next pop."""
        key = sent_abort_key(source.pair.pair_id, room)
        try:
            if clear:
                source.ann_store.delete_key(key)
                return None
            return source.ann_store.get(key).decode() if source.ann_store.check([key]) else None
        except Exception:  # noqa: BLE001
            return None

    def fail(self, reason: str) -> list[int]:
        """Fail the link: its receivers fail at their next poll, and the
        manager forgets it. Returns their rooms."""
        with self._lock:
            self._failure = self._failure or reason
            rooms = list(self._receivers)
        for source in self._sources:
            source.pair.fail(self._failure)
        self._outbox.put(None)
        self.mgr.forget_link(self)
        return rooms

    def close(self) -> None:
        """Stop the threads and drop the pairs (their transfers fail with "closed")."""
        with self._lock:
            self._closed = True
            self._failure = self._failure or "the KV manager was closed"
        for source in self._sources:
            _wake_listener(source.out_store, source.pair.pair_id)
        self._outbox.put(None)
        for thread in self._threads:
            thread.join(timeout=5)
        for source in self._sources:
            source.pair.close(self._failure)


def _wake_listener(store: dist.TCPStore, pair_id: int) -> None:
    """Unblock the listening thread's pop (a push does not wait for the store's answer)."""
    try:
        store.queue_push(announcement_queue(pair_id), msgpack.packb(STOP))
    except Exception:  # noqa: BLE001  a lost store has woken it already
        pass


def _discard(reason: str | None) -> None:
    """What a cleared receiver's messages do when they arrive: nothing."""
