"""A decode rank's link to one prefill rank, for the torch.distributed backend.

One :class:`DecodeLink` per prefill bootstrap address, shared by the receivers
of every request bound there. Its thread does the handshake and then listens:

1. ``GET /route?engine_rank=R`` on the bootstrap server (R is this rank's TP
   rank): where prefill rank R's ``TCPStore`` is, its tp size and its KV
   layout (which must equal ours; a prefill server with fewer ranks never
   registers R, and its rank 0's entry says so);
2. connect to that store, take a pair number ``n`` (``add("pairs", 1)``) and
   push ``{"t": "pair", "pair": n}`` on its control queue; both sides then
   build pair group ``n`` (:class:`PairGroup`, decode is rank 1);
3. listen on the announcement queue ``pair/n/ann``: for each announced room,
   post the receives (in announcement order, which is the prefill side's
   send order) and hand them to the pair's waiter, which calls the room's
   receiver back.

A second thread pushes the receivers' messages (their pages, or an abort) to
the prefill rank's control queue, so a receiver's ``init()`` never waits on
the network. Any failure of the link (the store gone, the pair dead) fails
every receiver bound to it; the manager then drops it, and the next receiver
bound to that address forms a new link and a new pair. A link refused at the
handshake (a different tp size or KV layout) tells the prefill rank that its
receivers' rooms will not come, so the prefill halves end at once too.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING

import msgpack
import torch
import torch.distributed as dist

from radixserve.disaggregation.base import KVTransferError
from radixserve.disaggregation.bootstrap import query_prefill_rank
from radixserve.disaggregation.pair_group import DECODE_RANK, PairGroup, short_error

if TYPE_CHECKING:
    from radixserve.disaggregation.torch_dist import TorchDistKVManager, TorchDistKVReceiver

logger = logging.getLogger(__name__)

CONTROL_QUEUE = "ctl"  # on the prefill rank's store: decode -> prefill messages
# A listening thread blocks on its queue this long before it pops again (c10d
# logs every pop that times out, so it is long); close() wakes it with a stop message.
LISTEN_TIMEOUT_S = 300.0
STOP = {"t": "stop"}


def announcement_queue(pair_id: int) -> str:
    """The store queue of pair ``pair_id``'s announcements (prefill -> decode)."""
    return f"pair/{pair_id}/ann"


def open_store(host: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A client of the prefill rank's TCPStore (connecting takes at most about ``timeout_s``)."""
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False)


def pop_message(store: dist.TCPStore, key: str) -> dict | None:
    """The next message of queue ``key``, or None when none came within the
    store's timeout. A lost store raises (DistNetworkError)."""
    try:
        return msgpack.unpackb(store.queue_pop(key, block=True))
    except dist.DistStoreError as e:
        if "timeout" in str(e):
            return None
        raise


