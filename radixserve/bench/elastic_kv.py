"""What the elastic KV pool's memory costs (docs/elastic_kv.md): map and
unmap rates of its pages in GB/s, and the latency of an allocation that
needs a new page, taken from the reserve (no driver call) or mapped on the
spot. The pool has a model's geometry: ``--layers`` K and V buffers of
``--kv-heads`` x ``--head-dim`` slots in ``--dtype`` (llama-3.1-8b's by
default), in elastic pages of ``--page-mb`` per buffer.

    python -m radixserve.bench.elastic_kv [--device cuda] [--pages 64]

Prints one JSON line per figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch

from radixserve.bench import sync
from radixserve.feature_args import ElasticKVConfig
from radixserve.mem_cache.elastic_allocator import build_elastic_pool


DEFAULT_PAGES = 64  # pages mapped for the rates, where the memory holds them


def map_rates(arena, pages: int) -> dict:
    """Map then unmap ``pages`` pages, one call each."""
    device_bytes = arena.bytes_per_page * pages
    first = max(arena.stats.mapped, default=0) + 1
    start = time.perf_counter()
    for page in range(first, first + pages):
        if not arena.map(page):
            raise RuntimeError(f"page {page} could not be mapped: {arena.physical_free() / 2**30:.1f} GiB free, "
                               f"{arena.bytes_per_page / 2**20:.0f} MiB a page; ask for fewer --pages or --layers")
    mapped = time.perf_counter() - start
    start = time.perf_counter()
    for page in range(first, first + pages):
        arena.unmap(page)
    unmapped = time.perf_counter() - start
    return {"pages": pages, "page_mb": arena.bytes_per_page / 2**20,
            "map_gb_per_s": round(device_bytes / mapped / 1e9, 2), "unmap_gb_per_s": round(device_bytes / unmapped / 1e9, 2),
            "map_ms_per_page": round(1e3 * mapped / pages, 3), "unmap_ms_per_page": round(1e3 * unmapped / pages, 3)}


def alloc_latency(allocator, reserve: int, rounds: int) -> dict:
    """Median time of ``alloc`` of one elastic page's slots when ``reserve``
    pages were mapped ahead by the mapper's thread (0: none, the page is
    mapped inside the call)."""
    allocator.min_reserve = allocator.max_reserve = reserve
    times = []
    for _ in range(rounds):
        allocator.rebalance()
        if not reserve:  # the reserve follows the pace of recent steps: drop it to time a map on the spot
            allocator.shrink(len(allocator.mapped_epages()), lambda n: 0)
        allocator.mapper.drain()  # the thread had a step's time or more
        start = time.perf_counter()
        slots = allocator.alloc(allocator.epage_slots)
        times.append(time.perf_counter() - start)
        allocator.free(slots)
        allocator.rebalance()
    return {"reserve_pages": reserve, "alloc_ms_median": round(1e3 * statistics.median(times), 3),
            "alloc_ms_max": round(1e3 * max(times), 3)}


def contention(allocator, seconds: float = 2.0) -> dict:
    """What the mapper's thread costs the scheduler's thread while it maps:
    Python loop turns per second (the GIL) and, on CUDA, matmuls per second
    on the default stream (the driver and the device), with the thread idle
    and with it mapping pages back to back (unmapped again in between)."""
    device = allocator.device
    a = torch.randn(2048, 2048, device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)

    def rates() -> tuple[float, float]:
        turns, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            turns += 1
        python = turns / (time.perf_counter() - start)
        sync(device)
        mms, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds / 2:
            a @ a
            mms += 1
            if mms % 16 == 0:
                sync(device)
        sync(device)
        return python, mms / (time.perf_counter() - start)

    idle = rates()
    pages = [e for e in range(1, allocator.num_epages) if not allocator.arena.is_mapped(e)][:32]
    stop, maps = [False], [0]

    def churn():  # as busy as the mapper can be: map ahead, drain, give back, again
        while not stop[0]:
            allocator.mapper.map_ahead(pages)
            allocator.mapper.drain()
            maps[0] += len(pages)
            allocator.mapper.unmap(pages)
            allocator.mapper.drain()

    worker = threading.Thread(target=churn)
    worker.start()
    busy = rates()
    stop[0] = True
    worker.join()
    return {"python_turns_per_s_idle": round(idle[0]), "python_turns_per_s_mapping": round(busy[0]),
            "matmuls_per_s_idle": round(idle[1], 1), "matmuls_per_s_mapping": round(busy[1], 1),
            "pages_mapped_meanwhile": maps[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--page-mb", type=float, default=ElasticKVConfig.page_mb)
    parser.add_argument("--pages", type=int, default=None,
                        help="pages mapped and unmapped for the rates (default: 64, or as many as half the free "
                             "memory holds where that is fewer, as on a small CPU machine)")
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    slot_bytes = args.kv_heads * args.head_dim * dtype.itemsize
    epage_slots = int(args.page_mb * 2**20) // slot_bytes
    size = ((args.pages or DEFAULT_PAGES) + 4) * epage_slots
    config = ElasticKVConfig(page_mb=args.page_mb, min_reserve_pages=0, max_reserve_pages=0)
    pool, allocator = build_elastic_pool(size, 1, dtype, args.kv_heads, args.head_dim, args.layers, device, config)
    common = {"device": str(device), "layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim,
              "dtype": args.dtype}
    pages = args.pages or max(1, min(DEFAULT_PAGES, pool.arena.physical_free() // 2 // pool.arena.bytes_per_page))
    try:
        print(json.dumps({"bench": "elastic_kv_map_rates", **common, **map_rates(pool.arena, pages)}), flush=True)
        for reserve in (0, 1):
            print(json.dumps({"bench": "elastic_kv_alloc", **common, **alloc_latency(allocator, reserve, args.rounds)}),
                  flush=True)
        print(json.dumps({"bench": "elastic_kv_contention", **common, **contention(allocator)}), flush=True)
    finally:
        sync(device)
        allocator.close()
        pool.arena.close()


if __name__ == "__main__":
    main()
