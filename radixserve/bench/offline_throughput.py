"""Offline throughput: workloads W1 and W6 of docs/benchmarks.md through the
``Engine``, optionally against HF transformers ``generate`` in the same process.

    python -m radixserve.bench.offline_throughput --workload W6 --compare-hf
    python -m radixserve.bench.offline_throughput --workload W1 \\
        --num-prompts 16 --input-len-range 100 256 --output-len-range 32 64   # W1 scaled for a CPU

Prints one JSON line per backend (radixserve, then hf_transformers with
``--compare-hf``) and a summary line with the speedup. ``--rounds N`` times
the workload N times; with ``--compare-hf`` the backends take turns (a fresh
``Engine`` each round): on a small shared CPU one run's figure moves by
10-20%, so the summary then gives each round's speed-up and their median.
Every line says what was
run (lengths, count, ``full_size``), so a scaled-down run is never mistaken
for the full workload. The timed region is one ``generate`` call over all
requests, prefill included, after a small untimed warm-up.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import gc
import json
import os
import pstats
import time
from dataclasses import dataclass

import numpy as np
import torch

from radixserve.bench import source_fingerprint
from radixserve.bench.generations import load_hf_model
from radixserve.server_args import ServerArgs


@dataclass(frozen=True)
class Workload:
    """A workload's request shape; lengths are inclusive uniform ranges."""

    num_prompts: int
    input_len: tuple[int, int]
    output_len: tuple[int, int]
    temperature: float
    model_path: str | None  # None: the default model (SmolLM2-135M, real weights)
    token_high: int | None  # prompt ids in [0, token_high); None: the model's vocab minus special ids


WORKLOADS = {
    "W1": Workload(256, (100, 1024), (100, 1024), 0.6, "qwen3-0.6b", 10_000),
    "W6": Workload(64, (32, 256), (64, 64), 0.0, None, None),
}


@dataclass
class Request:
    input_ids: list[int]
    max_new_tokens: int


def make_requests(wl: Workload, vocab_size: int, special_ids: set[int], seed: int) -> list[Request]:
    """Random prompts; ids drawn from the allowed set so no prompt holds a control token."""
    rng = np.random.default_rng(seed)
    high = min(wl.token_high or vocab_size, vocab_size)
    allowed = np.setdiff1d(np.arange(high), np.fromiter(special_ids, dtype=np.int64, count=len(special_ids)))
    reqs = []
    for _ in range(wl.num_prompts):
        n = int(rng.integers(wl.input_len[0], wl.input_len[1] + 1))
        m = int(rng.integers(wl.output_len[0], wl.output_len[1] + 1))
        reqs.append(Request(rng.choice(allowed, size=n).tolist(), m))
    return reqs


def _special_ids(engine) -> set[int]:
    ids = set()
    if engine.tokenizer is not None:
        ids |= set(engine.tokenizer.all_special_ids) | set(engine.tokenizer.added_tokens_decoder)
    for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
        value = getattr(engine.scheduler.model_runner.model_config.hf_config, name, None)
        ids |= {value} if isinstance(value, int) else set(value or [])
    return ids


def _record(
    backend: str, wl_name: str, wl: Workload, full_size: bool, model: str, device: str, dtype,
    reqs: list[Request], out_tokens: int, wall: float, **extra,
) -> dict:
    in_tokens = sum(len(r.input_ids) for r in reqs)
    return {
        "bench": "offline_throughput",
        "backend": backend,
        "workload": wl_name,
        "full_size": full_size,
        "model": model,
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "num_prompts": len(reqs),
        "input_len_range": list(wl.input_len),
        "output_len_range": list(wl.output_len),
        "temperature": wl.temperature,
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s": round(wall, 3),
        "output_tok_s": round(out_tokens / wall, 2),
        "total_tok_s": round((in_tokens + out_tokens) / wall, 2),
        "request_s": round(len(reqs) / wall, 3),
        # Other processes on a small CPU skew the figures: the load at the end says how much.
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "source": source_fingerprint(),  # which tree ran (an A/B's two sides differ here)
        **extra,
    }


# -- radixserve -----------------------------------------------------------------------
def _params(wl: Workload, max_new_tokens: int) -> dict:
    return {"max_new_tokens": max_new_tokens, "temperature": wl.temperature, "ignore_eos": True}


