"""The fused MoE layer alone (``fused_experts``: sort-and-pad, two grouped
GEMMs, top-k sum) against the torch path (``moe_forward_native``: tokens
grouped by expert, one GEMM pair per expert that has tokens), on one GPU.

Batches of 1, 32 and 256 tokens (decode) and a 4,096-token prefill, random
softmax top-k routing. Each line: the torch path's and the fused path's
milliseconds (eager; the fused path also replayed from a CUDA graph at the
decode sizes, as the engine runs decode), the speed-up, the fused output's
error against the torch path, and at batch 1 the bandwidth the fused path
achieves on the bytes of the experts it reads (the k chosen experts' w13 and
w2; activations are noise) against the H200's ~4.8 TB/s. The sort-and-pad
alone is timed both ways: as the layer runs it, and in one launch (every
program counting every pair, the only way before 2026-12-07)::

    python benchmarks/moe_layer.py --model qwen3-30b-a3b [--config-dir DIR]

``--config-dir`` points at tuned tables (tune_fused_moe.py's output) other
than the package's; a directory without them gives the untuned defaults.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from pathlib import Path

import torch

from radixserve.layers.moe.native import moe_forward_native
from radixserve.layers.moe.triton_ops.fused_moe import (
    CONFIG_DIR, config_file_name, fused_experts, get_config, moe_align_block_size,
)

MODELS = {
    "qwen3-30b-a3b": dict(experts=128, hidden=2048, intermediate=768, topk=8),
    "mixtral-8x7b": dict(experts=8, hidden=4096, intermediate=14336, topk=2),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
PEAK_TB_S = 4.8  # H200 HBM3e
DECODE_MAX = 256  # batches up to this are decode batches: also timed from a CUDA graph


def eager_ms(call, iters: int) -> float:
    """Median milliseconds of ``call`` launched eagerly, after a warm-up."""
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graph_ms(call, iters: int, inner: int = 20) -> float:
    """Milliseconds of one ``call``, from a CUDA graph of ``inner`` calls (median of ``iters`` replays)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(inner):
            call()
    return eager_ms(graph.replay, iters) / inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen3-30b-a3b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 256, 4096])
    parser.add_argument("--config-dir", default=str(CONFIG_DIR))
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("the fused path needs a CUDA device")

    shape, dtype = MODELS[args.model], DTYPES[args.dtype]
    e, h, i, k = shape["experts"], shape["hidden"], shape["intermediate"], shape["topk"]
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=dtype, generator=gen) * h**-0.5
    w2 = torch.randn(e, h, i, device="cuda", dtype=dtype, generator=gen) * i**-0.5
    expert_bytes = (w13[0].numel() + w2[0].numel()) * w13.element_size()
    for tokens in args.batches:
        t0 = time.monotonic()
        x = torch.randn(tokens, h, device="cuda", dtype=dtype, generator=gen)
        weights, ids = torch.softmax(torch.randn(tokens, e, device="cuda", generator=gen), dim=-1).topk(k, dim=-1)
        ids = ids.to(torch.int32)
        config = get_config(e, h, i, k, dtype, tokens, x.device, args.config_dir)
        tuned = (Path(args.config_dir) / config_file_name(e, h, i, dtype, torch.cuda.get_device_name())).exists()

        def fused():
            return fused_experts(x, w13, w2, weights, ids, config=config)

        def native():
            return moe_forward_native(x, w13, w2, weights, ids)

        want, got = native().float(), fused().float()
        line = {"bench": "moe_layer", "model": args.model, "dtype": args.dtype, "tokens": tokens,
                "phase": "decode" if tokens <= DECODE_MAX else "prefill", "config": config, "tuned": tuned,
                "max_rel_error": float((got - want).abs().max() / want.abs().max()),
                "torch_ms": round(eager_ms(native, max(3, args.iters // 4)), 4),
                "fused_ms": round(eager_ms(fused, args.iters), 4)}
        align = functools.partial(moe_align_block_size, ids, config["BLOCK_SIZE_M"], e)
        line["align_ms"] = round(eager_ms(align, args.iters), 4)  # counted first past 8,192 pairs
        line["align_one_launch_ms"] = round(eager_ms(functools.partial(align, count_first=False), args.iters), 4)
        best = line["fused_ms"]
        if tokens <= DECODE_MAX:
            line["fused_graph_ms"] = round(graph_ms(fused, args.iters), 4)
            line["align_graph_ms"] = round(graph_ms(lambda: moe_align_block_size(ids, config["BLOCK_SIZE_M"], e),
                                                    args.iters), 4)
            best = min(best, line["fused_graph_ms"])
        line["speedup"] = round(line["torch_ms"] / best, 2)
        if tokens == 1:
            read = int(ids.unique().numel()) * expert_bytes
            line["expert_bytes_read"] = read
            line["bandwidth_tb_s"] = round(read / (best * 1e-3) / 1e12, 3)
            line["bandwidth_fraction_of_peak"] = round(line["bandwidth_tb_s"] / PEAK_TB_S, 3)
        line["elapsed_s"] = round(time.monotonic() - t0, 1)
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
