"""The torch.distributed transfer backend: point-to-point sends between a
prefill rank and a decode rank (gloo over TCP for CPU pools, NCCL for CUDA).

Protocol (docs/disaggregation.md has the whole picture):

- The prefill rank's :class:`PrefillControl` hosts a ``TCPStore`` at its
  transfer address, registers it with the bootstrap server and pops the
  store's control queue (pair requests, rooms' pages, aborts).
- A decode rank keeps one :class:`DecodeLink` per bootstrap address: the
  handshake, the pair group, the announcement listener.
- A sender whose room has been registered, on a formed pair, is ready
  (WaitingForInput). ``send()`` gathers the pages into a few messages, pushes
  an announcement ``{room, tag, pages per message, aux bytes}`` on the pair's
  announcement queue and posts the sends, both under the pair's lock, so the
  decode side posts its receives in the same order. The aux message (row
  ``aux_index`` of the aux buffers) goes last.
- The decode receiver scatters the messages into its pages in ``poll()``,
  on the caller's thread, and only on success.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from radixserve.disaggregation.base import (
    BaseKVManager, BaseKVReceiver, BaseKVSender, DisaggregationMode, KVArgs, KVPoll, KVTransferConfig,
    KVTransferError, check_room,
)
from radixserve.disaggregation.decode_link import DecodeLink
from radixserve.disaggregation.kv_messages import KVMessageLayout
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
        self._lock = threading.Lock()
        self._closed = False
        if self.mode == DisaggregationMode.DECODE:
            self._links: dict[str, DecodeLink] = {}
            return
        if self.mode != DisaggregationMode.PREFILL or bootstrap_addr is None:
            raise ValueError("a KV manager is for the prefill side (with a bootstrap_addr) or the decode side")
        self.control = PrefillControl(args, self.config, bootstrap_addr)

    def register_to_bootstrap(self) -> None:
        if self.mode == DisaggregationMode.PREFILL:
            self.control.register_to_bootstrap()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        if self.mode == DisaggregationMode.PREFILL:
            self.control.close()
            return
        for link in list(self._links.values()):
            link.close()

    def link(self, receiver: TorchDistKVReceiver, bootstrap_addr: str) -> DecodeLink:
        """Decode side: the live link to the prefill rank behind
        ``bootstrap_addr`` (a new one after the last one failed), with
        ``receiver`` bound to it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV manager is closed")
            link = self._links.get(bootstrap_addr)
            if link is None or not link.bind(receiver):
                link = self._links[bootstrap_addr] = DecodeLink(self, bootstrap_addr, receiver)
            return link

    def forget_link(self, link: DecodeLink) -> None:
        with self._lock:
            if self._links.get(link.bootstrap_addr) is link:
                del self._links[link.bootstrap_addr]


class TorchDistKVSender(BaseKVSender):
    """The prefill half of room ``bootstrap_room`` (see the module docstring).
    ``messages_sent`` counts the messages ``send()`` posted."""

    def __init__(self, mgr: TorchDistKVManager, bootstrap_addr: str, bootstrap_room: int):
        self.mgr, self.room = mgr, check_room(bootstrap_room)
        self._created = time.monotonic()
        self._num_pages: int | None = None
        self._aux_index: int | None = None
        self._registration: dict | None = None
        self._pair: PairGroup | None = None
        self._sent_at: float | None = None
        self._outcome = _PENDING
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
        registration, gone = self.mgr.control.claim_room(self)
        if gone is not None:
            return self._fail(gone, notify=False)
        if self._registration is None:
            self._registration = registration
            if registration is None:
                return self._wait_bootstrap("no decode rank registered for it")
            mismatch = self._check_registration()
            if mismatch:
                return self._fail(mismatch)
        pair = self.mgr.control.pair(self._registration["pair"])
        if isinstance(pair, str) or (pair is not None and pair.dead):
            return self._fail(pair if isinstance(pair, str) else pair.dead, notify=False)
        if pair is None:
            return self._wait_bootstrap(f"pair {self._registration['pair']} with the decode rank did not form")
        self._pair, self._state = pair, KVPoll.WaitingForInput
        return self._state

    def _wait_bootstrap(self, what: str) -> KVPoll:
        if time.monotonic() - self._created > self.mgr.config.bootstrap_timeout_s:
            return self._fail(f"{what} within {self.mgr.config.bootstrap_timeout_s:.1f} s")
        return KVPoll.Bootstrapping

    def _check_registration(self) -> str | None:
        pages = len(self._registration["pages"])
        if self._num_pages is not None and pages != self._num_pages:
            return f"the decode side reserved {pages} pages for {self._num_pages} pages of KV"
        return None

    def send(self, kv_indices) -> None:
        if self._state == KVPoll.Failed:
            return
        if self._state != KVPoll.WaitingForInput:
            raise RuntimeError(f"send() on room {self.room} in state {self._state.name}; poll() must return WaitingForInput first")
        layout, pair, reg = self.mgr.layout, self._pair, self._registration
        try:
            pages = layout.check_pages(kv_indices)
        except ValueError as e:
            self._fail(f"bad page indices: {e}")
            raise
        if pages.numel() != len(reg["pages"]):
            self._fail(f"send() got {pages.numel()} pages for the {len(reg['pages'])} the decode side reserved")
            return
        counts = layout.message_pages(pages.numel())
        starts = [sum(counts[:i]) for i in range(len(counts))]
        messages = [layout.gather(pages[s : s + n]) for s, n in zip(starts, counts)]
        aux = self._aux_index is not None and layout.aux_bytes > 0
        if aux:
            messages.append(layout.pack_aux(self._aux_index))
        announcement = {"room": self.room, "ok": True, "pages": counts, "aux": layout.aux_bytes if aux else 0}
        try:
            works = pair.post(messages, send=True,
                              announce=lambda tag: self.mgr.control.push_announcement(pair.pair_id, {**announcement, "tag": tag}))
        except RuntimeError as e:
            self._fail(str(e), notify=False)
            return
        self.messages_sent = len(messages)
        self._sent_at, self._state = time.monotonic(), KVPoll.Transferring
        pair.watch(works, self.mgr.config.transfer_timeout_s, self._on_done)

    def _on_done(self, reason: str | None) -> None:  # the pair's waiter thread
        self._outcome = reason

    def _poll_transfer(self) -> KVPoll:
        outcome = self._outcome
        if outcome is None:
            self._state = KVPoll.Success
        elif outcome is not _PENDING:
            self._fail(outcome, notify=False)
        elif time.monotonic() - self._sent_at > self.mgr.config.transfer_timeout_s + 1.0:  # the waiter should have said
            self._fail(f"not delivered within {self.mgr.config.transfer_timeout_s:.1f} s", notify=False)
        return self._state

    def _fail(self, reason: str, notify: bool = True) -> KVPoll:
        """Fail the room; with ``notify``, tell the decode side (now, or when
        its registration comes) unless the data already went out."""
        if self._state in _TERMINAL:
            return self._state
        self._failure, self._state = KVTransferError(reason, self.room), KVPoll.Failed
        logger.info("%s", self._failure)
        if notify and self._sent_at is None:
            if self._registration is not None:
                self.mgr.control.announce_abort(self._registration["pair"], self.room, reason)
            else:
                self.mgr.control.give_up_room(self.room, reason)
        return self._state

    def failure_exception(self) -> None:
        raise self._failure or KVTransferError("the transfer has not failed", self.room)

    def abort(self, reason: str | None = None) -> None:
        """Give the room up. Before ``send()`` the decode side is told; after
        it, the room fails here only and what was sent is still delivered
        (the pages were copied out, so the caller may free them at once)."""
        self._fail(reason or "the prefill side aborted the request")

    def clear(self) -> None:
        self.mgr.control.forget_sender(self.room)


