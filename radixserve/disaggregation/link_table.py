"""A decode rank's table of links to prefill servers, for the torch.distributed backend.

A prefill server of ``--dp-size`` D serves room ``r`` on its replica (dp
group) ``r % D`` (its TokenizerManager dispatches by room), so that is where
the room's KV lies. A decode rank keeps one :class:`GroupLink`
(``group_link.py``) per (bootstrap address, dp group), made when the first
room of that group comes and shared by the later ones; a decode rank may
hold links to several groups of one server, and a group whose link failed
gets a new one while the links to the other groups live on.

D itself is looked up once per address: the entry of rank 0 of dp group 0
(``GET /route?engine_rank=0&target_dp_group=0``) carries it. The look-up runs
in a thread of its own, asked again while that rank has not registered (a
prefill server still starting) until the connect timeout, so that making a
receiver never blocks: receivers made before D is known wait unbound and are
bound to their group's link, or failed, once the look-up ends. A link that
fails makes the address's D be looked up again for the next room (the server
may have restarted with another ``--dp-size``).
"""

from __future__ import annotations

import threading
import time

from radixserve.disaggregation.base import KVTransferError
from radixserve.disaggregation.bootstrap import wait_for_prefill_rank
from radixserve.disaggregation.group_link import GroupLink, LinkOwner, RoomReceiver


class LinkTable:
    """See the module docstring. Owned by a decode ``TorchDistKVManager``."""

    def __init__(self, mgr: LinkOwner):
        self.mgr = mgr
        self._lock = threading.Lock()
        self._closed = False
        self._links: dict[tuple[str, int], GroupLink] = {}  # by (bootstrap address, dp group)
        self._dp_sizes: dict[str, int] = {}  # a prefill server's dp size, by bootstrap address
        self._unbound: dict[str, list[RoomReceiver]] = {}  # waiting for their address's dp size

    def bind(self, rx: RoomReceiver, bootstrap_addr: str) -> None:
        """Bind ``rx`` to the live link of its room's dp group behind
        ``bootstrap_addr`` (``rx.bind``), now when the server's dp size is
        known, else once it has been looked up."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the KV manager is closed")
            dp_size = self._dp_sizes.get(bootstrap_addr)
            if dp_size is None:
                unbound = self._unbound.setdefault(bootstrap_addr, [])
                unbound.append(rx)
                if len(unbound) == 1:
                    threading.Thread(target=self._look_up, args=(bootstrap_addr,), daemon=True,
                                     name=f"kv-dp-size-{bootstrap_addr}").start()
                return
            link = self._link(rx, bootstrap_addr, dp_size)
        rx.bind(link)

    def _link(self, rx: RoomReceiver, bootstrap_addr: str, dp_size: int) -> GroupLink:
        """The live link of ``rx``'s group, with ``rx`` bound to it (a new one
        after the last one failed). Called with the lock held."""
        key = (bootstrap_addr, rx.room % dp_size)
        link = self._links.get(key)
        if link is None or not link.bind(rx):
            link = self._links[key] = GroupLink(self.mgr, bootstrap_addr, key[1], dp_size, rx)
        return link

    def _look_up(self, bootstrap_addr: str) -> None:
        cfg = self.mgr.config
        failure = None
        try:
            entry = wait_for_prefill_rank(bootstrap_addr, 0, 0, time.monotonic() + cfg.connect_timeout_s,
                                          cfg.http_timeout_s, stop=lambda: self._closed)
        except KVTransferError as e:
            failure = f"could not pair with the prefill server behind {bootstrap_addr}: {e.reason}"
        with self._lock:
            unbound = self._unbound.pop(bootstrap_addr, [])
            if self._closed:
                failure = "the KV manager was closed"
            if failure is None:
                self._dp_sizes[bootstrap_addr] = entry["dp_size"]
                bound = [(rx, self._link(rx, bootstrap_addr, entry["dp_size"])) for rx in unbound]
            else:
                bound = [(rx, None) for rx in unbound]
        for rx, link in bound:
            rx.bind(link, failure)

    def forget(self, link: GroupLink) -> None:
        """Drop a failed link, and what its address's dp size was."""
        with self._lock:
            if self._links.get(link.key) is link:
                del self._links[link.key]
                self._dp_sizes.pop(link.bootstrap_addr, None)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.close()
