"""The CPU's two GEMMs for a linear layer (radixserve/layers/linear.py):
the plain ``F.linear`` on the weight matrix against oneDNN's GEMM on the
weight prepacked once, at SmolLM2-135M's projections (and its LM head at
decode rows), 2 torch threads, float32. Which one wins from a thousand rows
on depends on the CPU (``dense_gemm_min_rows``). Each row: the best of
REPEATS calls, GFLOP/s, and what unpacking the weight costs. Prints JSON lines.

    python benchmarks/cpu_gemm.py [--rows 64 512 1024 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from radixserve.layers.linear import dense_gemm_min_rows

REPEATS = 7
HIDDEN, INTER, QKV, VOCAB = 576, 1536, 960, 49152  # SmolLM2-135M: 9 query heads, 3 KV heads of 64
SHAPES = {"qkv": (QKV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER),
          "lm_head": (VOCAB, HIDDEN)}


def best_s(fn) -> float:
    fn()
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 512, 1024, 2048])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    square = torch.randn(2048, 2048)
    print(json.dumps({"cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": args.threads,
                      "dense_gemm_min_rows": dense_gemm_min_rows(),
                      "square_2048_gflops": round(2 * 2048**3 / best_s(lambda: square @ square) / 1e9, 1)}))
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k) * 0.02
        packed = torch.ops.mkldnn._reorder_linear_weight(w)
        for m in args.rows if name != "lm_head" else [r for r in args.rows if r <= 64]:
            x = torch.randn(m, k)
            gflop = 2 * m * n * k / 1e9
            print(json.dumps({
                "shape": name, "n": n, "k": k, "rows": m,
                "plain_gflops": round(gflop / best_s(lambda: F.linear(x, w)), 1),
                "onednn_gflops": round(gflop / best_s(
                    lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")), 1),
                "unpack_ms": round(best_s(packed.to_dense) * 1e3, 3)}), flush=True)


if __name__ == "__main__":
    main()
