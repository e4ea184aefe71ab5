"""Tunes the fused MoE kernel's launch configurations for one model's expert
shapes on this GPU, and writes the table the kernel reads
(``radixserve/layers/moe/configs/E=..,H=..,I=..,dtype=..,device_name=...json``).

For each batch size it times ``fused_experts`` (all four launches, captured
in a CUDA graph and replayed, CUDA events around the replays) over a small
grid of candidates, pruned by how many (token, choice) pairs an expert gets
on average:

- phase 1, the tiles: BLOCK_SIZE_M / N / K at one choice of warps, stages
  and grouping, plus the kernel's untuned default (at a few tokens, tiles of
  one row on the CUDA cores first);
- phase 2, the best tile with other warps, pipeline stages and groupings.

Each timing cycles through 16 routings, so that a few tokens' experts are
read from HBM, not from L2. Candidates whose shared memory cannot fit are
left out, ones that fail to compile are skipped, and ``--budget-s`` bounds
the whole search (each batch gets its share; phase 2 is cut first).
Routing is random softmax top-k, so the experts' loads are balanced as in a
large batch of real traffic.
GPU only. Prints one JSON line per batch and the file it wrote::

    python benchmarks/tune_fused_moe.py --model qwen3-30b-a3b
    python benchmarks/tune_fused_moe.py --experts 128 --hidden 2048 --intermediate 384 --topk 8  # I of a TP-2 shard
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import triton

from radixserve.layers.moe.triton_ops import fused_moe
from radixserve.layers.moe.triton_ops.fused_moe import CONFIG_KEYS, default_config, fused_experts

MODELS = {
    "qwen3-30b-a3b": dict(experts=128, hidden=2048, intermediate=768, topk=8),
    "mixtral-8x7b": dict(experts=8, hidden=4096, intermediate=14336, topk=2),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
SHARED_MEMORY = 220 * 1024  # bytes a block may use on Hopper (227 KB), with room for the epilogue
GRAPH_MS = 3.0  # work captured in one graph per timing
ROUTINGS = 16  # at one token, 16 routings of 8 choices read most of 128 experts' 1.2 GB


def config(bm, bn, bk, group, warps, stages) -> dict:
    return dict(zip(CONFIG_KEYS, (bm, bn, bk, group, warps, stages)))


def fits(cfg: dict, elem: int) -> bool:
    """The gate/up kernel's pipeline (one A tile and two B tiles a stage) within shared memory."""
    m, n, k = cfg["BLOCK_SIZE_M"], cfg["BLOCK_SIZE_N"], cfg["BLOCK_SIZE_K"]
    return cfg["num_stages"] * (m * k + 2 * k * n) * elem <= SHARED_MEMORY


# (N, K) tiles of one row a block on the CUDA cores (BLOCK_SIZE_M 1), for a step's few tokens
CUDA_CORE_TILES = [(8, 512), (16, 512), (8, 1024), (16, 256), (8, 256), (32, 256), (16, 1024), (32, 128)]


def regime(per_expert: float) -> dict:
    """The grid for an average of ``per_expert`` pairs an expert: decode
    reads weights (small M, narrow N for more programs, deep K), and where
    an expert gets a quarter of a pair or less (a step of a few tokens) one
    row a block on the CUDA cores too; prefill is compute-bound (tall, wide
    tiles)."""
    if per_expert <= 8:
        return dict(m=[16], n=[16, 32, 64, 128], k=[64, 128, 256], base=(1, 4, 4), groups=[1], warps=[2, 4, 8],
                    stages=[2, 3, 4, 5], cuda_cores=CUDA_CORE_TILES if per_expert <= 0.25 else [])
    if per_expert <= 128:
        return dict(m=[16, 32, 64], n=[64, 128], k=[64, 128], base=(8, 4, 3), groups=[1, 16], warps=[4, 8],
                    stages=[3, 4])
    return dict(m=[64, 128], n=[64, 128, 256], k=[64, 128], base=(8, 8, 3), groups=[8, 32], warps=[4, 8],
                stages=[3, 4])


def phase_one(grid: dict, elem: int) -> list[dict]:
    out = [config(1, n, k, 1, 4, 2) for n, k in grid.get("cuda_cores", [])]
    out += [config(m, n, k, *grid["base"]) for m, n, k in itertools.product(grid["m"], grid["n"], grid["k"])]
    return [c for c in out if fits(c, elem)]


def phase_two(grid: dict, tile: dict, elem: int) -> list[dict]:
    out = [{**tile, "GROUP_SIZE_M": g, "num_warps": w, "num_stages": s}
           for g, w, s in itertools.product(grid["groups"], grid["warps"], grid["stages"])]
    return [c for c in out if fits(c, elem)]


