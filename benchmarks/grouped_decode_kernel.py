"""Decode attention with and without prefix grouping, one layer at W4's shape
(docs/prefix_grouped_decode.md; GPU).

A batch of ``--groups`` x ``--members`` requests sharing a ``--prefix``-token
prompt per group, each with its own suffix of ``--suffix-min``..``--suffix-max``
tokens, at llama-3.1-8b's head shape (32 query heads, 8 KV heads of 128) in
bfloat16. Each configuration is captured in a CUDA graph (the metadata, as a
decode step computes it, and ``--layers`` layer calls) and replayed; one
JSON line per configuration: microseconds per layer, the K/V bytes that
plain decode reads per layer and the bytes the configuration reads, and
the bandwidths they imply.

Slots are laid out as a server lays them out (``--layout serving``): each
group prefix and each request's first ``--suffix-min`` tokens (its question)
contiguous, as a prefill writes them, and the decoded tokens interleaved
across the batch, one slot per request per step; ``--layout random``
scatters every slot. ``--sweep`` also times each stage of the grouped path
alone (the others' launches skipped) and the launch configurations of the
suffix and prefix kernels, on the first shape.

    python benchmarks/grouped_decode_kernel.py --sweep > results/DATE_h200_grouped_decode_kernel.jsonl
"""

from __future__ import annotations

import argparse
import itertools
import json
import random

import torch

from radixserve.layers.attention import create_attention_backend
from radixserve.layers.attention.triton_ops import decode_attention as ops
from radixserve.layers.radix_attention import RadixAttention
from radixserve.managers.prefix_groups import build_table
from radixserve.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

PAGE = 16


class _Node:
    def __init__(self, length, parent=None, ident=0):
        self.key, self.parent, self.id = [0] * length, parent, ident


class _Req:
    def __init__(self, row, node):
        self.req_pool_idx, self.last_node = row, node


def make_batch(args, dtype):
    rng = random.Random(args.seed)
    bs = args.groups * args.members + args.loners
    suffix = [rng.randint(args.suffix_min, args.suffix_max) for _ in range(bs)]
    group_of = [i // args.members if i < args.groups * args.members else None for i in range(bs)]
    rng.shuffle(group_of)
    seq_lens = [(0 if g is None else args.prefix) + s for g, s in zip(group_of, suffix)]
    num_slots = args.groups * args.prefix + sum(suffix) + PAGE
    kv = MHATokenToKVPool(num_slots, PAGE, dtype, args.kv_heads, args.head_dim, 1, "cuda")
    for buf in (*kv.k_buffer, *kv.v_buffer):
        buf.normal_()
    req_to_token = ReqToTokenPool(bs + 2, max(seq_lens) + 1, "cuda")
    rows = req_to_token.alloc(bs)
    if args.layout == "random":
        order = (torch.randperm(num_slots - 1) + 1).tolist()
    else:
        order = list(range(1, num_slots))
    free = iter(order)
    prefix_slots = [torch.tensor([next(free) for _ in range(args.prefix)]) for _ in range(args.groups)]
    own = [[next(free) for _ in range(min(s, args.suffix_min))] for s in suffix]  # prefilled questions
    for step in range(max(suffix) - args.suffix_min):  # then one decoded token per request per step
        for i, s in enumerate(suffix):
            if args.suffix_min + step < s:
                own[i].append(next(free))
    root = _Node(0)
    nodes = [_Node(args.prefix, root, g + 1) for g in range(args.groups)]
    reqs = []
    for row, g, slots in zip(rows, group_of, own):
        slots = torch.tensor(slots)
        req_to_token.write(row, 0, slots if g is None else torch.cat([prefix_slots[g], slots]))
        reqs.append(_Req(row, None if g is None else nodes[g]))
    return kv, req_to_token, rows, seq_lens, build_table(reqs, PAGE)


def time_config(args, kv, req_to_token, rows, seq_lens, table, dtype):
    heads = args.kv_heads * args.group
    layer = RadixAttention(heads, args.head_dim, args.head_dim**-0.5, args.kv_heads, 0)
    backend = create_attention_backend("triton", None)
    backend.group, backend.num_kv_heads = args.group, args.kv_heads
    bs = len(rows)
    seq = torch.tensor(seq_lens, device="cuda")
    idx = torch.tensor(rows, device="cuda")
    fb = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=torch.zeros(bs, dtype=torch.int64, device="cuda"),
        positions=seq - 1, req_pool_indices=idx, seq_lens=seq,
        out_cache_loc=req_to_token.req_to_token[idx, seq - 1].to(torch.int64), seq_lens_cpu=list(seq_lens),
        req_to_token_pool=req_to_token, token_to_kv_pool=kv, attn_backend=backend,
        prefix_groups=None if table is None else table.to("cuda"),
    )
    q = torch.randn(bs, heads, args.head_dim, device="cuda", dtype=dtype)
    out = torch.empty_like(q)

    def step():
        backend.init_forward_metadata(fb)
        for _ in range(args.layers):
            backend._decode(q, out, layer, fb, fb.attn_metadata, slice(None))

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(3):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / args.iters / args.layers, out.float().clone()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--members", type=int, default=16)
    p.add_argument("--loners", type=int, default=0)
    p.add_argument("--prefix", type=int, default=2048)
    p.add_argument("--suffix-min", type=int, default=129)
    p.add_argument("--suffix-max", type=int, default=384)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--group", type=int, default=4, help="query heads per KV head")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=16, help="layer calls per graph replay")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shapes", default="16x16,64x4,4x64,1x256,128x2",
                   help="GROUPSxMEMBERS batches to run, each with and without grouping")
    p.add_argument("--layout", choices=("serving", "random"), default="serving")
    p.add_argument("--sweep", action="store_true")
    args = p.parse_args()
    dtype = torch.bfloat16
    token_bytes = 2 * args.kv_heads * args.head_dim * dtype.itemsize  # K and V of one token, one layer
    if args.sweep:
        sweep(args, dtype)
    for shape in args.shapes.split(","):
        args.groups, args.members = map(int, shape.split("x"))
        kv, req_to_token, rows, seq_lens, table = make_batch(args, dtype)
        plain_bytes = sum(seq_lens) * token_bytes
        grouped_bytes = (sum(seq_lens) - (args.members - 1) * args.groups * args.prefix) * token_bytes
        plain_us, plain_out = time_config(args, kv, req_to_token, rows, seq_lens, None, dtype)
        grouped_us, grouped_out = time_config(args, kv, req_to_token, rows, seq_lens, table, dtype)
        diff = (plain_out - grouped_out).abs().max().item()
        for name, us, read in (("plain", plain_us, plain_bytes), ("grouped", grouped_us, grouped_bytes)):
            print(json.dumps({
                "config": name, "groups": args.groups, "members": args.members, "batch": len(rows),
                "prefix": args.prefix, "mean_context": round(sum(seq_lens) / len(seq_lens)),
                "us_per_layer": round(us, 1), "kv_bytes_plain_MB": round(plain_bytes / 1e6, 1),
                "kv_bytes_read_MB": round(read / 1e6, 1),
                "read_GBps": round(read / us / 1e3, 1), "plain_equivalent_GBps": round(plain_bytes / us / 1e3, 1),
                "speedup": round(plain_us / us, 2), "max_abs_diff_vs_plain": diff,
            }), flush=True)


