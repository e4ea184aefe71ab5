"""What the prefill and decode servers' parts of a Scheduler share
(``disagg_prefill.py``, ``disagg_decode.py``; docs/disaggregation.md): the
hooks the Scheduler calls (``DisaggregationRole``, a plain server's no-ops),
the KV manager and aux rows, and how the TP ranks agree on where each
transfer stands (``agree_polls``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

import msgpack

from radixserve.disaggregation import get_kv_classes
from radixserve.disaggregation.base import DisaggregationMode, KVPoll, KVTransferError, MetadataBuffers
from radixserve.disaggregation.utils import (
    AuxRows, advertised_host, failure_reason, pool_kv_args, transfer_config_from_env,
)
from radixserve.distributed import TPGroup
from radixserve.managers.io_struct import MAX_TOP_LOGPROBS
from radixserve.managers.schedule_batch import Req


class DisaggregationRole:
    """What a Scheduler asks of its disaggregation part (``Scheduler.disagg``)
    wherever a prefill or a decode server does something of its own. This
    base is a plain server's: no request is ever in transfer, and every hook
    does nothing."""

    mode = DisaggregationMode.NULL

    def take(self, req: Req) -> bool:
        """Start ``req``'s transfer; False: it is served here, as on a plain server."""
        return False

    def queued(self) -> list[Req]:
        """The requests in any transfer queue."""
        return []

    def holding(self) -> list[Req]:
        """Those of them that hold KV and a request row."""
        return []

    def poll(self) -> list[Req]:
        """Move transfers on (at the start of a step); returns the requests that ended or got a token."""
        return []

    def hand_off_prefilled(self, updated: list[Req], prefilled: list[Req]) -> list[Req]:
        """``updated`` (a batch's results) less the prompts, just prefilled, whose KV leaves to be decoded elsewhere."""
        return updated

    def abort(self, rid: str) -> bool:
        """Abort a request in transfer; False if none is ``rid``."""
        return False

    def close(self) -> None:
        """The engine stops: transfers in progress fail."""


class DisaggregationQueues(DisaggregationRole, ABC):
    """A Scheduler's (``s``) requests in transfer, the rows of their first
    tokens' metadata, and the rank's KV manager (over the scheduler's KV
    pool, its KV heads; under TP a decode rank pairs with the prefill ranks
    that hold its heads, whatever the two servers' tp sizes). Under
    ``--dp-size`` a prefill rank registers under its scheduler's replica
    (``Scheduler.dp_rank``) as its dp group. Subclasses hold the queues and say which of their requests
    hold KV (``holding``) and which are in any queue (``queued``). The senders, receivers and the manager
    are the classes of ``--disaggregation-transfer-backend`` (``kv_classes``)."""

    mode: DisaggregationMode

    def __init__(self, scheduler, bootstrap_addr: str | None = None):
        self.s = s = scheduler
        rows = s.req_to_token_pool.size  # every request in transfer also holds a request row
        # the first token's top logprobs: as many as any request may ask (io_struct, a 400 beyond), so none is cut
        self.metadata, self.aux_rows = MetadataBuffers(rows, MAX_TOP_LOGPROBS), AuxRows(rows)
        runner, dp_size = s.model_runner, s.args.dp_size
        dp_rank = s.dp_rank
        kv_args = pool_kv_args(runner.token_to_kv_pool, s.page_size, self.metadata, advertised_host(s.args.host),
                               runner.model_config.num_key_value_heads, s.tp_group.rank, s.tp_group.size,
                               dp_rank, dp_size)
        self.kv_classes = get_kv_classes(s.args.disaggregation_transfer_backend)
        self.kv_manager = self.kv_classes["manager"](kv_args, self.mode, transfer_config_from_env(),
                                                     bootstrap_addr=bootstrap_addr)

    def take(self, req: Req) -> bool:
        if req.bootstrap_room is None:  # no decode server waits for it
            return False
        self.add(req)
        return True

    @abstractmethod
    def add(self, req: Req) -> None:
        """Give ``req``, which names a bootstrap room, its sender or receiver and queue it."""

    @abstractmethod
    def queued(self) -> list[Req]: ...

    @abstractmethod
    def holding(self) -> list[Req]: ...

    def close(self) -> None:
        self.kv_manager.close()


def agree_polls(tp: TPGroup, halves: list) -> list[tuple[KVPoll, str | None]]:
    """Each sender's or receiver's state, the same on every TP rank
    (SGLang's ``poll_and_all_reduce``), with the text of a failure.

    The state is the lowest any rank polled (Failed lowest), so every rank
    moves a request on in the same step and the ranks' batches stay the
    same; a half whose transfer failed on one rank (a timeout, a lost peer,
    an abort its transfer thread noticed) fails on all. Such a half is given
    up on the other ranks too, which tells their peers, with the reason of
    the lowest rank that failed, sent over the group. Every rank calls it
    with the same requests' halves, in the same order."""
    if not halves:
        return []
    # (state, rank) as one number: the minimum is the lowest state and, among
    # the ranks that polled it, the lowest rank, whose reason a failure takes
    mins = tp.agree_mins([int(half.poll()) * tp.size + tp.rank for half in halves])
    states, ranks = [KVPoll(m // tp.size) for m in mins], [m % tp.size for m in mins]
    failed = [i for i, st in enumerate(states) if st == KVPoll.Failed]
    reasons = {}
    for src in sorted({ranks[i] for i in failed}):
        ids = [i for i in failed if ranks[i] == src]
        mine = msgpack.packb([failure_reason(halves[i]) for i in ids]) if tp.rank == src else None
        reasons.update(zip(ids, msgpack.unpackb(tp.broadcast_bytes(mine, src))))
    for i in failed:  # a no-op where it failed (or succeeded) already; elsewhere this rank's peer is told
        halves[i].abort(reasons[i])
    return [(st, str(KVTransferError(reasons[i], halves[i].room)) if i in reasons else None)
            for i, st in enumerate(states)]
