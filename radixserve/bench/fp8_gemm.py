"""The linear layers' GEMMs in bf16 against ``--quantization fp8``, on one
model's shapes.

    python -m radixserve.bench.fp8_gemm [--hidden 4096 --intermediate 14336 --q-heads 32 --kv-heads 8 --head-dim 128]
                                        [--experts E] [--vocab V] [--projections qkv_proj o_proj ...]
                                        [--tokens 1 4 16 64 256 1024 4096 8192] [--sweep-s 20]
                                        [--sweep-weights fp8 bf16] [--write-tables DIR]

Prints one JSON object per (projection, token count) with the time and the
weight-read TB/s of: bf16 ``F.linear``; ``fp8_linear`` (the engine's fp8
path: the skinny kernel up to ``SKINNY_MAX_ROWS`` rows, else the next one);
per-token quantization + ``torch._scaled_mm``, with and without the
quantization kernel; and, up to 64 rows, the skinny kernel
(``layers/triton_ops/skinny_gemm.py``) on the fp8 and on the bf16 weight,
and for ``gate_up_proj`` the skinny kernel followed by SiLU-and-mul against
the kernel with SiLU-and-mul in its epilogue (``gated``). A
first line has the square 8192³ matmul in bf16 and fp8 (the machine's
ceilings, measured in the same run). Defaults are llama-3.1-8b's shapes;
``--experts`` adds a MoE router (``router``, hidden to experts) and
``--vocab`` the LM head (``lm_head``, hidden to vocabulary).

Each time is the best of ``--repeats`` CUDA-event timings of a CUDA graph of
``--inner`` back-to-back calls, as decode steps run, cycling through copies
of the weight (``--rotate-mb`` in all) so that none is read from L2.
``--sweep-s`` also searches the skinny kernel's tiles for each case up to 64
rows (on the CUDA cores and on the tensor cores) and prints the best beside
the default choice; ``--write-tables DIR`` writes the bests of each swept
weight dtype as the kernel's tuned tables for this GPU
(``layers/triton_ops/configs/skinny``), each entry naming the vendor's GEMM
instead where it won in the same run (the engine then takes it): for fp8,
quantization + ``_scaled_mm`` where it was faster; for bf16, ``F.linear``
unless the best tiles beat it by :data:`LINEAR_MARGIN`. GPU only (fp8
tensor cores).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from radixserve.layers.quantization import (
    FP8_DTYPE, GATED_ROWS, fp8_linear, quantize_fp8_rows, quantize_tokens, scaled_mm_linear,
)
from radixserve.layers.triton_ops import num_sms
from radixserve.layers.triton_ops.activation import silu_and_mul
from radixserve.layers.triton_ops.skinny_gemm import (
    LINEAR, MAX_ROWS, SCALED_MM, SkinnyConfig, default_config, get_config, skinny_linear, split_for, table_file_name,
    vendor_kernel,
)

# A bf16 table names the kernel only where its best tiles took at most this share of F.linear's time: cuBLAS
# stays where the two are within timing noise (fp8 keeps the kernel on a tie: _scaled_mm adds a quantization)
LINEAR_MARGIN = 0.97


def cuda_time(calls: list, repeats: int) -> float:
    """Best seconds per call over ``repeats`` replays of a CUDA graph of
    ``calls`` back to back: the device's time, as in a decode step's graph,
    without the host's launch cost (which dominates at a few rows)."""
    for call in calls:
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(calls))
    return best


PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "router", "lm_head")


def projections(a: argparse.Namespace) -> dict[str, tuple[int, int]]:
    """Name -> (in, out) of one decoder layer's four GEMMs, then the router
    and the LM head where ``--experts`` and ``--vocab`` give them."""
    qkv = (a.q_heads + 2 * a.kv_heads) * a.head_dim
    shapes = {"qkv_proj": (a.hidden, qkv), "o_proj": (a.q_heads * a.head_dim, a.hidden),
              "gate_up_proj": (a.hidden, 2 * a.intermediate), "down_proj": (a.intermediate, a.hidden)}
    if a.experts:
        shapes["router"] = (a.hidden, a.experts)
    if a.vocab:
        shapes["lm_head"] = (a.hidden, a.vocab)
    return shapes


