"""Which prefill ranks a decode rank takes its KV heads from, when the two
servers run different tp sizes.

Both servers split the model's KV heads as ``distributed/partition.py`` does:
with at least as many heads as ranks, rank ``r`` holds a contiguous block of
``num_kv_heads / tp`` heads; with fewer, each rank holds one head, replicated
on ``tp / num_kv_heads`` consecutive ranks. So a decode rank's heads may lie
on several prefill ranks (prefill tp larger), or several decode ranks may
need heads of one prefill rank (decode tp larger), or a head may lie on
several prefill ranks and be needed by several decode ranks (replicated).

Per head, its decode holders take it from its prefill holders in turn
(decode holder ``i`` from prefill holder ``i mod n``), which spreads the
load over the replicas. A prefill holder no decode rank reads from is still
told every room, by one of the head's decode holders, as a *dummy* source
(no heads): every prefill rank then knows each room and how many decode
ranks will register it (:func:`registrations_expected`), so its half ends
with the others. Pure arithmetic; tests/test_disagg_head_map.py checks it
over many shapes.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.distributed.partition import head_layout


@dataclass(frozen=True)
class HeadSlice:
    """What one prefill rank sends one decode rank: the prefill rank's
    local KV heads ``src_start .. src_start + count - 1`` land at the decode
    rank's local heads from ``dst_start``. ``count`` 0 is a dummy source (it
    sends nothing but is told the room); ``aux`` marks the one source of a
    decode rank that also sends the first token's aux row."""

    prefill_rank: int
    src_start: int
    dst_start: int
    count: int
    aux: bool = False

    @property
    def src_heads(self) -> range:
        return range(self.src_start, self.src_start + self.count)

    @property
    def dst_heads(self) -> range:
        return range(self.dst_start, self.dst_start + self.count)


def rank_kv_heads(num_kv_heads: int, tp_size: int, tp_rank: int) -> range:
    """The model's KV heads that TP rank ``tp_rank`` holds, as the model's
    layers split them; ValueError when ``num_kv_heads`` and ``tp_size`` do
    not divide one another."""
    # the query heads play no part here: one per rank always divides
    layout = head_layout(tp_size, num_kv_heads, tp_size, tp_rank)
    return range(layout.kv_head_start, layout.kv_head_start + layout.num_kv_heads)


def _holders(num_kv_heads: int, tp_size: int) -> list[list[int]]:
    """For each head, the ranks that hold it, in rank order."""
    held = [rank_kv_heads(num_kv_heads, tp_size, r) for r in range(tp_size)]
    return [[r for r in range(tp_size) if head in held[r]] for head in range(num_kv_heads)]


def decode_sources(num_kv_heads: int, prefill_tp: int, decode_tp: int, decode_rank: int) -> list[HeadSlice]:
    """The sources of decode rank ``decode_rank``: the slices that fill its
    heads, by ``dst_start`` (the first carries the aux row), then its dummy
    sources. Each prefill rank appears at most once."""
    senders, receivers = _holders(num_kv_heads, prefill_tp), _holders(num_kv_heads, decode_tp)
    runs: list[list[int]] = []  # [prefill rank, src start, dst start, count], contiguous on both sides
    dummies: list[int] = []
    for dst, head in enumerate(rank_kv_heads(num_kv_heads, decode_tp, decode_rank)):
        replicas, readers = senders[head], receivers[head]
        rank = replicas[readers.index(decode_rank) % len(replicas)]
        src = rank_kv_heads(num_kv_heads, prefill_tp, rank).index(head)
        if runs and runs[-1][0] == rank and runs[-1][1] + runs[-1][3] == src:
            runs[-1][3] += 1
        else:
            runs.append([rank, src, dst, 1])
        # replicas beyond the readers' count send nothing; reader j mod n tells replica j the rooms
        dummies += [r for j, r in enumerate(replicas) if j >= len(readers) and readers[j % len(readers)] == decode_rank]
    slices = [HeadSlice(rank, src, dst, count, aux=i == 0) for i, (rank, src, dst, count) in enumerate(runs)]
    return slices + [HeadSlice(rank, 0, 0, 0) for rank in dummies]


def registrations_expected(num_kv_heads: int, prefill_tp: int, decode_tp: int, prefill_rank: int) -> int:
    """How many decode ranks register each room with prefill rank
    ``prefill_rank`` (SGLang's ``required_dst_info_num``)."""
    return sum(any(s.prefill_rank == prefill_rank for s in decode_sources(num_kv_heads, prefill_tp, decode_tp, d))
               for d in range(decode_tp))
