"""Sweep the Triton decode-attention launch config on one GPU; JSON lines to stdout.

    python benchmarks/decode_attention_sweep.py [--quick] [--kv-cache-dtype fp8_e4m3]

For each case (head shapes of W1's qwen3-0.6b and W2's llama-3.1-8b, page
size 1, a bf16 pool or an fp8 one (``--kv-cache-dtype``), slots scattered over the pool), times one layer's
``decode_attention_fwd`` under CUDA-graph replay for every stage-1 config
(BLOCK_N x num_warps x num_stages) and, for the first case or for every case given
``--policies``, split policy (programs per SM aimed at, minimum tokens per split, splits per
request at most), and reports GB/s of K/V read. The long-context cases (not run by
default) are one request of 16,384 tokens and four of 8-16K. Each config's
output is checked against the default config's.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch
import triton

from radixserve.layers.attention.triton_ops import decode_attention as dec
from radixserve.mem_cache.memory_pool import copy_view, resolve_kv_cache_dtype

CASES = [  # name, heads, kv heads, head dim, batch, context range
    ("w1-qwen3-0.6b-bs256", 16, 8, 128, 256, (200, 1500)),
    ("w1-qwen3-0.6b-bs64", 16, 8, 128, 64, (200, 1500)),
    ("w2-llama-8b-bs256", 32, 8, 128, 256, (576, 576)),
    ("w5-llama-8b-bs448", 32, 8, 128, 448, (1024, 1280)),  # W5's running batch near its knee
    ("long-llama-8b-bs1", 32, 8, 128, 1, (16384, 16384)),  # one long request: W2 at 16,384 tokens in
    ("long-llama-8b-bs4", 32, 8, 128, 4, (8192, 16384)),  # a few long ones: the end of a long-context run
]


def graph_ms(fn) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def run_case(name, heads, kv_heads, dim, bs, ctx_range, configs, policies, gen, kv_dtype):
    lens = torch.randint(ctx_range[0], ctx_range[1] + 1, (bs,), generator=gen)
    total = int(lens.sum())
    k_buf = torch.randn(total + 1, kv_heads, dim, device="cuda", dtype=torch.bfloat16).to(kv_dtype)
    v_buf = torch.randn_like(k_buf, dtype=torch.bfloat16).to(kv_dtype)
    slots = (torch.randperm(total, generator=gen) + 1).to(torch.int32)
    req_to_token = torch.zeros(bs, int(lens.max()), dtype=torch.int32)
    start = 0
    for i, n in enumerate(lens.tolist()):
        req_to_token[i, :n] = slots[start : start + n]
        start += n
    req_to_token = req_to_token.cuda()
    rows = torch.arange(bs, device="cuda")
    seq_lens = lens.cuda()
    q = torch.randn(bs, heads, dim, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(q)
    kv_bytes = total * kv_heads * dim * 2 * k_buf.element_size()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    default_cfg, default_small, ref = dict(dec.STAGE1_CONFIG), dec.SMALL_BLOCK_N, None
    # The ceiling for this access pattern: a plain gather of the same K/V rows.
    flat = slots.cuda().long()
    k_raw, v_raw = copy_view(k_buf), copy_view(v_buf)
    gather_ms = graph_ms(lambda: (k_raw.index_select(0, flat), v_raw.index_select(0, flat)))
    tag = {"case": name, "kv_cache_dtype": str(kv_dtype)}
    print(json.dumps({**tag, "gather_us": round(gather_ms * 1e3, 2),
                      "gather_GBps": round(2 * kv_bytes / gather_ms / 1e6, 1)}), flush=True)  # read + write
    results = []
    for (per_sm, min_tokens, cap), cfg in itertools.product(policies, configs):
        max_splits = max(1, min(cap, triton.cdiv(per_sm * sms, bs * kv_heads)))
        wanted = torch.div(seq_lens + (min_tokens - 1), min_tokens, rounding_mode="floor")
        splits = wanted.clamp(1, max_splits).to(torch.int32)
        mid_o = torch.empty(bs, heads, max_splits, dim, device="cuda", dtype=torch.float32)
        mid_lse = torch.empty(bs, heads, max_splits, device="cuda", dtype=torch.float32)
        dec.STAGE1_CONFIG.update(cfg)
        dec.SMALL_BLOCK_N = cfg["BLOCK_N"]  # the swept block, also where the batch is small

        def fn():
            dec.decode_attention_fwd(q, k_buf, v_buf, out, req_to_token, rows, seq_lens, splits, max_splits,
                                     mid_o, mid_lse, dim**-0.5)

        try:
            fn()
            torch.cuda.synchronize()
            if ref is None:
                ref = out.clone()
            err = float((out.float() - ref.float()).abs().max())
            ms = graph_ms(fn)
        except Exception as e:  # a config the compiler refuses (shared memory)
            results.append({**tag, **cfg, "per_sm": per_sm, "min_tokens": min_tokens, "max_splits": cap,
                            "error": repr(e)[:200]})
            continue
        finally:
            dec.STAGE1_CONFIG.clear()
            dec.STAGE1_CONFIG.update(default_cfg)
            dec.SMALL_BLOCK_N = default_small
        results.append({**tag, **cfg, "per_sm": per_sm, "min_tokens": min_tokens, "max_splits": cap,
                        "grid_splits": max_splits,
                        "us": round(ms * 1e3, 2), "GBps": round(kv_bytes / ms / 1e6, 1), "max_abs_diff": err})
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="a few configs only")
    parser.add_argument("--kv-cache-dtype", default="bf16", help="the pool's dtype: bf16, fp8_e4m3 or fp8_e5m2")
    parser.add_argument("--block-n", nargs="+", type=int, default=[32, 64, 128], help="BLOCK_N values to sweep")
    parser.add_argument("--num-warps", nargs="+", type=int, default=[2, 4, 8], help="num_warps values to sweep")
    parser.add_argument("--num-stages", nargs="+", type=int, default=[1, 2, 3, 4], help="num_stages values to sweep")
    parser.add_argument("--cases", nargs="+", default=[c[0] for c in CASES[:4]], choices=[c[0] for c in CASES])
    parser.add_argument("--policies", nargs="+", metavar="PER_SM:MIN_TOKENS:MAX_SPLITS",
                        help="split policies for every case (programs per SM aimed at, minimum tokens a split, "
                             "splits a request at most); by default four, for the first case only")
    args = parser.parse_args()
    configs = [
        {"BLOCK_N": bn, "num_warps": nw, "num_stages": ns}
        for bn, nw, ns in itertools.product(args.block_n, args.num_warps, args.num_stages)
    ]
    current_policy = (4, dec.MIN_TOKENS_PER_SPLIT, dec.MAX_KV_SPLITS)
    policies = [current_policy, (8, 64, 64), (16, 128, 64), (32, 256, 64)]
    if args.policies:
        policies = [tuple(int(x) for x in p.split(":")) for p in args.policies]
    if args.quick:
        configs, policies = configs[:4], policies[:2]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(50):  # clocks up
        a @ a
    best = {}
    current = dict(dec.STAGE1_CONFIG)
    kv_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, torch.bfloat16)
    for case in (c for c in CASES if c[0] in args.cases):  # by default split policies for the first case only
        case_policies = policies if args.policies or case is CASES[0] else policies[:1]
        rows = [r for r in run_case(*case, configs, case_policies, gen, kv_dtype) if "us" in r]
        small = case[4] * case[2] < torch.cuda.get_device_properties(0).multi_processor_count
        current_case = {**current, "BLOCK_N": min(current["BLOCK_N"], dec.SMALL_BLOCK_N)} if small else current
        default = next((r for r in rows if all(r[k] == v for k, v in current_case.items())
                        and (r["per_sm"], r["min_tokens"], r["max_splits"]) == current_policy), None)
        best[case[0]] = {"default": default, "best": min(rows, key=lambda r: r["us"])}
    print(json.dumps({"summary": best}), flush=True)


if __name__ == "__main__":
    main()
