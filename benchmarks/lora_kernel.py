"""The segmented LoRA kernels (radixserve/lora/triton_ops.py) against the base
GEMM they ride on, at llama-3.1-8b's projections, on one GPU: each kernel
alone over a sweep of launch parameters (``--sweep``: the shrink's split of
K, K tile, warps and rank columns a program; the expand's column tile, warps
and tiles a program), and the default choice
(``kernel_config``), with rows spread evenly over ADAPTERS rank-16 adapters.
For gate_up also the MLP's activation: SiLU-and-mul alone, after the LoRA
kernels, and the fused expand-and-activation (``expand_silu_and_mul``, with
its shrink; swept over column tiles and warps with ``--sweep fused``), also
over the same rows without an adapter.
Each shape also times a whole projection both ways, the base GEMM then
its LoRA (``unstacked_us``) against one GEMM over the weight with every
slot's A stacked under it and the expand over the rank columns it wrote
(``stacked_us``: no shrink; ``stacked_delta``, contiguous for o and down;
gate_up through the fused activation in both); that GEMM alone
(``stacked_gemm_us``) and as two writing the same columns, over W's rows
and over the A rows (``stacked_split_gemm_us``); and gate_up's stacked
expand over a CUDA graph's padded table at 1 to 16 column tiles a program.
Times are per call, the best of CUDA graphs of REPEATS calls. Prints JSON lines.

    python benchmarks/lora_kernel.py [--rows 1 32 256 4096] [--shapes qkv gate_up] [--sweep [fused ...]]
"""

from __future__ import annotations

import argparse
import itertools
import json

import numpy as np
import torch

from radixserve.bench.fp8_gemm import cuda_time
from radixserve.layers.triton_ops.activation import silu_and_mul
from radixserve.lora.triton_ops import (KernelConfig, blocks_for, build_table, expand, expand_silu_and_mul, kernel_config,
                                        lora_delta, shrink, stacked_delta)

HIDDEN, INTER, KV, R, ADAPTERS, REPEATS = 4096, 14336, 1024, 16, 8, 20
# name: (K, parts as (offset, size))
SHAPES = {
    "qkv": (HIDDEN, [(0, HIDDEN), (HIDDEN, KV), (HIDDEN + KV, KV)]),
    "o": (HIDDEN, [(0, HIDDEN)]),
    "gate_up": (HIDDEN, [(0, INTER), (INTER, INTER)]),
    "down": (INTER, [(0, HIDDEN)]),
}


