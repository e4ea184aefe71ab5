"""The torch.distributed transfer backend: point-to-point sends between a
prefill rank and a decode rank (gloo over TCP for CPU pools, NCCL for CUDA).

Protocol (docs/disaggregation.md has the whole picture):

- The prefill rank's :class:`PrefillControl` hosts a ``TCPStore`` at its
  transfer address, registers it with the bootstrap server under its dp
  group and TP rank, and pops the store's control queue (pair requests,
  rooms' pages, aborts).
- A decode rank keeps one :class:`GroupLink` per bootstrap address and dp
  group (room ``r`` lies on group ``r % dp_size``; :class:`LinkTable`): the
  handshake, a pair group with each of the group's ranks it takes KV heads from (or
  only tells of its rooms, ``head_map.decode_sources``), their listeners.
  With the same tp size on both servers that is prefill rank r for decode
  rank r, with all its heads.
- A sender is ready (WaitingForInput) once as many decode ranks as the
  registrations say have registered its room, on formed pairs. ``send()``
  gathers, for each of them, the heads it asked for of the pages into a few
  contiguous messages, pushes an announcement ``{room, tag, pages per
  message, aux bytes}`` on that pair's announcement queue and posts the
  sends, both under the pair's lock, so the decode rank posts its receives
  in the same order. The aux message (row ``aux_index`` of the aux buffers)
  goes last, to the decode ranks that asked for it.
- The decode receiver, once every source delivered, scatters the messages
  into its pages' heads in ``poll()``, on the caller's thread, and only on success.
"""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time

import torch

from radixserve.disaggregation.base import (
    BaseKVManager, BaseKVReceiver, BaseKVSender, DisaggregationMode, KVArgs, KVPoll, KVTransferConfig,
    KVTransferError, check_room,
)
from radixserve.disaggregation.group_link import GroupLink
from radixserve.disaggregation.kv_messages import KVMessageLayout
from radixserve.disaggregation.link_table import LinkTable
from radixserve.disaggregation.pair_group import PairGroup
from radixserve.disaggregation.prefill_control import PrefillControl

logger = logging.getLogger(__name__)

_PENDING = object()  # a transfer's outcome before the waiter reports it
_TERMINAL = (KVPoll.Success, KVPoll.Failed)


class TorchDistKVManager(BaseKVManager):
    """One engine rank's transfers. On the prefill side pass the bootstrap
    server's ``host:port``: the manager registers there at once."""

    def __init__(self, args: KVArgs, mode: DisaggregationMode, config: KVTransferConfig | None = None,
                 bootstrap_addr: str | None = None):
        self.args, self.mode = args, DisaggregationMode(mode)
        self.config = config or KVTransferConfig()
        self.layout = KVMessageLayout(args, self.config.max_message_bytes)
        if self.mode == DisaggregationMode.DECODE:
            self.links = LinkTable(self)
            return
        if self.mode != DisaggregationMode.PREFILL or bootstrap_addr is None:
            raise ValueError("a KV manager is for the prefill side (with a bootstrap_addr) or the decode side")
        self.control = PrefillControl(args, self.config, bootstrap_addr)

    def register_to_bootstrap(self) -> None:
        if self.mode == DisaggregationMode.PREFILL:
            self.control.register_to_bootstrap()

    def close(self) -> None:
        if self.mode == DisaggregationMode.PREFILL:
            self.control.close()
        else:
            self.links.close()

    def forget_link(self, link: GroupLink) -> None:
        """Decode side: a failed link is never used again."""
        self.links.forget(link)