def ceilings(repeats: int) -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    aq, bq = a.to(FP8_DTYPE), b.to(FP8_DTYPE)
    one = torch.ones((), device="cuda")
    bf16 = cuda_time([lambda: a @ b.t()] * 5, repeats)
    fp8 = cuda_time([lambda: torch._scaled_mm(aq, bq.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                              use_fast_accum=True)] * 5, repeats)
    return {"bench": "fp8_gemm", "case": "8192^3", "bf16_tflops": 2 * n**3 / bf16 / 1e12,
            "fp8_tflops": 2 * n**3 / fp8 / 1e12}


def weight_copies(w: torch.Tensor, min_bytes: int) -> list[torch.Tensor]:
    """``w`` and clones of it, together at least ``min_bytes``: cycling
    through them keeps a small weight from being read out of L2 (50-60 MB),
    as a decode step's next layer is not."""
    return [w] + [w.clone() for _ in range(max(0, -(-min_bytes // (w.numel() * w.element_size())) - 1))]


def rotating(fn, weights: list[torch.Tensor], inner: int) -> list:
    """``inner`` calls of ``fn(weight)`` cycling through ``weights``."""
    return [functools.partial(fn, weights[i % len(weights)]) for i in range(inner)]


TENSOR_CORE_TILES = ((64, 128), (32, 256), (64, 256), (128, 128), (32, 128))
# The larger tiles (32 KB of fp8 a load and more) never won at one row on an H100 (benchmarks/README.md)
CUDA_CORE_TILES = ((8, 1024), (16, 1024), (4, 2048), (8, 2048), (16, 512), (8, 512), (32, 256), (16, 256),
                   (4, 1024), (32, 128), (64, 128), (16, 2048), (8, 4096), (4, 4096), (32, 1024))


def sweep(name: str, m: int, x, weights, scale, repeats: int, inner: int, budget_s: float,
          vendor_s: float | None = None) -> dict:
    """The fastest skinny config for this case, within ``budget_s``: the
    default and the config the tuned table already has, then the tiles (N,
    K) on the CUDA cores a row at a time (``row_loop``, up to 8 rows), on the
    tensor cores, and on the CUDA cores as one 3-D product, K split to 4, 2
    or 8 programs an SM at 4 warps and 4 stages, then the best of those at
    other warps and stages. ``vendor_s``: the vendor's GEMM's time in the
    same run (quantization + ``_scaled_mm`` for fp8 weights, ``F.linear``
    for others), which the row records beside the best (the tuned table's
    choice)."""
    sms = num_sms(x.device)
    n, k = weights[0].shape
    rows = 1 << (m - 1).bit_length()
    cuda_cores = CUDA_CORE_TILES if m <= 8 else ()
    tiles = [(rows, bn, bk, True) for bn, bk in cuda_cores]
    tiles += [(max(16, rows), bn, bk, False) for bn, bk in TENSOR_CORE_TILES]
    tiles += [(rows, bn, bk, False) for bn, bk in cuda_cores if rows > 1]  # one row is a row loop either way
    deadline, tried = time.monotonic() + budget_s, {}

    def attempt(cfg: SkinnyConfig) -> None:
        if cfg in tried or time.monotonic() > deadline:
            return
        try:
            tried[cfg] = cuda_time(rotating(lambda w: skinny_linear(x, w, scale, config=cfg), weights, inner), repeats)
        except Exception:  # noqa: BLE001 (a tile the compiler rejects: out of shared memory or registers)
            tried[cfg] = float("inf")

    default = default_config(m, n, k, sms)
    attempt(default)
    attempt(get_config(m, n, k, weights[0].dtype, x.device))  # the tuned table's, where there is one
    for per_sm, (bm, bn, bk, loop) in itertools.product((4, 2, 8), tiles):
        attempt(SkinnyConfig(bm, bn, bk, split_for(n, k, bn, bk, per_sm * sms), row_loop=loop))
    top = min(tried, key=tried.get)
    for warps, stages in itertools.product((4, 8, 2), (4, 2, 3, 1, 6)):
        attempt(dataclasses.replace(top, num_warps=warps, num_stages=stages))
    best = min(tried, key=tried.get)
    row = {"bench": "skinny_sweep", "projection": name, "weight": str(weights[0].dtype).split(".")[-1],
           "in": k, "out": n, "tokens": m, "best_us": tried[best] * 1e6, "config": dataclasses.asdict(best),
           "best_weight_tbs": n * k * weights[0].element_size() / tried[best] / 1e12,
           "tried": len(tried), "default_us": tried[default] * 1e6}
    if vendor_s is not None:
        row[f"{vendor_kernel(weights[0].dtype)}_us"] = vendor_s * 1e6
    return row


def as_table_entry(row: dict) -> dict:
    """A sweep row as its tuned table's entry: the best config with its
    time, or, where the vendor's GEMM won, that kernel (``scaled_mm`` for an
    fp8 weight, faster than the tiles; ``linear`` for a bf16 one, unless the
    tiles took at most :data:`LINEAR_MARGIN` of its time) with both times.
    For ``gate_up`` at ``GATED_ROWS`` the times compared are the two paths
    the MLP runs there: the kernel with SiLU-and-mul in its epilogue
    (``skinny_gated_us``) against the vendor's GEMM followed by the
    activation (``scaled_mm_then_silu_us``, ``linear_then_silu_us``)."""
    vendor = next((kernel for kernel in (SCALED_MM, LINEAR) if f"{kernel}_us" in row), None)
    skinny, other = row["best_us"], row.get(f"{vendor}_us")
    if "skinny_gated_us" in row:
        skinny, other = row["skinny_gated_us"], row[f"{vendor}_then_silu_us"]
    times = {"us": round(skinny, 2)}
    if other is not None:
        times[f"{vendor}_us"] = round(other, 2)
        if other < skinny or (vendor == LINEAR and skinny > LINEAR_MARGIN * other):
            return {"kernel": vendor, **times}
    return {"kernel": "skinny", **row["config"], **times}


def write_table(table_dir: str, sweeps: list[dict], dtype: torch.dtype) -> str:
    """One weight shape's tuned table (rows -> :func:`as_table_entry`) where
    ``skinny_gemm.table_entry`` looks for it on this GPU, the sweep's rows
    replacing or joining those of a table already there."""
    n, k = sweeps[0]["out"], sweeps[0]["in"]
    path = Path(table_dir) / table_file_name(n, k, dtype, torch.device("cuda"))
    path.parent.mkdir(parents=True, exist_ok=True)
    table = json.loads(path.read_text()) if path.exists() else {}
    table.update({str(row["tokens"]): as_table_entry(row) for row in sweeps})
    path.write_text(json.dumps(dict(sorted(table.items(), key=lambda item: int(item[0]))), indent=1) + "\n")
    return str(path)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("hidden", 4096), ("intermediate", 14336), ("q-heads", 32), ("kv-heads", 8), ("head-dim", 128)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16, 32, 64, 256, 1024, 4096, 8192])
    parser.add_argument("--experts", type=int, default=0, help="add a MoE router of this many experts")
    parser.add_argument("--vocab", type=int, default=0, help="add an LM head of this vocabulary")
    parser.add_argument("--projections", nargs="+", choices=PROJECTIONS, help="time only these GEMMs")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--inner", type=int, default=20)
    parser.add_argument("--rotate-mb", type=int, default=256, help="weights cycled per timing, at least this many MB")
    parser.add_argument("--sweep-s", type=float, default=0.0,
                        help="per (projection, weight dtype, tokens <= 64): search the skinny kernel's tiles this long")
    parser.add_argument("--sweep-weights", nargs="+", choices=("fp8", "bf16"), default=["fp8"])
    parser.add_argument("--write-tables", metavar="DIR",
                        help="write the sweep's best configs as the kernel's tuned tables into DIR")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemm needs a CUDA device")
    torch.manual_seed(0)
    rows = [ceilings(args.repeats)]
    print(json.dumps(rows[0]), flush=True)
    time_of = lambda fn, ws: cuda_time(rotating(fn, ws, args.inner), args.repeats)  # noqa: E731
    for name, (k, n) in projections(args).items():
        if args.projections and name not in args.projections:
            continue
        swept = {"fp8": [], "bf16": []}
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wq, ws = quantize_fp8_rows(w)
        ws = ws.reshape(1, -1).contiguous()
        bf16s, fp8s = weight_copies(w, args.rotate_mb << 20), weight_copies(wq, args.rotate_mb << 20)
        for m in args.tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xq, xs = quantize_tokens(x)
            times = {
                "bf16": time_of(lambda w_: F.linear(x, w_), bf16s),
                "fp8": time_of(lambda w_: fp8_linear(x, w_, ws), fp8s),
                "fp8_scaled_mm": time_of(lambda w_: scaled_mm_linear(x, w_, ws), fp8s),
                "fp8_gemm_only": time_of(lambda w_: torch._scaled_mm(xq, w_.t(), scale_a=xs, scale_b=ws,
                                                                     out_dtype=torch.bfloat16, use_fast_accum=True),
                                         fp8s),
                "quantize_only": cuda_time([lambda: quantize_tokens(x)] * args.inner, args.repeats),
            }
            if m <= MAX_ROWS:
                times["skinny_fp8"] = time_of(lambda w_: skinny_linear(x, w_, ws.view(-1)), fp8s)
                times["skinny_bf16"] = time_of(lambda w_: skinny_linear(x, w_), bf16s)
            if m <= MAX_ROWS and name == "gate_up_proj":  # SiLU-and-mul after the GEMM, or in its epilogue
                times["skinny_fp8_then_silu"] = time_of(lambda w_: silu_and_mul(skinny_linear(x, w_, ws.view(-1))),
                                                        fp8s)
                times["skinny_fp8_gated"] = time_of(lambda w_: skinny_linear(x, w_, ws.view(-1), gated=True), fp8s)
            row = {"bench": "fp8_gemm", "projection": name, "in": k, "out": n, "tokens": m,
                   **{f"{key}_us": t * 1e6 for key, t in times.items()},
                   **{f"{key}_weight_tbs": k * n * (1 if "fp8" in key else 2) / t / 1e12
                      for key, t in times.items() if key != "quantize_only"},
                   "speedup": times["bf16"] / times["fp8"]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if m <= MAX_ROWS and args.sweep_s > 0:
                vendors = {"fp8": (fp8s, ws.view(-1), times["fp8_scaled_mm"], lambda x_, w_: scaled_mm_linear(x_, w_, ws)),
                           "bf16": (bf16s, None, times["bf16"], F.linear)}
                for label in args.sweep_weights:
                    weights, scale, vendor_s, vendor = vendors[label]
                    rows.append(sweep(name, m, x, weights, scale, args.repeats, args.inner, args.sweep_s, vendor_s))
                    if name == "gate_up_proj" and m in GATED_ROWS:  # what the MLP runs
                        best = SkinnyConfig(**rows[-1]["config"])
                        rows[-1]["skinny_gated_us"] = 1e6 * time_of(
                            lambda w_: skinny_linear(x, w_, scale, config=best, gated=True), weights)
                        rows[-1][f"{vendor_kernel(weights[0].dtype)}_then_silu_us"] = 1e6 * time_of(
                            lambda w_: silu_and_mul(vendor(x, w_)), weights)
                    print(json.dumps(rows[-1]), flush=True)
                    swept[label].append(rows[-1])
        for label, dtype in (("fp8", FP8_DTYPE), ("bf16", torch.bfloat16)):
            if args.write_tables and swept[label]:
                print(json.dumps({"bench": "skinny_table", "weight": label,
                                  "path": write_table(args.write_tables, swept[label], dtype)}), flush=True)
    return rows


if __name__ == "__main__":
    main()
