"""The RadixCache micro-benchmark runs and counts what it says."""

from __future__ import annotations

import pytest

from radixserve.bench.radix_cache import make_sequences, run


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