class TorchDistKVSender(BaseKVSender):
    """The prefill half of room ``bootstrap_room`` (see the module docstring):
    it waits for every decode rank that registers the room with this rank
    (each registration says how many will) and sends each the heads it asked
    for. ``messages_sent`` counts the messages ``send()`` posted."""

    def __init__(self, mgr: TorchDistKVManager, bootstrap_addr: str, bootstrap_room: int):
        self.mgr, self.room = mgr, check_room(bootstrap_room)
        self._created = time.monotonic()
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._registrations: list[dict] = []
        self._pairs: list[PairGroup] = []  # one per registration, once all formed
        self._sent_at: float | None = None
        self._outcomes: list = []  # per registration, once sent
        self._failure: KVTransferError | None = None
        self._state = KVPoll.Bootstrapping
        self.messages_sent = 0

    def init(self, num_kv_indices: int, aux_index: int | None = None) -> None:
        self._num_pages, self._aux_index = int(num_kv_indices), aux_index

    def poll(self) -> KVPoll:
        if self._state in _TERMINAL:
            return self._state
        if self._sent_at is not None:
            return self._poll_transfer()
        new, gone = self.mgr.control.claim_room(self.room)
        self._registrations += new
        if gone is not None:
            return self._fail(gone)
        mismatch = self._check_registrations() if new else None
        if mismatch:
            return self._fail(mismatch)
        regs = self._registrations
        if not regs:
            return self._wait_bootstrap("no decode rank registered for it")
        if len(regs) < regs[0]["expect"]:
            return self._wait_bootstrap(f"{len(regs)} of the {regs[0]['expect']} decode ranks registered for it")
        pairs = [self.mgr.control.pair(r["pair"]) for r in regs]
        for pair in pairs:
            if isinstance(pair, str) or (pair is not None and pair.dead):
                return self._fail(pair if isinstance(pair, str) else pair.dead)
        if None in pairs:
            return self._wait_bootstrap("the pairs with the decode ranks did not form")
        self._pairs, self._state = pairs, KVPoll.WaitingForInput
        return self._state

    def _wait_bootstrap(self, what: str) -> KVPoll:
        if time.monotonic() - self._created > self.mgr.config.bootstrap_timeout_s:
            return self._fail(f"{what} within {self.mgr.config.bootstrap_timeout_s:.1f} s")
        return KVPoll.Bootstrapping

    def _check_registrations(self) -> str | None:
        regs, expect = self._registrations, self._registrations[0]["expect"]
        if len(regs) > expect or any(r["expect"] != expect for r in regs):
            return f"the decode ranks disagree on how many of them register the room: {[r['expect'] for r in regs]}"
        for reg in regs:
            if self._num_pages is not None and len(reg["pages"]) != self._num_pages:
                return f"the decode side reserved {len(reg['pages'])} pages for {self._num_pages} pages of KV"
            try:
                self.mgr.layout.check_heads(range(reg["heads"][0], sum(reg["heads"])))
            except ValueError as e:
                return f"a decode rank asked for {e}"
        return None

    def send(self, kv_indices) -> None:
        if self._state == KVPoll.Failed:
            return
        if self._state == KVPoll.WaitingForInput and (gone := self.mgr.control.given_up(self.room)) is not None:
            self._fail(gone)  # the decode side gave the room up while its KV was computed: nothing to send
            return
        if self._state != KVPoll.WaitingForInput:
            raise RuntimeError(f"send() on room {self.room} in state {self._state.name}; poll() must return WaitingForInput first")
        try:
            pages = self.mgr.layout.check_pages(kv_indices)
        except ValueError as e:
            self._fail(f"bad page indices: {e}")
            raise
        reserved = len(self._registrations[0]["pages"])
        if pages.numel() != reserved:
            self._fail(f"send() got {pages.numel()} pages for the {reserved} the decode side reserved")
            return
        self._outcomes = [_PENDING] * len(self._registrations)
        for i, (reg, pair) in enumerate(zip(self._registrations, self._pairs)):
            messages, announcement = self._messages(pages, reg)
            try:
                works = pair.post(messages, send=True, announce=functools.partial(self._announce, pair, announcement))
            except RuntimeError as e:  # that pair died; the ranks not sent to yet are told
                for later in self._registrations[i + 1 :]:
                    self.mgr.control.announce_abort(later["pair"], self.room, str(e))
                self._fail(str(e), notify=False)
                return
            self.messages_sent += len(messages)
            pair.watch(works, self.mgr.config.transfer_timeout_s, functools.partial(self._on_done, i))
        self._sent_at, self._state = time.monotonic(), KVPoll.Transferring

    def _messages(self, pages: torch.Tensor, reg: dict) -> tuple[list[torch.Tensor], dict]:
        """What one registration gets: its heads of the pages in a few
        messages, the aux row if it asked, and the announcement of them."""
        layout, heads = self.mgr.layout, range(reg["heads"][0], sum(reg["heads"]))
        counts = layout.message_pages(pages.numel(), len(heads))
        starts = itertools.accumulate(counts, initial=0)
        messages = [layout.gather(pages[s : s + n], heads) for s, n in zip(starts, counts)]
        aux = reg["aux"] and self._aux_index is not None and layout.aux_bytes > 0
        if aux:
            messages.append(layout.pack_aux(self._aux_index))
        return messages, {"room": self.room, "ok": True, "pages": counts, "aux": layout.aux_bytes if aux else 0}

    def _announce(self, pair: PairGroup, announcement: dict, tag: int) -> None:
        self.mgr.control.push_announcement(pair.pair_id, {**announcement, "tag": tag})

    def _on_done(self, index: int, reason: str | None) -> None:  # a pair's waiter thread
        self._outcomes[index] = reason

    def _poll_transfer(self) -> KVPoll:
        outcomes = list(self._outcomes)
        failed = next((o for o in outcomes if o is not None and o is not _PENDING), None)
        if failed is not None:
            self._fail(failed, notify=False)
        elif all(o is None for o in outcomes):
            self._state = KVPoll.Success
        elif time.monotonic() - self._sent_at > self.mgr.config.transfer_timeout_s + 1.0:  # the waiters should have said
            self._fail(f"not delivered within {self.mgr.config.transfer_timeout_s:.1f} s", notify=False)
        return self._state

    def _fail(self, reason: str, notify: bool = True) -> KVPoll:
        """Fail the room; with ``notify``, unless the data already went out,
        tell the decode ranks that registered it, and those that register it later."""
        if self._state in _TERMINAL:
            return self._state
        self._failure, self._state = KVTransferError(reason, self.room), KVPoll.Failed
        logger.info("%s", self._failure)
        if notify and self._sent_at is None:
            for reg in self._registrations:
                self.mgr.control.announce_abort(reg["pair"], self.room, reason)
            self.mgr.control.give_up_room(self.room, reason)
        return self._state

    def failure_exception(self) -> None:
        raise self._failure or KVTransferError("the transfer has not failed", self.room)

    def abort(self, reason: str | None = None) -> None:
        """Give the room up and tell the decode side, whose half ends at once
        too. After ``send()`` what was posted still goes, into buffers the
        decode side drops (the pairs stay in step); the pages were copied
        out, so the caller may free them at once."""
        reason = reason or "the prefill side aborted the request"
        if self._sent_at is not None and self._state not in _TERMINAL:
            for reg in self._registrations:
                self.mgr.control.abort_sent_room(reg["pair"], self.room, reason)
        self._fail(reason)

    def clear(self) -> None:
        self.mgr.control.forget_sender(self.room)