def graph_time_us(fn) -> float:
    return cuda_time([fn] * REPEATS, repeats=5) * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[1, 32, 64, 256, 4096])
    p.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    p.add_argument("--sweep", nargs="*", choices=("shrink", "expand", "fused"),
                   help="time these kernels (all without a name) over their launch parameters too")
    args = p.parse_args()
    sweeps = set(("shrink", "expand", "fused") if args.sweep == [] else args.sweep or ())
    dev, dt = torch.device("cuda"), torch.bfloat16
    for name in args.shapes:
        k, parts = SHAPES[name]
        out = parts[-1][0] + parts[-1][1]
        W = torch.randn(out, k, device=dev, dtype=dt) / k**0.5
        A = torch.randn(ADAPTERS, len(parts) * R, k, device=dev, dtype=dt) / k**0.5
        B = torch.randn(ADAPTERS, out, R, device=dev, dtype=dt) * 0.01
        scaling = torch.ones(ADAPTERS, device=dev)
        bounds = torch.tensor([[o, o + s] for o, s in parts], dtype=torch.int32, device=dev)
        for rows in args.rows:
            x = torch.randn(rows, k, device=dev, dtype=dt)
            y = torch.empty(rows, out, device=dev, dtype=dt)
            table = build_table(np.arange(rows) % ADAPTERS, rows).to(dev)
            base = graph_time_us(lambda: torch.matmul(x, W.t(), out=y))
            default = kernel_config(table.blocks.shape[0], A.shape[1], k, table.block_m)
            t = shrink(x, A, table, default)
            line = {"shape": name, "rows": rows, "base_us": round(base, 2), "config": default.__dict__,
                    "lora_us": round(graph_time_us(lambda: lora_delta(x, y, A, B, table, scaling, bounds, R)), 2),
                    "shrink_us": round(graph_time_us(lambda: shrink(x, A, table, default)), 2),
                    "expand_us": round(graph_time_us(lambda: expand(t, B, y, table, scaling, bounds, R, default)), 2)}
            line["lora_pct_of_base"] = round(100 * line["lora_us"] / base, 1)
            Ws = torch.cat([W, A.flatten(0, 1)])  # [W; A_0; ...; A_S-1]
            ys = torch.empty(rows, Ws.shape[0], device=dev, dtype=dt)

            def unstacked():
                if name == "gate_up":
                    return expand_silu_and_mul(x, torch.matmul(x, W.t(), out=y), A, B, table, scaling, bounds, R)
                return lora_delta(x, torch.matmul(x, W.t(), out=y), A, B, table, scaling, bounds, R)

            def stacked():
                torch.matmul(x, Ws.t(), out=ys)
                if name == "gate_up":
                    return expand_silu_and_mul(x, ys[:, :out], A, B, table, scaling, bounds, R, stacked_t=ys[:, out:])
                return stacked_delta(ys, out, B, table, scaling, bounds, R, A.shape[1], name in ("o", "down"))

            line["stacked_gemm_us"] = round(graph_time_us(lambda: torch.matmul(x, Ws.t(), out=ys)), 2)
            # the same columns from two GEMMs, over W's rows and over the stacked A's
            line["stacked_split_gemm_us"] = round(graph_time_us(lambda: (
                torch.mm(x, Ws[:out].t(), out=ys[:, :out]), torch.mm(x, Ws[out:].t(), out=ys[:, out:]))), 2)
            if name == "gate_up":  # a CUDA graph's table (padded for its rows), column tiles a program
                padded = build_table(np.arange(rows) % ADAPTERS, rows, blocks_for(rows, ADAPTERS)).to(dev)
                line["stacked_fused_graph_table_tiles_us"] = {tiles: round(graph_time_us(
                    lambda: expand_silu_and_mul(x, ys[:, :out], A, B, padded, scaling, bounds, R, tiles=tiles,
                                                stacked_t=ys[:, out:])), 2) for tiles in (1, 2, 4, 16)}
            line["unstacked_us"] = round(graph_time_us(unstacked), 2)
            line["stacked_us"] = round(graph_time_us(stacked), 2)
            if name == "gate_up":
                line["silu_us"] = round(graph_time_us(lambda: silu_and_mul(y)), 2)
                line["lora_then_silu_us"] = round(graph_time_us(
                    lambda: silu_and_mul(lora_delta(x, y, A, B, table, scaling, bounds, R))), 2)
                line["lora_silu_fused_us"] = round(graph_time_us(
                    lambda: expand_silu_and_mul(x, y, A, B, table, scaling, bounds, R)), 2)
                plain = build_table(np.full(rows, -1), rows).to(dev)  # the same rows without an adapter
                line["fused_no_adapter_us"] = round(graph_time_us(
                    lambda: expand_silu_and_mul(x, y, A, B, plain, scaling, bounds, R)), 2)
                if "fused" in sweeps:
                    line["fused_sweep"] = {f"n{bn}w{w}t{tiles}": round(graph_time_us(
                        lambda: expand_silu_and_mul(x, y, A, B, table, scaling, bounds, R, bn, w, tiles)), 2)
                        for bn, w, tiles in itertools.product((64, 128, 256), (2, 4, 8), (1, 2, 4, 8))}
            if "shrink" in sweeps:
                line["shrink_sweep"] = {
                    f"s{s}k{bk}w{w}n{bn}": round(graph_time_us(
                        lambda: shrink(x, A, table, KernelConfig(s, bk, w, shrink_block_n=bn))), 2)
                    for s, bk, w, bn in itertools.product((1, 2, 4, 8, 16), (64, 128, 256), (2, 4), (16, 64))
                    if s * bk <= max(k, bk)}
            if "expand" in sweeps:
                tt = {s: shrink(x, A, table, KernelConfig(s)) for s in (1, 8)}
                line["expand_sweep"] = {
                    f"s{s}n{bn}w{w}t{tiles}": round(graph_time_us(
                        lambda: expand(tt[s], B, y, table, scaling, bounds, R,
                                       KernelConfig(s, expand_block_n=bn, expand_warps=w, expand_tiles=tiles))), 2)
                    for s, bn, w, tiles in itertools.product((1, 8), (64, 128, 256), (4, 8), (0, 1, 4, 16))}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
