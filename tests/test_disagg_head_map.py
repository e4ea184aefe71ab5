"""The KV head mapping between a prefill and a decode server of different tp
sizes (radixserve/disaggregation/head_map.py), without a model: which
prefill ranks each decode rank takes which heads from, and where they land."""

from __future__ import annotations

import itertools

import pytest

from radixserve.disaggregation.head_map import HeadSlice, decode_sources, rank_kv_heads, registrations_expected


def sources(num_kv_heads: int, prefill_tp: int, decode_tp: int) -> list[list[tuple]]:
    """Each decode rank's sources as (prefill rank, src start, dst start, count, aux) tuples."""
    return [[(s.prefill_rank, s.src_start, s.dst_start, s.count, s.aux)
             for s in decode_sources(num_kv_heads, prefill_tp, decode_tp, d)] for d in range(decode_tp)]


@pytest.mark.parametrize("prefill_tp, decode_tp, want", [
    (1, 1, [[(0, 0, 0, 4, True)]]),
    # tp 1 -> 2: both decode ranks read the one prefill rank, each its half of the heads
    (1, 2, [[(0, 0, 0, 2, True)], [(0, 2, 0, 2, True)]]),
    # tp 2 -> 1: the decode rank reads both prefill ranks, the second's heads after the first's
    (2, 1, [[(0, 0, 0, 2, True), (1, 0, 2, 2, False)]]),
    # tp 2 -> 4: each prefill rank's two heads go one to each of two decode ranks
    (2, 4, [[(0, 0, 0, 1, True)], [(0, 1, 0, 1, True)], [(1, 0, 0, 1, True)], [(1, 1, 0, 1, True)]]),
    # tp 4 -> 2: each decode rank reads two prefill ranks, a head each
    (4, 2, [[(0, 0, 0, 1, True), (1, 0, 1, 1, False)], [(2, 0, 0, 1, True), (3, 0, 1, 1, False)]]),
])
def test_four_kv_heads(prefill_tp, decode_tp, want):
    assert sources(4, prefill_tp, decode_tp) == want


def test_two_kv_heads_replicated_at_tp_4():
    # prefill tp 4: heads 0, 0, 1, 1 on ranks 0..3; the second replica of each head only hears of the rooms
    assert sources(2, 4, 1) == [[(0, 0, 0, 1, True), (2, 0, 1, 1, False), (1, 0, 0, 0, False), (3, 0, 0, 0, False)]]
    assert sources(2, 4, 2) == [[(0, 0, 0, 1, True), (1, 0, 0, 0, False)], [(2, 0, 0, 1, True), (3, 0, 0, 0, False)]]
    assert [registrations_expected(2, 4, 2, p) for p in range(4)] == [1, 1, 1, 1]
    # replicated on both sides: replica i of a head sends to decode replica i
    assert sources(2, 4, 4) == [[(p, 0, 0, 1, True)] for p in range(4)]
    # decode tp 4 from prefill tp 1 and 2: the replicas of a head read the same prefill head
    assert sources(2, 1, 4) == [[(0, 0, 0, 1, True)], [(0, 0, 0, 1, True)], [(0, 1, 0, 1, True)], [(0, 1, 0, 1, True)]]
    assert [registrations_expected(2, 1, 4, 0)] == [4]
    assert sources(2, 2, 4) == [[(0, 0, 0, 1, True)], [(0, 0, 0, 1, True)], [(1, 0, 0, 1, True)], [(1, 0, 0, 1, True)]]
    assert [registrations_expected(2, 2, 4, p) for p in range(2)] == [2, 2]


def test_three_replicas_read_by_two_decode_ranks_spread_the_dummies():
    # 2 heads at prefill tp 6 (3 replicas each) and decode tp 4 (2 readers each): replica 2 is a dummy,
    # told by reader 2 mod 2 = 0 of its head
    got = sources(2, 6, 4)
    assert got == [[(0, 0, 0, 1, True), (2, 0, 0, 0, False)], [(1, 0, 0, 1, True)],
                   [(3, 0, 0, 1, True), (5, 0, 0, 0, False)], [(4, 0, 0, 1, True)]]


SHAPES = [(h, p, d) for h, p, d in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8))
          if (h % p == 0 or p % h == 0) and (h % d == 0 or d % h == 0)] + [(2, 6, 4), (6, 3, 2), (3, 6, 1)]


@pytest.mark.parametrize("num_kv_heads, prefill_tp, decode_tp", SHAPES)
def test_every_decode_head_comes_once_from_a_prefill_rank_holding_it(num_kv_heads, prefill_tp, decode_tp):
    told = set()
    for d in range(decode_tp):
        mine = rank_kv_heads(num_kv_heads, decode_tp, d)
        got = decode_sources(num_kv_heads, prefill_tp, decode_tp, d)
        assert len({s.prefill_rank for s in got}) == len(got), "one link per prefill rank"
        assert sum(s.aux for s in got) == 1 and got[0].aux and got[0].count > 0, "one source sends the aux row"
        filled = {}
        for s in got:
            theirs = rank_kv_heads(num_kv_heads, prefill_tp, s.prefill_rank)
            assert s.src_heads.stop <= len(theirs) and s.dst_heads.stop <= len(mine)
            for src, dst in zip(s.src_heads, s.dst_heads):
                assert dst not in filled
                filled[dst] = theirs[src]
            told.add(s.prefill_rank)
        assert filled == dict(enumerate(mine)), "each local head holds the model's head it should"
    assert told == set(range(prefill_tp)), "every prefill rank hears of every room"
    registered = sum(len(decode_sources(num_kv_heads, prefill_tp, decode_tp, d)) for d in range(decode_tp))
    assert sum(registrations_expected(num_kv_heads, prefill_tp, decode_tp, p) for p in range(prefill_tp)) == registered


def test_a_head_count_that_does_not_split_is_refused():
    with pytest.raises(ValueError, match="num_key_value_heads 3 and tp_size 2 do not divide"):
        decode_sources(3, 1, 2, 0)
    assert HeadSlice(1, 2, 0, 2).src_heads == range(2, 4)