def run_radixserve(engine, wl: Workload, reqs: list[Request], profile: str | None = None, warm_runs: int = 0,
                   give_back: bool = False) -> tuple[list[list[int]], float, dict]:
    """Warm up (and run the whole workload ``warm_runs`` times untimed: an
    elastic pool then keeps up to its reserve of pages mapped; with
    ``give_back`` it then gives back all it can, a KV limit of nothing for a
    moment, so the timed run maps again memory this process had), then time
    one ``generate`` over all requests. Returns the
    output ids, the wall time and the scheduler's counters for the timed run.
    With ``profile``, the timed run runs under cProfile (slower), whose top
    functions go to that file as JSON lines (see :func:`profile_rows`)."""
    warm = [list(r.input_ids[:8]) for r in reqs[:2]]
    engine.generate(input_ids=warm, sampling_params=_params(wl, 4))
    params = [_params(wl, r.max_new_tokens) for r in reqs]
    for _ in range(warm_runs):
        engine.flush_cache()
        engine.generate(input_ids=[r.input_ids for r in reqs], sampling_params=params)
    engine.flush_cache()  # the timed run starts from an empty cache
    if give_back:
        engine.set_kv_limit(0)
        engine.set_kv_limit(None)
    before = engine.get_stats()
    start = time.perf_counter()
    profiler = cProfile.Profile() if profile else None
    with profiler or contextlib.nullcontext():
        outs = engine.generate(input_ids=[r.input_ids for r in reqs], sampling_params=params)
    wall = time.perf_counter() - start
    after = engine.get_stats()
    elastic = ("elastic_kv_maps", "elastic_kv_unmaps", "elastic_kv_map_seconds", "elastic_kv_unmap_seconds",
               "elastic_kv_step_maps", "elastic_kv_step_map_seconds")  # the step waited for these
    counters = {k: round(after[k] - before[k], 6) for k in ("forward_ct", "retractions", "cached_tokens", *elastic)
                if k in after}  # the elastic pool's maps during the run (--enable-elastic-kv)
    if profiler is not None:
        steps = max(counters.get("forward_ct", 0), 1)
        with open(profile, "w") as f:
            for row in profile_rows(profiler, steps):
                f.write(json.dumps(row) + "\n")
    return [o["output_ids"] for o in outs], wall, counters


def profile_rows(profiler: cProfile.Profile, steps: int, top: int = 40) -> list[dict]:
    """The ``top`` functions by their own time: calls, own and cumulative
    milliseconds per scheduler step. A host sync shows as the own time of
    the call that waits (``tolist``, ``item``, ``synchronize``)."""
    stats = pstats.Stats(profiler).stats
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    return [{"function": f"{file}:{line}({name})", "calls": calls, "own_ms_per_step": round(own * 1e3 / steps, 4),
             "cum_ms_per_step": round(cum * 1e3 / steps, 4)}
            for (file, line, name), (_, calls, own, cum, _) in rows]


# -- HF transformers -----------------------------------------------------------------
def _hf_batch(model, reqs: list[Request], wl: Workload, pad_id: int, device: str) -> list[list[int]]:
    longest = max(len(r.input_ids) for r in reqs)
    ids = torch.full((len(reqs), longest), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(reqs), longest), dtype=torch.int64)
    for i, r in enumerate(reqs):  # left padding
        ids[i, longest - len(r.input_ids):] = torch.tensor(r.input_ids)
        mask[i, longest - len(r.input_ids):] = 1
    new = max(r.max_new_tokens for r in reqs)
    sample = {"do_sample": False}
    if wl.temperature > 0:  # plain temperature sampling, as radixserve does (HF's default top_k is 50)
        sample = {"do_sample": True, "temperature": wl.temperature, "top_k": 0, "top_p": 1.0}
    # eos_token_id=None is ignore_eos: no stopping, EOS logits untouched
    # (min_new_tokens would mask EOS and change greedy tokens).
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=new,
            eos_token_id=None, pad_token_id=pad_id, **sample,
        )
    return [row[longest:longest + r.max_new_tokens] for row, r in zip(out.tolist(), reqs)]


def run_hf(
    model, wl: Workload, reqs: list[Request], batch_size: int, pad_id: int, device: str
) -> tuple[list[list[int]], float, dict]:
    """Batches of ``batch_size`` in request order. A batch runs to its longest
    ``max_new_tokens``; only each request's own tokens count as output."""
    _hf_batch(model, [Request(reqs[0].input_ids[:8], 4)] * 2, wl, pad_id, device)  # warm-up
    batches = [reqs[i:i + batch_size] for i in range(0, len(reqs), batch_size)]
    start = time.perf_counter()
    outs = [o for b in batches for o in _hf_batch(model, b, wl, pad_id, device)]
    wall = time.perf_counter() - start
    generated = sum(len(b) * max(r.max_new_tokens for r in b) for b in batches)
    return outs, wall, {"batch_size": batch_size, "generated_tokens_incl_padding": generated,
                        "forward_ct": sum(max(r.max_new_tokens for r in b) for b in batches)}