def graph_ms(calls: list) -> float:
    """Milliseconds of one call (compiled already), from a CUDA graph of
    enough calls to time, cycling through ``calls``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    calls[0]()
    end.record()
    end.synchronize()
    inner = max(len(calls), min(50, int(GRAPH_MS / max(start.elapsed_time(end), 1e-3))))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        calls[0]()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for n in range(inner):
            calls[n % len(calls)]()
    graph.replay()
    times = []
    for _ in range(3):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    del graph
    return sorted(times)[1]


def make_inputs(shape: dict, tokens: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, h, k = shape["experts"], shape["hidden"], shape["topk"]
    x = torch.randn(tokens, h, device="cuda", dtype=dtype, generator=gen)
    weights, ids = torch.softmax(torch.randn(tokens, e, device="cuda", generator=gen), dim=-1).topk(k, dim=-1)
    return x, weights, ids.to(torch.int32)


def tune_batch(weights: tuple, shape: dict, tokens: int, dtype: torch.dtype, deadline: float, start_from: list[dict]):
    """The fastest configuration found before ``deadline``, its time, and the timings."""
    # Routings drawn anew, cycled through in the timed graph: a few tokens read only their experts, and
    # the same few every call would be read from L2, where a decode step's next layer is not.
    routings = [make_inputs(shape, tokens, dtype, seed=tokens * ROUTINGS + r) for r in range(ROUTINGS)]
    elem = routings[0][0].element_size()
    grid = regime(tokens * shape["topk"] / shape["experts"])
    timings: list[tuple[float, dict]] = []
    failed = 0

    def measure(candidates):
        nonlocal failed
        for cfg in candidates:
            if time.monotonic() > deadline and timings:
                return
            if any(cfg == c for _, c in timings):
                continue
            try:
                calls = [functools.partial(fused_experts, x, *weights, topk_weights, topk_ids, config=cfg)
                         for x, topk_weights, topk_ids in routings]
                calls[0]()  # compiles
                timings.append((graph_ms(calls), cfg))
            except Exception as exc:  # out of resources, or a compiler error for this tile
                failed += 1
                print(f"skipped {cfg}: {type(exc).__name__}: {str(exc)[:200]}", file=sys.stderr)

    measure(start_from + phase_one(grid, elem))
    best = min(timings, key=lambda t: t[0])[1]
    measure(phase_two(grid, {key: best[key] for key in CONFIG_KEYS[:3]}, elem))
    best_ms, best = min(timings, key=lambda t: t[0])
    return best, best_ms, timings, failed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b",
                        help="expert shapes of this model, unless given one by one")
    parser.add_argument("--experts", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--intermediate", type=int, help="an expert's intermediate size (a TP shard's under TP)")
    parser.add_argument("--topk", type=int)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", type=int, nargs="+", default=BATCHES, help="batch sizes in tokens")
    parser.add_argument("--output-dir", default=str(fused_moe.CONFIG_DIR))
    parser.add_argument("--budget-s", type=float, default=170.0, help="the whole search, compiles included")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("tuning needs a CUDA device")

    shape = dict(MODELS[args.model])
    shape.update({key: getattr(args, key) for key in shape if getattr(args, key) is not None})
    dtype, t0 = DTYPES[args.dtype], time.monotonic()
    gen = torch.Generator(device="cuda").manual_seed(0)
    e, h, i = shape["experts"], shape["hidden"], shape["intermediate"]
    weights = (torch.randn(e, 2 * i, h, device="cuda", dtype=dtype, generator=gen) * h**-0.5,
               torch.randn(e, h, i, device="cuda", dtype=dtype, generator=gen) * i**-0.5)
    batches = sorted(set(args.batches))
    table, previous = {}, None
    for n, tokens in enumerate(batches):
        deadline = t0 + args.budget_s * (n + 1) / len(batches)  # each batch's share, unused time carried on
        start_from = [default_config(e, tokens, shape["topk"], dtype)] + ([previous] if previous else [])
        best, best_ms, timings, failed = tune_batch(weights, shape, tokens, dtype, deadline, start_from)
        default_ms = next((ms for ms, cfg in timings if cfg == start_from[0]), None)  # None: it failed
        table[str(tokens)], previous = best, best
        print(json.dumps({"bench": "tune_fused_moe", **shape, "dtype": args.dtype, "tokens": tokens,
                          "config": best, "ms": round(best_ms, 4), "default_ms": default_ms and round(default_ms, 4),
                          "speedup_vs_default": default_ms and round(default_ms / best_ms, 3), "tried": len(timings),
                          "failed": failed, "elapsed_s": round(time.monotonic() - t0, 1)}), flush=True)

    name = fused_moe.config_file_name(e, h, i, dtype, torch.cuda.get_device_name())
    path = Path(args.output_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():  # keep the batch sizes this run did not tune
        table = {**json.loads(path.read_text()), **table}
    path.write_text(json.dumps(dict(sorted(table.items(), key=lambda kv: int(kv[0]))), indent=2) + "\n")
    shown = path.resolve()  # relative to the checkout where it is inside it: results files name no machine's paths
    root = Path(fused_moe.__file__).resolve().parents[4]
    shown = shown.relative_to(root) if shown.is_relative_to(root) else Path(path.name)
    print(json.dumps({"bench": "tune_fused_moe", "wrote": str(shown), "device": torch.cuda.get_device_name(),
                      "triton": triton.__version__, "torch": torch.__version__,
                      "elapsed_s": round(time.monotonic() - t0, 1)}), flush=True)


if __name__ == "__main__":
    main()
