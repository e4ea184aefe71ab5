"""The scheduler's host time per step: how long ``Scheduler.get_next_batch_to_run``
(admission, KV allocation, request rows, sampling state) takes for decode,
extend and mixed steps, through the ``Engine`` under a steady batch.

    python -m radixserve.bench.scheduler_host                       # tiny-llama, CPU-sized
    python -m radixserve.bench.scheduler_host --enable-mixed-chunk --chunked-prefill-size 512
    python -m radixserve.bench.scheduler_host --model-path llama-3.1-8b --device cuda \\
        --num-prompts 600 --input-len 1024 --output-len 256 --enable-mixed-chunk   # W5's shapes, all at once

On a GPU a small step can be bound by the host (docs/benchmarks.md), and
``get_next_batch_to_run`` is the part of a step's host time the overlap scheduler
cannot hide behind a forward that finished early. The model only sets the
pace; the figures are host time. Prints one JSON line: per kind of step, the
count and the mean, median and p99 milliseconds (a mixed step is an extend
with running requests decoding inside it).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

import radixserve


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--model-path", default="tiny-llama", help="an HF folder or a dummy name (default tiny-llama)")
    add("--device", default="cpu", help="cpu or cuda (default cpu)")
    add("--num-prompts", type=int, default=300)
    add("--input-len", type=int, default=256)
    add("--output-len", type=int, default=64)
    add("--max-running-requests", type=int, default=128)
    add("--chunked-prefill-size", type=int, default=512)
    add("--max-total-tokens", type=int, help="KV pool tokens (default: every request's whole length)")
    add("--enable-mixed-chunk", action="store_true")
    add("--repetition-penalty", type=float, default=1.0, help="every request's (penalties keep state per row)")
    add("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for name in ("num_prompts", "input_len", "output_len", "max_running_requests", "chunked_prefill_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _summary(times: list[float]) -> dict:
    if not times:
        return {"steps": 0}
    ms = np.array(times) * 1e3
    return {"steps": len(ms), "mean_ms": round(float(ms.mean()), 4), "median_ms": round(float(np.median(ms)), 4),
            "p99_ms": round(float(np.percentile(ms, 99)), 4)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    pool = args.max_total_tokens or args.num_prompts * (args.input_len + args.output_len) + 1024
    engine = radixserve.Engine(
        model_path=args.model_path, device=args.device,
        max_running_requests=args.max_running_requests, max_total_tokens=pool,
        chunked_prefill_size=args.chunked_prefill_size, enable_mixed_chunk=args.enable_mixed_chunk, disable_tqdm=True,
    )
    scheduler, by_kind = engine.scheduler, {"decode": [], "extend": [], "mixed": []}
    next_batch = scheduler.get_next_batch_to_run

    def timed():
        start = time.perf_counter()
        batch = next_batch()
        elapsed = time.perf_counter() - start
        if batch is not None:
            kind = "mixed" if batch.decoding_reqs else "extend" if batch.forward_mode.is_extend() else "decode"
            by_kind[kind].append(elapsed)
        return batch

    gen = torch.Generator().manual_seed(args.seed)
    vocab = scheduler.vocab_size
    prompts = [torch.randint(0, vocab, (args.input_len,), generator=gen).tolist() for _ in range(args.num_prompts)]
    scheduler.get_next_batch_to_run = timed
    try:
        start = time.perf_counter()
        engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": args.output_len, "ignore_eos": True, "temperature": 0,
            "repetition_penalty": args.repetition_penalty})
        wall = time.perf_counter() - start
    finally:
        del scheduler.get_next_batch_to_run  # no cycle keeps the engine's pools alive
        engine.shutdown()
    result = {
        "bench": "scheduler_host", "model": args.model_path, "device": args.device,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "max_running_requests": args.max_running_requests, "chunked_prefill_size": args.chunked_prefill_size,
        "enable_mixed_chunk": args.enable_mixed_chunk, "repetition_penalty": args.repetition_penalty,
        "wall_s": round(wall, 2),
        **{f"next_batch_{kind}": _summary(times) for kind, times in by_kind.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