class TorchDistKVReceiver(BaseKVReceiver):
    """The decode half of room ``bootstrap_room`` (see the module docstring)."""

    def __init__(self, mgr: TorchDistKVManager, bootstrap_addr: str, bootstrap_room: int):
        self.mgr, self.room = mgr, check_room(bootstrap_room)
        self._created = time.monotonic()
        self._inited_at: float | None = None
        self._pages: torch.Tensor | None = None
        self._aux_index: int | None = None
        self._incoming: tuple[list[int], list[torch.Tensor], int] | None = None
        self._outcome = _PENDING
        self._failure: KVTransferError | None = None
        self._state = KVPoll.Bootstrapping
        self.link = mgr.link(self, bootstrap_addr)  # last: the link's thread may call this receiver back at once

    @property
    def pair_id(self) -> int | None:
        """The pair group this transfer goes over, once formed."""
        return self.link.pair.pair_id if self.link.pair is not None else None

    def init(self, kv_indices, aux_index: int | None = None) -> None:
        if self._state in _TERMINAL:
            return
        if self._inited_at is not None:
            raise RuntimeError(f"init() called twice for room {self.room}")
        self._pages = self.mgr.layout.check_pages(kv_indices)
        self._aux_index, self._inited_at = aux_index, time.monotonic()
        self.link.send({"t": "room", "room": self.room, "pages": self._pages.tolist()})

    def on_announced(self, message_pages: list[int], buffers: list[torch.Tensor], aux_bytes: int) -> None:
        """The link's thread: the receive buffers posted for this room."""
        self._incoming = (message_pages, buffers, aux_bytes)

    def on_done(self, reason: str | None) -> None:
        """The pair's waiter or the link: the messages arrived (None), or why not."""
        if self._outcome is _PENDING:
            self._outcome = reason

    def poll(self) -> KVPoll:
        if self._state in _TERMINAL:
            return self._state
        cfg, outcome = self.mgr.config, self._outcome
        if outcome is None:
            return self._finish()
        if outcome is not _PENDING:
            return self._fail(outcome)
        if self.link.failure is not None:
            return self._fail(self.link.failure)
        if self._inited_at is None:
            if time.monotonic() - self._created <= cfg.bootstrap_timeout_s:
                return KVPoll.WaitingForInput if self.link.ready else KVPoll.Bootstrapping
            if not self.link.ready:
                return self._fail(f"no pair with the prefill rank within {cfg.bootstrap_timeout_s:.1f} s")
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
        return KVPoll.Transferring if self._incoming is not None else KVPoll.WaitingForInput

    def _finish(self) -> KVPoll:
        message_pages, buffers, aux_bytes = self._incoming
        if sum(message_pages) != self._pages.numel():
            return self._fail(f"the prefill side sent {sum(message_pages)} pages for the {self._pages.numel()} reserved")
        start = 0
        for count, buf in zip(message_pages, buffers):
            self.mgr.layout.scatter(self._pages[start : start + count], buf)
            start += count
        if aux_bytes and self._aux_index is not None:
            self.mgr.layout.unpack_aux(self._aux_index, buffers[-1])
        self._incoming, self._state = None, KVPoll.Success
        return self._state

    def _fail(self, reason: str) -> KVPoll:
        self._failure, self._state = KVTransferError(reason, self.room), KVPoll.Failed
        self._incoming = None
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
        self.link.send({"t": "abort", "room": self.room, "reason": reason or "the request was aborted"})
        self._fail(reason or "the decode side aborted the request")

    def clear(self) -> None:
        self.link.unregister(self.room)
