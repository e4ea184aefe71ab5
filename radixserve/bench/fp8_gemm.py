"""The linear layers' GEMMs in bf16 against ``--quantization fp8`` (per-token
activation quantization + ``torch._scaled_mm``), on one model's shapes.

    python -m radixserve.bench.fp8_gemm [--hidden 4096 --intermediate 14336 --q-heads 32 --kv-heads 8 --head-dim 128]
                                        [--tokens 1 64 256 1024 4096 8192]

Prints one JSON object per (projection, token count): the bf16 ``F.linear``
time, the fp8 time with and without the quantization kernel, and the TFLOP/s
and weight-read TB/s of each, plus a line with the square 8192³ matmul in
bf16 and fp8 (the machine's ceilings, measured in the same run). Defaults are
llama-3.1-8b's shapes. Each time is the best of ``--repeats`` CUDA-event
timings of a CUDA graph of ``--inner`` back-to-back calls, as decode steps
run. GPU only (fp8 tensor cores).
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from radixserve.layers.quantization import FP8_DTYPE, fp8_linear, quantize_fp8_rows, quantize_tokens


def cuda_time(fn, repeats: int, inner: int) -> float:
    """Best seconds per call of ``fn`` over ``repeats`` replays of a CUDA
    graph of ``inner`` calls: the device's time, as in a decode step's
    graph, without the host's launch cost (which dominates at a few rows)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            fn()
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / inner)
    return best


def projections(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """Name -> (in, out) of one decoder layer's four GEMMs."""
    qkv = (a.q_heads + 2 * a.kv_heads) * a.head_dim
    return {"qkv_proj": (a.hidden, qkv), "o_proj": (a.q_heads * a.head_dim, a.hidden),
            "gate_up_proj": (a.hidden, 2 * a.intermediate), "down_proj": (a.intermediate, a.hidden)}


def ceilings(repeats: int) -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    aq, bq = a.to(FP8_DTYPE), b.to(FP8_DTYPE)
    one = torch.ones((), device="cuda")
    bf16 = cuda_time(lambda: a @ b.t(), repeats, 5)
    fp8 = cuda_time(lambda: torch._scaled_mm(aq, bq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                             use_fast_accum=True), repeats, 5)
    return {"bench": "fp8_gemm", "case": "8192^3", "bf16_tflops": 2 * n**3 / bf16 / 1e12,
            "fp8_tflops": 2 * n**3 / fp8 / 1e12}


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 4096), ("intermediate", 14336), ("q-heads", 32), ("kv-heads", 8), ("head-dim", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 1024, 4096, 8192])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm needs a CUDA device")
    torch.manual_seed(0)
    rows = [ceilings(args.repeats)]
    print(json.dumps(rows[0]), flush=True)
    for name, (k, n) in projections(args).items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_fp8_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_tokens(x)
            times = {
                "bf16": cuda_time(lambda: F.linear(x, w), args.repeats, args.inner),
                "fp8": cuda_time(lambda: fp8_linear(x, wq, ws), args.repeats, args.inner),
                "fp8_gemm_only": cuda_time(lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws,
                                                                    out_dtype=torch.bfloat16, use_fast_accum=True),
                                           args.repeats, args.inner),
                "quantize_only": cuda_time(lambda: quantize_tokens(x), args.repeats, args.inner),
            }
            row = {"bench": "fp8_gemm", "projection": name, "in": k, "out": n, "tokens": m,
                   **{f"{key}_us": t * 1e6 for key, t in times.items()},
                   "bf16_tflops": 2 * m * k * n / times["bf16"] / 1e12, "fp8_tflops": 2 * m * k * n / times["fp8"] / 1e12,
                   "bf16_weight_tbs": 2 * k * n / times["bf16"] / 1e12, "fp8_weight_tbs": k * n / times["fp8"] / 1e12,
                   "speedup": times["bf16"] / times["fp8"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


if __name__ == "__main__":
    main()