class TorchDistKVReceiver(BaseKVReceiver):
    """The decode half of room ``bootstrap_room`` (see the module docstring):
    it takes its heads from each source of its link (a prefill rank each of
    the room's dp group), and succeeds once every one of them has delivered.
    Until the prefill server's dp size is known (``link_table.py``) it has
    no link yet; an abort given before then is sent once it has one."""

    def __init__(self, mgr: TorchDistKVManager, bootstrap_addr: str, bootstrap_room: int):
        self.mgr, self.room = mgr, check_room(bootstrap_room)
        self._created = time.monotonic()
        self._inited_at: float | None = None
        self._pages: torch.Tensor | None = None
        self._aux_index: int | None = None
        self._incoming: dict[int, tuple[list[int], list[torch.Tensor], int]] = {}  # by prefill rank
        self._outcomes: dict[int, str | None] = {}  # by prefill rank: None once delivered, else why not
        self._failure: KVTransferError | None = None
        self._state = KVPoll.Bootstrapping
        self._bind_lock = threading.Lock()
        self.link: GroupLink | None = None
        self._unbound_failure: str | None = None  # why no link could be bound
        self._unsent: dict | None = None  # an abort given before the link was bound
        self._cleared = False
        mgr.links.bind(self, bootstrap_addr)  # last: it may call bind() back at once, or from another thread

    def bind(self, link: GroupLink | None, failure: str | None = None) -> None:
        """The manager: the link of this room's dp group, or why there is none."""
        with self._bind_lock:
            self.link, self._unbound_failure = link, failure
            unsent, cleared = self._unsent, self._cleared
        if link is not None and unsent is not None:
            link.send(unsent)
        if link is not None and cleared:
            link.unregister(self.room)

    @property
    def pair_ids(self) -> tuple[int, ...] | None:
        """The pair groups this transfer goes over (one per source), once formed."""
        return self.link.pair_ids if self.link is not None else None

    def init(self, kv_indices, aux_index: int | None = None) -> None:
        if self._state in _TERMINAL:
            return
        if self._inited_at is not None:
            raise RuntimeError(f"init() called twice for room {self.room}")
        self._pages = self.mgr.layout.check_pages(kv_indices)
        self._aux_index, self._inited_at = aux_index, time.monotonic()
        self.link.send({"t": "room", "room": self.room, "pages": self._pages.tolist()})

    def on_announced(self, prefill_rank: int, message_pages: list[int], buffers: list[torch.Tensor],
                     aux_bytes: int) -> None:
        """The link's thread: the receive buffers posted for this room's messages from ``prefill_rank``."""
        self._incoming[prefill_rank] = (message_pages, buffers, aux_bytes)

    def on_done(self, prefill_rank: int, reason: str | None) -> None:
        """A pair's waiter or the link: ``prefill_rank``'s messages arrived (None), or why not."""
        self._outcomes.setdefault(prefill_rank, reason)

    def poll(self) -> KVPoll:
        if self._state in _TERMINAL:
            return self._state
        cfg, outcomes = self.mgr.config, list(self._outcomes.values())
        failed = next((o for o in outcomes if o is not None), None)
        if failed is not None:
            return self._fail(failed)
        if self.link is None:
            if self._unbound_failure is not None:
                return self._fail(self._unbound_failure)
            if time.monotonic() - self._created > cfg.bootstrap_timeout_s:
                return self._fail(f"no pair with the prefill ranks within {cfg.bootstrap_timeout_s:.1f} s")
            return KVPoll.Bootstrapping
        if self.link.ready and len(outcomes) == len(self.link.sources):
            return self._finish()
        if self.link.failure is not None:
            return self._fail(self.link.failure)
        if self._inited_at is None:
            if time.monotonic() - self._created <= cfg.bootstrap_timeout_s:
                return KVPoll.WaitingForInput if self.link.ready else KVPoll.Bootstrapping
            if not self.link.ready:
                return self._fail(f"no pair with the prefill ranks within {cfg.bootstrap_timeout_s:.1f} s")
            # Paired, but the caller never reserved the pages (a decode server
            # holds a request back while its pool is full); by now the prefill
            # side has given the room up too, unless it came later: tell it.
            reason = (f"the decode side held the request back for more than {cfg.bootstrap_timeout_s:.1f} s "
                      "(the bootstrap timeout) without reserving its KV")
            self.link.send({"t": "abort", "room": self.room, "reason": reason})
            return self._fail(reason)
        if time.monotonic() - self._inited_at > cfg.waiting_timeout_s:
            reason = f"no KV arrived within {cfg.waiting_timeout_s:.1f} s"
            self.link.send({"t": "abort", "room": self.room, "reason": reason})
            return self._fail(reason)
        return KVPoll.Transferring if self._incoming else KVPoll.WaitingForInput

    def _finish(self) -> KVPoll:
        """Every source delivered: check what each sent, then write it all into the pool."""
        pages, layout = self._pages, self.mgr.layout
        for source in self.link.sources:
            sent, due = sum(self._incoming[source.prefill_rank][0]), pages.numel() if source.count else 0
            if sent != due:
                return self._fail(f"prefill rank {source.prefill_rank} sent {sent} pages where {due} were due")
        for source in self.link.sources:
            message_pages, buffers, aux_bytes = self._incoming[source.prefill_rank]
            for start, count, buf in zip(itertools.accumulate(message_pages, initial=0), message_pages, buffers):
                layout.scatter(pages[start : start + count], buf, source.dst_heads)
            if aux_bytes and self._aux_index is not None:
                layout.unpack_aux(self._aux_index, buffers[-1])
        self._incoming, self._state = {}, KVPoll.Success
        return self._state

    def _fail(self, reason: str) -> KVPoll:
        self._failure, self._state = KVTransferError(reason, self.room), KVPoll.Failed
        self._incoming = {}
        logger.info("%s", self._failure)
        return self._state

    def failure_exception(self) -> None:
        raise self._failure or KVTransferError("the transfer has not failed", self.room)

    def abort(self, reason: str | None = None) -> None:
        """Give the room up and tell the prefill side, before ``init()`` too:
        its request may be waiting for these pages (the decode side held back
        by a full pool), and it would otherwise wait out its bootstrap timeout."""
        if self._state in _TERMINAL:
            return
        message = {"t": "abort", "room": self.room, "reason": reason or "the request was aborted"}
        with self._bind_lock:
            link = self.link
            if link is None:
                self._unsent = message
        if link is not None:
            link.send(message)
        self._fail(reason or "the decode side aborted the request")

    def clear(self) -> None:
        with self._bind_lock:
            link, self._cleared = self.link, True
        if link is not None:
            link.unregister(self.room)
