"""A prefill rank's side of the torch.distributed backend's control plane.

:class:`PrefillControl` hosts the rank's ``TCPStore`` at its transfer address,
listening there only (the store every pair group of this rank rendezvouses
on, and the queues of the protocol), registers that address with the
bootstrap server under its dp group (its server's replica) and TP rank, and
runs a thread that pops the control queue (``control_plane.py``), where
decode ranks push:

- ``{"t": "pair", "pair": n, "rank"}``: form pair group ``n`` with decode
  rank ``rank``, as rank 0 of the group (in a thread of its own, since
  forming blocks until the decode rank joins);
- ``{"t": "room", "room", "pair", "pages", "heads", "aux", "expect"}``: a
  decode rank's registration of a room: its reserved pages, which of this
  rank's heads it wants (``[start, count]``, count 0 for none), whether it
  wants the aux row, and how many decode ranks register the room here
  (``head_map.registrations_expected``); kept until the room's sender claims it;
- ``{"t": "abort", "room", "reason"}``: the decode side gave the room up.

The senders of this rank (in torch_dist.py) read it from the caller's thread
through :meth:`claim_room` and :meth:`pair`, and push their announcements
through :meth:`push_announcement` / :meth:`announce_abort` (and
:meth:`abort_sent_room` for a room already sent).
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta

import msgpack

from radixserve.disaggregation.base import KVArgs, KVTransferConfig
from radixserve.disaggregation.bootstrap import register_prefill_rank
from radixserve.disaggregation.control_plane import (
    CONTROL_QUEUE, LISTEN_TIMEOUT_S, STOP, announcement_queue, open_store, pop_message, sent_abort_key,
)
from radixserve.disaggregation.pair_group import PREFILL_RANK, PairGroup, short_error
from radixserve.distributed.tcp_store import listening_store

logger = logging.getLogger(__name__)


class PrefillControl:
    """See the module docstring. Registers with ``bootstrap_addr`` at once."""

    def __init__(self, args: KVArgs, config: KVTransferConfig, bootstrap_addr: str):
        self.args, self.config, self.bootstrap_addr = args, config, bootstrap_addr
        self._lock = threading.Lock()
        self._closed = False
        self._pairs: dict[int, PairGroup | str] = {}  # a formed pair, or why it did not form
        self._rooms: dict[int, tuple[list[dict], float]] = {}  # registrations no sender claimed yet, since when
        self._claimed: set[int] = set()  # rooms a sender of this rank took
        self._gone: dict[int, tuple[str, float]] = {}  # rooms given up on either side: why, when
        self._store = listening_store(args.transfer_host, args.transfer_port, timedelta(seconds=config.connect_timeout_s))
        self.port = self._store.port
        self._control_store = open_store(args.transfer_host, self.port, config.connect_timeout_s)
        self._control_store.set_timeout(timedelta(seconds=LISTEN_TIMEOUT_S))
        self._last_expiry = time.monotonic()
        self.register_to_bootstrap()
        self._thread = threading.Thread(target=self._control_loop, name=f"kv-prefill-{self.port}", daemon=True)
        self._thread.start()

    def register_to_bootstrap(self) -> None:
        args = self.args
        info = {"engine_rank": args.engine_rank, "tp_size": args.tp_size, "dp_group": args.dp_rank,
                "dp_size": args.dp_size, "rank_ip": args.transfer_host, "rank_port": self.port, "layout": args.layout()}
        register_prefill_rank(self.bootstrap_addr, info, self.config.http_timeout_s)

    def close(self) -> None:
        """Stop the control thread, drop every pair and release the store's port."""
        with self._lock:
            self._closed = True
        self._store.queue_push(CONTROL_QUEUE, msgpack.packb(STOP))
        self._thread.join(timeout=5)
        for pair in list(self._pairs.values()):
            if isinstance(pair, PairGroup):
                pair.close("the KV manager was closed")
        self._control_store = self._store = None  # the store's server stops, and its port is free, once dropped

    def _control_loop(self) -> None:
        while not self._closed:
            try:
                message = pop_message(self._control_store, CONTROL_QUEUE)
            except Exception as e:  # noqa: BLE001  our own store: only closing explains it
                if not self._closed:
                    logger.error("KV manager control queue failed: %s", short_error(e))
                return
            if message is not None and message != STOP:
                self._dispatch(message)

    def _dispatch(self, message: dict) -> None:
        kind, room = message["t"], message.get("room")
        if kind == "pair":
            threading.Thread(target=self._form_pair, args=(message["pair"], message["rank"]), daemon=True).start()
        elif kind == "room":
            with self._lock:
                gone = self._gone.get(room)
                if gone is None:
                    self._rooms.setdefault(room, ([], time.monotonic()))[0].append(message)
            if gone is not None:
                self.announce_abort(message["pair"], room, gone[0])
        elif kind == "abort":
            reason = f"the decode side gave the transfer up: {message['reason']}"
            with self._lock:
                registrations, _ = self._rooms.pop(room, ([], None))
                self._gone[room] = (reason, time.monotonic())
            for other in registrations:  # the other decode ranks that registered it here, not claimed yet
                if other["pair"] != message.get("pair"):
                    self.announce_abort(other["pair"], room, reason)

    def _form_pair(self, pair_id: int, decode_rank: int) -> None:
        try:
            store = open_store(self.args.transfer_host, self.port, self.config.connect_timeout_s)
            pair = PairGroup(pair_id, store, PREFILL_RANK, self.args.device, self.args.transfer_host,
                             self.config.connect_timeout_s, f"decode rank {decode_rank}",
                             on_dead=lambda: self._forget_pair(pair_id))
        except Exception as e:  # noqa: BLE001
            logger.warning("KV transfer pair %d did not form: %s", pair_id, short_error(e))
            with self._lock:
                self._pairs[pair_id] = f"pair {pair_id} with decode rank {decode_rank} did not form: {short_error(e)}"
            return
        with self._lock:
            self._pairs[pair_id] = pair
            closed = self._closed
        if closed:
            pair.close("the KV manager was closed")

    def _forget_pair(self, pair_id: int) -> None:
        """A dead pair is never used again: keep only why it died."""
        with self._lock:
            pair = self._pairs.get(pair_id)
            if isinstance(pair, PairGroup):
                self._pairs[pair_id] = pair.dead

    def _expire_rooms(self) -> None:
        """Give up rooms the decode side registered that no sender claimed in
        time (so its receiver fails at once), and forget old given-up rooms.
        Runs from the senders' polls, at most every 0.25 s."""
        now, limit = time.monotonic(), self.config.bootstrap_timeout_s
        if now - self._last_expiry < 0.25:
            return
        self._last_expiry = now
        with self._lock:
            stale = [(r, regs) for r, (regs, t) in self._rooms.items() if now - t > limit and r not in self._claimed]
            for room, _ in stale:
                del self._rooms[room]
            for room in [r for r, (_, t) in self._gone.items() if now - t > limit]:
                del self._gone[room]
        for room, registrations in stale:
            for message in registrations:
                self.announce_abort(message["pair"], room, f"the prefill server had no request for it within {limit:.0f} s")

    def announce_abort(self, pair_id: int, room: int, reason: str) -> None:
        """Tell the decode side on pair ``pair_id`` that ``room`` will not be sent."""
        try:
            self._store.queue_push(announcement_queue(pair_id), msgpack.packb({"room": room, "ok": False, "reason": reason}))
        except Exception as e:  # noqa: BLE001  our own store; the decode side then times out instead
            logger.warning("could not announce the abort of room %d: %s", room, short_error(e))

    def abort_sent_room(self, pair_id: int, room: int, reason: str) -> None:
        """Tell the decode side on pair ``pair_id`` that ``room``, whose sends
        are posted, is given up: a flag that its listener reads before it
        posts the receives, and an abort announced after the room's own,
        for a listener that posted them already (which also clears the flag)."""
        try:
            self._store.set(sent_abort_key(pair_id, room), reason)
        except Exception as e:  # noqa: BLE001  the announcement below still tells it
            logger.warning("could not flag the abort of room %d: %s", room, short_error(e))
        self.announce_abort(pair_id, room, reason)

    def claim_room(self, room: int) -> tuple[list[dict], str | None]:
        """For the sender of ``room``: its registrations that decode ranks
        sent since the last claim, and why it was given up, if it was."""
        self._expire_rooms()
        with self._lock:
            self._claimed.add(room)
            gone = self._gone.get(room)
            entry = self._rooms.pop(room, None)
        return (entry[0] if entry else []), (gone[0] if gone else None)

    def given_up(self, room: int) -> str | None:
        """Why ``room`` was given up, if it was (a sender re-checks before it
        sends: the decode side's abort can come after the room's registration)."""
        with self._lock:
            gone = self._gone.get(room)
        return gone[0] if gone else None

    def give_up_room(self, room: int, reason: str) -> None:
        """Remember a room given up, so registrations that arrive later are
        answered with an abort."""
        with self._lock:
            self._gone[room] = (reason, time.monotonic())

    def pair(self, pair_id: int) -> PairGroup | str | None:
        """Pair ``pair_id`` when formed, why it did not form, or None while forming."""
        with self._lock:
            return self._pairs.get(pair_id)

    def forget_sender(self, room: int) -> None:
        with self._lock:
            self._claimed.discard(room)

    def push_announcement(self, pair_id: int, message: dict) -> None:
        self._store.queue_push(announcement_queue(pair_id), msgpack.packb(message))