def sweep(args, dtype) -> None:
    """Stages alone, then launch configurations, on the first shape."""
    args.groups, args.members = map(int, args.shapes.split(",")[0].split("x"))
    kv, req_to_token, rows, seq_lens, table = make_batch(args, dtype)
    base = {"groups": args.groups, "members": args.members, "batch": len(rows), "layout": args.layout}

    def timed(**what) -> None:
        us, _ = time_config(args, kv, req_to_token, rows, seq_lens, table, dtype)
        print(json.dumps({**base, **what, "us_per_layer": round(us, 1)}), flush=True)

    launchers = {name: getattr(ops, name) for name in ("_launch_prefix", "_launch_split", "_launch_merge")}
    for keep in launchers:
        for name, launch in launchers.items():
            setattr(ops, name, launch if name == keep else (lambda *a, **k: None))
        timed(stage=keep.removeprefix("_launch_"))
    for name, launch in launchers.items():
        setattr(ops, name, launch)
    suffix, prefix = dict(ops.SUFFIX_CONFIG), dict(ops.PREFIX_CONFIG)
    for block_n, stages, warps in itertools.product((32, 64, 128), (1, 2, 3), (2, 4)):
        ops.SUFFIX_CONFIG = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": stages}
        timed(suffix_config=ops.SUFFIX_CONFIG)
    ops.SUFFIX_CONFIG = suffix
    splits = (ops.PREFIX_SPLITS, ops.MIN_PREFIX_SPLIT)
    for block_n, warps, (n, least) in itertools.product((32, 64, 128), (4, 8), ((4, 512), (8, 256), (16, 128))):
        ops.PREFIX_CONFIG = {"BLOCK_N": block_n, "num_warps": warps, "num_stages": 2}
        ops.PREFIX_SPLITS, ops.MIN_PREFIX_SPLIT = n, least
        timed(prefix_config=ops.PREFIX_CONFIG, prefix_splits=n, min_prefix_split=least)
    ops.PREFIX_CONFIG, (ops.PREFIX_SPLITS, ops.MIN_PREFIX_SPLIT) = prefix, splits


if __name__ == "__main__":
    main()
