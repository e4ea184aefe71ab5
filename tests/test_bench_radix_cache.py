"""The RadixCache micro-benchmark runs and counts what it says."""

from __future__ import annotations

import pytest

from radixserve.bench.radix_cache import make_sequences, run, run_hierarchical


@pytest.mark.parametrize("page_size", [1, 4])
def test_counts_and_evictions(page_size):
    seqs = make_sequences(60, 8, 40, seed=1)
    rec = run(seqs, page_size, evict_tokens=16, evict_calls=5)
    # Every distinct prefix of whole pages is cached once, whatever the tree's shape.
    prefixes = {tuple(s[:n]) for s in seqs for n in range(page_size, len(s) + 1, page_size)}
    assert rec["cached_tokens"] == len(prefixes) * page_size
    assert rec["num_seqs"] == 60 and rec["total_tokens"] == sum(map(len, seqs)) and rec["tree_nodes"] > 60
    assert rec["evict_tokens_per_call"] == 16 and rec["evict_ms_per_call"] > 0
    assert rec["match_hit_fraction"] == pytest.approx(sum(len(s) // page_size * page_size for s in seqs)
                                                      / rec["total_tokens"], abs=1e-4)


@pytest.mark.parametrize("page_size", [1, 4])
def test_hierarchical_eviction_demotes_and_keeps_the_tree(page_size):
    seqs = make_sequences(60, 8, 40, seed=1)
    flat = run(seqs, page_size, evict_tokens=16, evict_calls=5)
    rec = run_hierarchical(seqs, page_size, evict_tokens=16, evict_calls=5)
    assert rec["device_tokens"] == flat["cached_tokens"]  # the same tree, all of it on the device
    # Each call frees at least what it asks for; every node stays, on the host, after its demotion.
    assert 16 * 5 <= rec["evicted_tokens"] < rec["device_tokens"]
    assert rec["tree_nodes"] == flat["tree_nodes"] and rec["evict_ms_per_call"] > 0
