"""The torch.distributed backend's control plane: the queues and keys on each
prefill rank's ``TCPStore`` through which its decode ranks and it talk, and
the store calls both sides make (``prefill_control.py`` on the prefill side,
``group_link.py`` on the decode side; docs/disaggregation.md).

- ``CONTROL_QUEUE``: decode -> prefill (pair requests, rooms' registrations, aborts);
- ``announcement_queue(n)``: prefill -> decode on pair ``n`` (each room's
  messages, or why it will not be sent);
- ``sent_abort_key(n, room)``: set when the prefill side gives a room up
  after its sends were posted.
"""

from __future__ import annotations

from datetime import timedelta

import msgpack
import torch.distributed as dist

CONTROL_QUEUE = "ctl"  # on the prefill rank's store: decode -> prefill messages
# A listening thread blocks on its queue this long before it pops again (c10d
# logs every pop that times out, so it is long); close() wakes it with a stop message.
LISTEN_TIMEOUT_S = 300.0
STOP = {"t": "stop"}


def announcement_queue(pair_id: int) -> str:
    """The store queue of pair ``pair_id``'s announcements (prefill -> decode)."""
    return f"pair/{pair_id}/ann"


def sent_abort_key(pair_id: int, room: int) -> str:
    """The store key that says the prefill side gave ``room`` up after its sends were posted on pair ``pair_id``."""
    return f"pair/{pair_id}/aborted/{room}"


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