class DecodeLink:
    """See the module docstring. Built by the decode manager; starts its thread at once."""

    def __init__(self, mgr: TorchDistKVManager, bootstrap_addr: str, first: TorchDistKVReceiver):
        self.mgr = mgr
        self.bootstrap_addr = bootstrap_addr
        self.pair: PairGroup | None = None
        self._route: dict | None = None  # the prefill rank's bootstrap entry, once looked up
        self._failure: str | None = None
        self._closed = False
        self._lock = threading.Lock()
        self._receivers: dict[int, TorchDistKVReceiver] = {first.room: first}  # bound, by room
        self._outbox: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"kv-link-{bootstrap_addr}", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.pair is not None and self.failure is None

    @property
    def failure(self) -> str | None:
        """Why the link is unusable, or None."""
        return self._failure or (self.pair.dead if self.pair is not None else None)

    def bind(self, rx: TorchDistKVReceiver) -> bool:
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
        the prefill rank, with this link's pair number added (never blocks)."""
        self._outbox.put(message)

    def _run(self) -> None:
        try:
            self._connect()
        except Exception as e:  # noqa: BLE001  any failure to pair is this link's failure
            reason = e.reason if isinstance(e, KVTransferError) else short_error(e)
            rooms = self.fail(f"could not pair with the prefill rank behind {self.bootstrap_addr}: {reason}")
            self._refuse(rooms, reason)
            return
        threading.Thread(target=self._push_loop, name=f"kv-link-{self.pair.pair_id}-out", daemon=True).start()
        self._listen_loop()

    def _connect(self) -> None:
        args, cfg = self.mgr.args, self.mgr.config
        info = self._route = self._query_route()
        if info["tp_size"] != args.tp_size:
            raise KVTransferError(
                f"the prefill server runs at --tp-size {info['tp_size']} and this decode server at --tp-size "
                f"{args.tp_size}; a prefill/decode pair needs the same tp size (radixserve does not transfer "
                "KV between different tp sizes yet)")
        if info["layout"] != args.layout():
            raise KVTransferError(f"the prefill rank's KV layout {info['layout']} differs from ours {args.layout()}")
        host, port = info["rank_ip"], info["rank_port"]
        self._out_store = open_store(host, port, cfg.connect_timeout_s)
        pair_id = self._out_store.add("pairs", 1)
        self._out_store.queue_push(CONTROL_QUEUE, msgpack.packb({"t": "pair", "pair": pair_id}))
        self._ann_store = open_store(host, port, cfg.connect_timeout_s)
        self._ann_store.set_timeout(timedelta(seconds=LISTEN_TIMEOUT_S))
        pair = PairGroup(pair_id, open_store(host, port, cfg.connect_timeout_s), DECODE_RANK, args.device,
                         args.transfer_host, cfg.connect_timeout_s, on_dead=self._wake_listener)
        with self._lock:
            self.pair = pair
            closed = self._closed
        if closed:
            pair.close()
        logger.info("paired with prefill rank %d at %s:%d (pair %d)", args.engine_rank, host, port, pair_id)

    def _query_route(self) -> dict:
        """The prefill rank's entry; a rank not registered yet (a prefill server
        still starting) is asked again until ``connect_timeout_s`` has passed.
        While it is missing, prefill rank 0's entry is returned instead if it
        names another tp size (a prefill server with fewer ranks)."""
        cfg, deadline = self.mgr.config, time.monotonic() + self.mgr.config.connect_timeout_s
        rank, tp_size = self.mgr.args.engine_rank, self.mgr.args.tp_size
        while True:
            try:
                return query_prefill_rank(self.bootstrap_addr, rank, cfg.http_timeout_s)
            except KVTransferError as e:
                if "(404)" not in e.reason or time.monotonic() > deadline or self._closed:
                    raise
            if rank != 0:
                try:
                    first = query_prefill_rank(self.bootstrap_addr, 0, cfg.http_timeout_s)
                    if first["tp_size"] != tp_size:
                        return first
                except KVTransferError:
                    pass
            time.sleep(0.2)

    def _refuse(self, rooms: list[int], reason: str) -> None:
        """Tell the prefill rank looked up that ``rooms`` will not be received
        (the link failed before pairing), so its halves end now rather than at
        their bootstrap timeout. Best effort: an unreachable rank is not told."""
        if self._route is None or not rooms:
            return
        try:
            store = open_store(self._route["rank_ip"], self._route["rank_port"], self.mgr.config.http_timeout_s)
            for room in rooms:
                store.queue_push(CONTROL_QUEUE, msgpack.packb({"t": "abort", "room": room, "reason": reason}))
        except Exception as e:  # noqa: BLE001
            logger.warning("could not tell the prefill rank behind %s that %d rooms will not come: %s",
                           self.bootstrap_addr, len(rooms), short_error(e))

    def _push_loop(self) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                self._out_store.queue_push(CONTROL_QUEUE, msgpack.packb({**message, "pair": self.pair.pair_id}))
            except Exception as e:  # noqa: BLE001
                self.fail(f"lost the prefill rank behind {self.bootstrap_addr}: {short_error(e)}")
                return

    def _listen_loop(self) -> None:
        key = announcement_queue(self.pair.pair_id)
        while not self._closed and self.failure is None:
            try:
                message = pop_message(self._ann_store, key)
            except Exception as e:  # noqa: BLE001
                self.fail(f"lost the prefill rank behind {self.bootstrap_addr}: {short_error(e)}")
                return
            if message is not None and message != STOP:
                self._on_announcement(message)
        if self.failure is not None:
            self.fail(self.failure)  # the pair died under a transfer: fail the receivers and leave the table

    def _on_announcement(self, message: dict) -> None:
        with self._lock:
            rx = self._receivers.get(message["room"])
        if not message["ok"]:
            if rx is not None:
                rx.on_done(f"the prefill side gave the transfer up: {message['reason']}")
            return
        layout = self.mgr.layout
        sizes = [layout.message_bytes(n) for n in message["pages"]] + ([message["aux"]] if message["aux"] else [])
        buffers = [torch.empty(n, dtype=torch.uint8, device=self.mgr.args.device) for n in sizes]
        if rx is not None:
            rx.on_announced(message["pages"], buffers, message["aux"])
        try:  # a room without a receiver (cleared) still takes its messages, to keep the pair in step
            works = self.pair.post(buffers, send=False, first_tag=message["tag"])
        except RuntimeError as e:
            self.fail(str(e))
            return
        self.pair.watch(works, self.mgr.config.transfer_timeout_s, rx.on_done if rx is not None else _discard)

    def fail(self, reason: str) -> list[int]:
        """Fail the link and every receiver bound to it; the manager forgets
        it. Returns those receivers' rooms."""
        with self._lock:
            self._failure = self._failure or reason
            receivers = list(self._receivers.values())
        if self.pair is not None:
            self.pair.fail(self._failure)
        for rx in receivers:
            rx.on_done(self._failure)
        self._outbox.put(None)
        self.mgr.forget_link(self)
        return [rx.room for rx in receivers]

    def _wake_listener(self) -> None:
        """Unblock the listening thread's pop (a push does not wait for the store's answer)."""
        try:
            self._out_store.queue_push(announcement_queue(self.pair.pair_id), msgpack.packb(STOP))
        except Exception:  # noqa: BLE001  a lost store has woken it already
            pass

    def close(self) -> None:
        """Stop the threads and drop the pair (its transfers fail with "closed")."""
        with self._lock:
            self._closed = True
            self._failure = self._failure or "the KV manager was closed"
        if self.pair is not None:
            self._wake_listener()
        self._outbox.put(None)
        self._thread.join(timeout=5)
        if self.pair is not None:
            self.pair.close(self._failure)


def _discard(reason: str | None) -> None:
    """What a cleared receiver's messages do when they arrive: nothing."""
