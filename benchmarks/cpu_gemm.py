"""The CPU's two GEMMs for a linear layer (radixserve/layers/linear.py):
the plain ``F.linear`` on the weight matrix against oneDNN's GEMM on the
weight prepacked once, at SmolLM2-135M's projections (and its LM head at
decode rows), 2 torch threads, float32. Which one wins from a thousand rows
on depends on the CPU (``dense_gemm_min_rows``). Each row: the best of
REPEATS calls, GFLOP/s, and what unpacking the weight costs. Prints JSON lines.

``--decode-step ROWS`` times instead one decode step's GEMMs of the whole
model (30 layers' four projections, then the LM head), prepacked, at ROWS
rows: over 30 layers' own weights (about 420 MB: read from memory, as in a
step), and over one layer's weights 30 times (from the caches).

    python benchmarks/cpu_gemm.py [--rows 64 512 1024 2048] [--threads 2]
    python benchmarks/cpu_gemm.py --decode-step 64 [--threads 2]
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
LAYERS = 30
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


def onednn(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def decode_step(rows: int) -> None:
    """One step's GEMMs in the model's order, each on the previous one's output
    where the shapes allow (as activations flow), weights cold and warm."""
    layer_names = [name for name in SHAPES if name != "lm_head"]
    layers = [{name: torch.ops.mkldnn._reorder_linear_weight(torch.randn(*SHAPES[name]) * 0.02)
               for name in layer_names} for _ in range(LAYERS)]
    head = torch.ops.mkldnn._reorder_linear_weight(torch.randn(*SHAPES["lm_head"]) * 0.02)
    hidden, attn = torch.randn(rows, HIDDEN), torch.randn(rows, HIDDEN)

    def step(weights) -> None:
        h = hidden
        for w in weights:
            onednn(h, w["qkv"])
            h = onednn(attn, w["o"])
            up = onednn(h, w["gate_up"])
            h = onednn(up[:, :INTER].contiguous(), w["down"])
        onednn(h, head)

    gflop = 2 * rows * (LAYERS * sum(n * k for n, k in (SHAPES[name] for name in layer_names))
                        + VOCAB * HIDDEN) / 1e9
    for case, weights in (("cold", layers), ("warm", [layers[0]] * LAYERS)):
        ms = best_s(lambda: step(weights)) * 1e3
        print(json.dumps({"decode_step": case, "rows": rows, "layers": LAYERS, "ms": round(ms, 2),
                          "gflops": round(gflop / ms * 1e3, 1)}), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, nargs="+", default=[64, 512, 1024, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--decode-step", type=int, metavar="ROWS")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.decode_step:
        return decode_step(args.decode_step)
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
