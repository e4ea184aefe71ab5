"""The hierarchical cache's copies against the machine's pinned-memory copy
bandwidth, measured in the same run (docs/hicache.md).

    python -m radixserve.bench.hicache_transfer [--tokens 8192] [--layers 32 --kv-heads 8 --head-dim 128]

Prints one JSON object: the bandwidth of one large contiguous copy between
device memory and pinned host memory, each way (the ceiling), and that of
``HostKVPool.backup_from_device`` / ``load_to_device`` moving ``--tokens``
tokens of KV (every layer's K and V; by default llama-3.1-8b's shape in
bf16, 128 KiB per token) between slots scattered over the device pool and
the host slots the host allocator hands out, as a backup or load-back of a
radix node does. Each figure is the best of ``--repeats`` timed runs.
On a CPU both "tiers" are host memory; the figures then say what the copy
code costs there.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.mem_cache.host_pool import HostKVPool
from radixserve.mem_cache.memory_pool import MHATokenToKVPool


def timed(fn, sync, repeats: int) -> float:
    """The best wall time of ``fn`` over ``repeats`` runs (after one warm-up)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192, help="tokens per copy")
    p.add_argument("--pool-tokens", type=int, default=65536, help="device pool size (slots are drawn from it)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = p.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    pool = MHATokenToKVPool(args.pool_tokens, 1, dtype, args.kv_heads, args.head_dim, args.layers, device)
    host = HostKVPool(pool, args.tokens * 2)
    n = args.tokens
    nbytes = n * host.bytes_per_token

    flat_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
    flat_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    d2h = timed(lambda: flat_host.copy_(flat_device, non_blocking=True), sync, args.repeats)
    h2d = timed(lambda: flat_device.copy_(flat_host, non_blocking=True), sync, args.repeats)

    gen = torch.Generator().manual_seed(0)
    device_slots = (torch.randperm(args.pool_tokens, generator=gen)[:n] + 1).to(device)  # slot 0 is the dummy
    host_slots = host.allocator.alloc(n)
    backup = timed(lambda: host.backup_from_device(device_slots, host_slots), sync, args.repeats)
    load = timed(lambda: host.load_to_device(host_slots, device_slots), sync, args.repeats)
    gb = nbytes / 1e9
    print(json.dumps({
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "tokens": n, "bytes_per_token": host.bytes_per_token, "copy_gb": round(gb, 3),
        "pinned_d2h_gb_s": round(gb / d2h, 2), "pinned_h2d_gb_s": round(gb / h2d, 2),
        "backup_gb_s": round(gb / backup, 2), "load_back_gb_s": round(gb / load, 2),
        "backup_share_of_pinned": round(d2h / backup, 3), "load_back_share_of_pinned": round(h2d / load, 3),
    }))


if __name__ == "__main__":
    main()
