"""Micro-benchmark of the RadixCache: ``match_prefix`` and ``insert``
operations per second over sequences that share prefixes, then ``evict``
calls of ``--evict-tokens`` each on the full tree (what every prefill pays
once a long-running server's pool is full of cached prefixes); then the same
``evict`` calls on the hierarchical cache's tree, every node backed up on the
host, where device eviction demotes nodes and the tree keeps them.

    python -m radixserve.bench.radix_cache [--num-seqs 10000] [--page-sizes 1 16]

Each sequence has U[min_len, max_len] tokens; about half of it (when the
earlier sequence is long enough) repeats the start of an earlier sequence.
Prints two JSON lines per page size.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from radixserve.mem_cache.allocator import TokenToKVPoolAllocator, page_aligned, page_floor
from radixserve.mem_cache.hiradix_cache import HiRadixCache
from radixserve.mem_cache.host_pool import HostKVPool
from radixserve.mem_cache.memory_pool import MHATokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache


def make_sequences(num_seqs: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    seqs: list[list[int]] = []
    for i in range(num_seqs):
        n = int(rng.integers(min_len, max_len + 1))
        fresh = rng.integers(0, 50_000, size=n).tolist()
        if i > 0:
            donor = seqs[int(rng.integers(0, i))]
            shared = min(n // 2, len(donor))
            fresh[:shared] = donor[:shared]
        seqs.append(fresh)
    return seqs


def insert_all(cache: RadixCache, alloc: TokenToKVPoolAllocator, seqs: list[list[int]]) -> float:
    """Insert every sequence on fresh slots; returns the seconds the inserts took."""
    page_size = cache.page_size
    values = [alloc.alloc(len(s)) for s in seqs]
    t0 = time.perf_counter()
    present = [cache.insert(s, v) for s, v in zip(seqs, values)]
    elapsed = time.perf_counter() - t0
    for s, v, n in zip(seqs, values, present):  # what the tree did not take: duplicates, a partial last page
        alloc.free(torch.cat([v[:n], v[page_floor(len(s), page_size) :]]))
    return elapsed


def time_evictions(cache, tokens: int, calls: int) -> tuple[int, float]:
    """``calls`` evictions of ``tokens`` each: the tokens freed, and ms a call."""
    t0 = time.perf_counter()
    evicted = sum(cache.evict(tokens) for _ in range(calls))
    return evicted, round((time.perf_counter() - t0) / calls * 1e3, 4)


def run(seqs: list[list[int]], page_size: int, evict_tokens: int = 64, evict_calls: int = 200) -> dict:
    alloc = TokenToKVPoolAllocator(sum(page_aligned(len(s), page_size) for s in seqs), page_size)
    cache = RadixCache(None, alloc, page_size=page_size)
    t_insert = insert_all(cache, alloc, seqs)
    t0 = time.perf_counter()
    matched = sum(len(cache.match_prefix(s).device_indices) for s in seqs)
    t_match = time.perf_counter() - t0
    total = sum(len(s) for s in seqs)
    nodes = sum(1 for _ in cache._nodes()) - 1
    evicted, evict_ms = time_evictions(cache, evict_tokens, evict_calls)
    return {
        "bench": "radix_cache",
        "page_size": page_size,
        "num_seqs": len(seqs),
        "total_tokens": total,
        "cached_tokens": cache.total_size() + evicted,
        "tree_nodes": nodes,
        "insert_ops_per_s": round(len(seqs) / t_insert, 1),
        "match_ops_per_s": round(len(seqs) / t_match, 1),
        "insert_tokens_per_s": round(total / t_insert),
        "match_tokens_per_s": round(matched / t_match),
        "match_hit_fraction": round(matched / total, 4),
        "evict_tokens_per_call": evict_tokens,
        "evict_ms_per_call": evict_ms,
    }


def run_hierarchical(seqs: list[list[int]], page_size: int, evict_tokens: int = 64, evict_calls: int = 200) -> dict:
    """``evict`` calls on a HiRadixCache (``write_through``: every node has a
    host copy, so each call demotes nodes and the tree keeps them all)."""
    size = sum(page_aligned(len(s), page_size) for s in seqs)
    alloc = TokenToKVPoolAllocator(size, page_size)
    kv = MHATokenToKVPool(size, page_size, torch.float16, head_num=1, head_dim=1, layer_num=1)
    cache = HiRadixCache(None, alloc, page_size, HostKVPool(kv, size), "write_through")
    insert_all(cache, alloc, seqs)
    cache.poll()  # the backups are done
    on_device = cache.evictable_size()
    evicted, evict_ms = time_evictions(cache, evict_tokens, evict_calls)
    return {
        "bench": "hiradix_cache_evict",
        "page_size": page_size,
        "num_seqs": len(seqs),
        "device_tokens": on_device,
        "evicted_tokens": evicted,
        "tree_nodes": sum(1 for _ in cache._nodes()) - 1,
        "evict_tokens_per_call": evict_tokens,
        "evict_ms_per_call": evict_ms,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-seqs", type=int, default=10_000)
    parser.add_argument("--min-len", type=int, default=1024)
    parser.add_argument("--max-len", type=int, default=4096)
    parser.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--evict-tokens", type=int, default=64, help="tokens each timed evict call asks for")
    parser.add_argument("--evict-calls", type=int, default=200)
    args = parser.parse_args(argv)
    seqs = make_sequences(args.num_seqs, args.min_len, args.max_len, args.seed)
    for p in args.page_sizes:
        print(json.dumps(run(seqs, p, args.evict_tokens, args.evict_calls)), flush=True)
        print(json.dumps(run_hierarchical(seqs, p, args.evict_tokens, args.evict_calls)), flush=True)


if __name__ == "__main__":
    main()