# -- CLI ---------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), required=True)
    add = parser.add_argument
    add("--num-prompts", type=int, help="override the workload's request count")
    add("--input-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="prompt lengths, inclusive")
    add("--output-len-range", type=int, nargs=2, metavar=("MIN", "MAX"), help="max_new_tokens, inclusive")
    add("--seed", type=int, default=0, help="seed of the request generator")
    add("--compare-hf", action="store_true", help="also run HF transformers generate on the same prompts")
    add("--hf-batch-size", type=int, default=16)
    add("--rounds", type=int, default=1,
        help="time the workload this many times; with --compare-hf the backends take turns, and the summary gives "
             "each round's speed-up, their median, and that of the summed walls")
    add("--output-json", help="append the JSON lines to this file")
    add("--warm-runs", type=int, default=0, help="untimed runs of the whole workload before the timed one")
    add("--warm-give-back", action="store_true",
        help="--enable-elastic-kv: after the warm runs, unmap every page the pool can give back")
    add("--profile", metavar="PATH", help="run radixserve's timed run under cProfile, its top functions to PATH")
    add("--torch-threads", type=int, help="torch.set_num_threads for both backends (default: torch's own)")
    args = parser.parse_args(argv)
    for name in ("input_len_range", "output_len_range"):
        lo_hi = getattr(args, name)
        if lo_hi and not 1 <= lo_hi[0] <= lo_hi[1]:
            parser.error(f"--{name.replace('_', '-')}: need 1 <= MIN <= MAX, got {lo_hi}")
    for name in ("num_prompts", "hf_batch_size", "torch_threads", "rounds"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def workload_from_args(args: argparse.Namespace) -> tuple[Workload, bool]:
    """The workload with the command line's overrides, and whether it is still the full one."""
    spec = WORKLOADS[args.workload]
    given = {"num_prompts": args.num_prompts, "input_len": args.input_len_range, "output_len": args.output_len_range}
    given = {k: v if isinstance(v, int) else tuple(v) for k, v in given.items() if v is not None}
    wl = dataclasses.replace(spec, **given)
    full_size = wl == spec and args.seed == 0 and args.model_path in (None, spec.model_path)
    return wl, full_size


def main(argv: list[str] | None = None) -> list[dict]:
    from radixserve.entrypoints.engine import Engine

    args = parse_args(argv)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    wl, full_size = workload_from_args(args)
    if args.model_path is None:
        args.model_path = wl.model_path
    server_args = ServerArgs.from_cli_args(args)
    engine = Engine(**vars(server_args))
    model_config = engine.scheduler.model_runner.model_config
    device = str(engine.scheduler.device)
    model = os.path.basename(model_config.model_path.rstrip("/"))
    reqs = make_requests(wl, model_config.vocab_size, _special_ids(engine), args.seed)
    pad_id = getattr(engine.tokenizer, "pad_token_id", None) or 0
    common = (args.workload, wl, full_size, model, device, model_config.dtype, reqs)

    records, walls, identical, prefixes, hf_model = [], [], [], [], None
    for round_ in range(args.rounds):
        per_round = {"round": round_} if args.rounds > 1 else {}
        if engine is None:
            engine = Engine(**vars(server_args))
        ours, wall, counters = run_radixserve(engine, wl, reqs, args.profile, args.warm_runs, args.warm_give_back)
        records.append(_record(
            "radixserve", *common, sum(map(len, ours)), wall, **per_round, **counters,
            max_running_requests=engine.scheduler.max_running,
            chunked_prefill_size=server_args.resolved_chunked_prefill_size(),
            attention_backend=server_args.resolved_attention_backend(),
            cuda_graph_max_bs=server_args.resolved_cuda_graph_max_bs(), overlap_schedule=engine.scheduler.overlap,
            cpu_decode_kernel=getattr(engine.scheduler.model_runner.attn_backend, "cpu_decode_kernel", None),
        ))
        _emit(records[-1], args.output_json)
        if not args.compare_hf:
            continue
        engine.shutdown()
        engine = None
        gc.collect()  # the KV pool goes before the HF model comes
        if hf_model is None:  # loaded once, kept across rounds
            hf_model = load_hf_model(model_config, device)
        theirs, hf_wall, hf_counters = run_hf(hf_model, wl, reqs, args.hf_batch_size, pad_id, device)
        records.append(_record("hf_transformers", *common, sum(map(len, theirs)), hf_wall, **per_round,
                               **hf_counters))
        _emit(records[-1], args.output_json)
        walls.append((wall, hf_wall))
        identical.append(sum(a == b for a, b in zip(ours, theirs)))
        prefixes.append(float(np.mean([_common_prefix(a, b) for a, b in zip(ours, theirs)])))

    if args.compare_hf:
        # Both backends produce the same tokens each round, so the ratio of output tok/s is that of the
        # walls; over rounds, of the summed walls (the rounds alternate, so a drifting machine slows both).
        summary = {
            "bench": "offline_throughput", "summary": True, "workload": args.workload, "full_size": full_size,
            "model": model, "device": device,
            "speedup_output_tok_s": round(sum(h for _, h in walls) / sum(o for o, _ in walls), 3),
        }
        if args.rounds > 1:
            ratios = [h / o for o, h in walls]
            summary.update(rounds=args.rounds, speedup_by_round=[round(r, 3) for r in ratios],
                           speedup_median=round(float(np.median(ratios)), 3))
        if wl.temperature == 0 and model_config.load_format != "dummy":
            # Correctness side-check: same weights, greedy; reported, not asserted (the worst round).
            summary["greedy_identical"] = min(identical)
            summary["greedy_compared"] = len(reqs)
            summary["greedy_common_prefix_mean"] = round(min(prefixes), 2)
        records.append(summary)
        _emit(summary, args.output_json)
    return records


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _emit(record: dict, path: str | None) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if path:
        with open(path, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    main()
