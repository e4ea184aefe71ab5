"""Static-batch latency on a bare ModelRunner: workloads W2 (decode) and W3
(prefill) of docs/benchmarks.md, in the manner of SGLang's bench_one_batch.

    python -m radixserve.bench.one_batch --workload W2 --compare-hf
    python -m radixserve.bench.one_batch --workload W3 --compare-hf
    python -m radixserve.bench.one_batch --workload W2 --model-path tiny-llama \\
        --batch-sizes 1 4 --input-len 64 --output-len 8     # scaled down for a CPU

No scheduler. Each case (batch size, input length) takes ``bs`` request rows
and the KV slots of prompt and output before the clock starts, then runs one
EXTEND of the whole batch and ``output_len - 1`` DECODE steps with greedy
sampling; the sampled ids feed the next step on the device. A timed region
covers building the batch, the forward (attention metadata included) and the
sampler, and ends with a device synchronize. KV allocation is the scheduler's
cost and is left out (offline_throughput measures it). Every case first runs
once untimed with the same shapes, so Triton compilation, autotuning and
CUDA-graph capture stay out of the figures.

``--engine`` times the ``Engine`` instead (the Scheduler, with overlap
scheduling unless ``--disable-overlap-schedule``, as a server decodes): each
case generates its prompts to one token and then to ``output_len`` tokens (the
radix cache off, so the second run prefills again), and the difference over
``output_len - 1`` is the mean decode step. The bare runner's steps are
synchronous: each pays the host's preparation, the graph's launch and the read
back in full, where the scheduler prepares step N+1 while step N runs.

Prints one JSON line per case. With ``--compare-hf`` HF transformers runs the
same shapes in the same process, each case followed by a summary line with the
speedups. Our runner goes first and is deleted (``torch.cuda.empty_cache()``
on CUDA) before HF's model is made, so the two never hold the GPU together;
our KV pool is sized to the largest case (``--max-total-tokens`` overrides).
HF decodes with ``generate``: its prefill time is a 1-token generate, its step
time (full generate minus that) / (output_len - 1). HF prefill-only cases
(output_len 1, as in W3) time one forward over the batch (``logits_to_keep=1``).

Rooflines (``bench/rooflines.py``; the peaks default to the H200 figures of benchmarks/README.md):
- decode: bytes per step = weight bytes (each parameter once) + KV bytes read
  (bs x context x layers x kv_heads x head_dim x 2 x itemsize, at the mean
  context of the decode steps), over the median step time (HF: the mean),
  against ``--peak-bandwidth`` (device copy) and ``--gemv-bandwidth``.
- prefill: FLOPs = 2 x non-embedding params x tokens + 4 x layers x heads x
  head_dim x causal pairs (n(n+1)/2 per request), against ``--peak-flops``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.metadata
import json
import os
import platform
import sys
import time
from dataclasses import dataclass, fields

import numpy as np
import torch

from radixserve.bench import source_fingerprint, sync
from radixserve.bench.generations import WARMUP_MAX_OUTPUT_LEN, load_hf_model, run_engine_case, run_hf_case
from radixserve.bench.rooflines import (
    H200_BF16_FLOPS,
    H200_COPY_BANDWIDTH,
    H200_GEMV_BANDWIDTH,
    ModelShape,
    Peaks,
    Timing,
    case_metrics,
)
from radixserve.mem_cache.allocator import page_aligned
from radixserve.server_args import ServerArgs

PROFILED_STEPS = 8  # --kernel-profile: decode steps recorded per case


@dataclass(frozen=True)
class Workload:
    """Cases of (batch size, input length); every request of a case has the same
    lengths. ``output_len`` counts the prefill's token: 1 means prefill only."""

    cases: tuple[tuple[int, int], ...]
    output_len: int
    model_path: str


WORKLOADS = {
    "W2": Workload(((1, 512), (32, 512), (256, 512)), 128, "llama-3.1-8b"),
    "W3": Workload(((8, 1024), (1, 8192)), 1, "llama-3.1-8b"),
}


# -- radixserve ------------------------------------------------------------------------
def make_prompts(bs: int, input_len: int, vocab_size: int, seed: int) -> torch.Tensor:
    """``[bs, input_len]`` random token ids (speed does not depend on them)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (bs, input_len), generator=gen, dtype=torch.int64)


@contextlib.contextmanager
def static_batch(runner, prompts: torch.Tensor, output_len: int):
    """One ``Req`` per prompt (greedy, ``output_len`` tokens, no EOS) over the
    runner's pools without a prefix cache, and the ``KVPools`` that their
    ``ScheduleBatch``es allocate from; the KV comes back on exit."""
    from radixserve.managers.schedule_batch import KVPools, Req
    from radixserve.mem_cache import ChunkCache
    from radixserve.sampling.sampling_params import SamplingParams

    bs, input_len = prompts.shape
    cache = ChunkCache(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, runner.page_size)
    pools = KVPools(runner.req_to_token_pool, runner.token_to_kv_pool_allocator, cache, runner.page_size, runner.device)
    params = SamplingParams(max_new_tokens=output_len, temperature=0.0, ignore_eos=True)
    params.normalize(runner.model_config.vocab_size)
    reqs = [Req(str(i), prompts[i].tolist(), params) for i in range(bs)]
    for req in reqs:
        req.extend_input_len = input_len
    need = bs * page_aligned(input_len + output_len, runner.page_size)
    if need > runner.token_to_kv_pool_allocator.available_size():
        raise RuntimeError(f"the KV pool ({runner.max_total_tokens} tokens) cannot hold {bs} x "
                           f"{input_len + output_len} tokens; raise --max-total-tokens or --mem-fraction-static")
    try:
        yield reqs, pools
    finally:
        for req in reqs:
            if req.req_pool_idx is not None:
                cache.cache_finished_req(req)


@torch.inference_mode()
def run_case(runner, sampler, prompts: torch.Tensor, output_len: int, lora=None,
             on_step=None) -> tuple[Timing, torch.Tensor]:
    """Prefill ``prompts`` [bs, input_len] as one EXTEND, then decode greedily
    to ``output_len`` tokens a request, each step a ``ScheduleBatch`` as the
    Scheduler builds it (its KV allocation is part of the step's time), each
    request under its adapter of ``lora`` (``lora_adapters.spread``'s, or None).
    ``on_step()``, if given, runs after the prefill and after each decode step
    (a profiler's ``step``). Returns the timing and the ``[bs, output_len]``
    generated ids."""
    on_step = on_step or (lambda: None)
    from radixserve.managers.schedule_batch import ScheduleBatch
    from radixserve.model_executor.forward_batch_info import ForwardMode

    dev, vocab = runner.device, runner.model_config.vocab_size
    with static_batch(runner, prompts, output_len) as (reqs, pools):
        sync(dev)
        start = time.perf_counter()
        extend = ScheduleBatch(reqs, ForwardMode.EXTEND, pools, vocab)
        extend.prepare_for_extend()
        batch = extend.get_model_worker_batch()
        if lora is not None:
            batch.lora_ids, batch.lora_slots = lora
        info = batch.sampling_info
        next_ids = _forward_and_sample(runner, sampler, batch, reqs)
        sync(dev)
        timing = Timing(time.perf_counter() - start, decode_s=[])
        on_step()
        generated = [next_ids]
        for _ in range(output_len - 1):
            start = time.perf_counter()
            info.cumulate_output_tokens(next_ids)
            decode = ScheduleBatch(reqs, ForwardMode.DECODE, pools, vocab)
            decode.prepare_for_decode()
            batch = decode.get_model_worker_batch(info)
            if lora is not None:
                batch.lora_ids, batch.lora_slots = lora
            batch.input_ids = next_ids  # stays on the device: no host sync between steps
            next_ids = _forward_and_sample(runner, sampler, batch, reqs)
            sync(dev)
            timing.decode_s.append(time.perf_counter() - start)
            on_step()
            generated.append(next_ids)
    return timing, torch.stack(generated, dim=1).cpu()


def _forward_and_sample(runner, sampler, batch, reqs) -> torch.Tensor:
    out = runner.forward(runner.forward_batch_from(batch))
    for req, seq in zip(reqs, batch.seq_lens_cpu):
        req.kv_len = seq
    return sampler(out.next_token_logits, batch.sampling_info).next_token_ids


def warm_and_run(runner, sampler, prompts: torch.Tensor, output_len: int,
                 repeats: int = 1, lora=None) -> tuple[Timing, torch.Tensor]:
    """One untimed run with the same shapes (fewer decode steps), then the
    measured one. A prefill-only case (``output_len`` 1) is measured
    ``repeats`` times and reports the median (one prefill is a few ms: a
    single timing is noise)."""
    run_case(runner, sampler, prompts, min(output_len, WARMUP_MAX_OUTPUT_LEN), lora)
    if output_len > 1:
        return run_case(runner, sampler, prompts, output_len, lora)
    runs = [run_case(runner, sampler, prompts, output_len, lora) for _ in range(repeats)]
    return Timing(float(np.median([t.prefill_s for t, _ in runs])), decode_s=[]), runs[0][1]


# -- CLI ---------------------------------------------------------------------------------
# The engine options this benchmark uses, with ServerArgs's names, defaults and help.
_ENGINE_OPTIONS = {
    "model_path": str, "load_format": str, "dtype": str, "device": str, "attention_backend": str,
    "page_size": int, "max_total_tokens": int, "mem_fraction_static": float, "random_seed": int,
    "disable_cuda_graph": bool, "disable_piecewise_cuda_graph": bool, "kv_cache_dtype": str, "tp_size": int, "dist_timeout": float,
    "quantization": str, "enable_elastic_kv": bool, "elastic_kv_page_mb": float, "disable_overlap_schedule": bool,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in fields(ServerArgs):
        if f.name in _ENGINE_OPTIONS:
            helptext = f.metadata.get("help", "")
            if f.name == "model_path":
                helptext = "HF folder, .gguf file or dummy name (default: the workload's model)"
            elif f.name == "max_total_tokens":
                helptext += " (default: the largest case, bs x (input + output))"
            flag = "--" + f.name.replace("_", "-")
            if _ENGINE_OPTIONS[f.name] is bool:
                parser.add_argument(flag, action="store_true", help=helptext)
            else:
                parser.add_argument(flag, type=_ENGINE_OPTIONS[f.name], default=f.default, help=helptext)
    add = parser.add_argument
    add("--workload", choices=sorted(WORKLOADS), required=True, help="W2 decode latency or W3 prefill (docs/benchmarks.md)")
    add("--batch-sizes", type=int, nargs="+", help="override the workload's batch sizes")
    add("--input-len", type=int, help="override the workload's input length")
    add("--output-len", type=int, help="tokens generated per request, the prefill's included (1: prefill only)")
    add("--seed", type=int, default=0, help="seed of the prompt token ids")
    add("--prefill-repeats", type=int, default=5, help="prefill-only cases (output length 1): timed runs, the median reported")
    add("--peak-bandwidth", type=float, default=H200_COPY_BANDWIDTH, help="B/s, the decode roofline")
    add("--gemv-bandwidth", type=float, default=H200_GEMV_BANDWIDTH, help="B/s that a plain GEMV reaches")
    add("--peak-flops", type=float, default=H200_BF16_FLOPS, help="FLOP/s, the prefill roofline")
    add("--compare-hf", action="store_true", help="also run HF transformers on the same shapes")
    add("--output-json", help="append the JSON lines to this file")
    add("--torch-threads", type=int, help="torch.set_num_threads for both backends (default: torch's own)")
    add("--lora-adapters", type=int, nargs="+", metavar="N",
        help="serve random LoRA adapters (bench.lora_adapters) and run every case with N distinct ones in the batch, "
             "for each N given (0: none, on the same LoRA-enabled runner)")
    add("--lora-rank", type=int, default=16, help="rank of the --lora-adapters, on every linear layer")
    add("--engine", action="store_true",
        help="time the Engine (its scheduler, with overlap scheduling unless --disable-overlap-schedule) instead of "
             "the bare runner's synchronous steps; the mean decode step from whole generations")
    add("--kernel-profile", metavar="PATH",
        help="after each decode case, profile a few more steps and append where their time goes (kernels on a GPU, "
             "operators on a CPU) to PATH as JSON lines (bench.kernel_profile)")
    args = parser.parse_args(argv)
    for name in ("input_len", "output_len", "torch_threads", "prefill_repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.batch_sizes and min(args.batch_sizes) < 1:
        parser.error("--batch-sizes must all be >= 1")
    if args.lora_adapters and (min(args.lora_adapters) < 0 or args.lora_rank < 1):
        parser.error("--lora-adapters must all be >= 0 and --lora-rank >= 1")
    if args.engine:
        for flag in ("lora_adapters", "kernel_profile"):
            if getattr(args, flag):
                parser.error(f"--{flag.replace('_', '-')} times the bare runner: leave out --engine")
        if args.tp_size > 1:
            parser.error("--engine runs one rank: leave out --tp-size")
    elif args.disable_overlap_schedule:
        parser.error("--disable-overlap-schedule is the Engine's: the bare runner never overlaps (add --engine)")
    try:
        args.workload_spec = workload_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    return args


def workload_from_args(args: argparse.Namespace) -> Workload:
    """The workload with the command line's overrides. ``--batch-sizes`` and
    ``--input-len`` replace the cases by every batch size at that input length;
    the one not given comes from the workload (W3 has two input lengths, so
    ``--batch-sizes`` alone is ambiguous there)."""
    spec = WORKLOADS[args.workload]
    wl = spec
    if args.batch_sizes or args.input_len:
        spec_lens = sorted({n for _, n in spec.cases})
        if args.input_len is None and len(spec_lens) > 1:
            raise ValueError(f"{args.workload} has input lengths {spec_lens}: give --input-len with --batch-sizes")
        sizes = args.batch_sizes or [bs for bs, _ in spec.cases]
        input_len = args.input_len or spec_lens[0]
        wl = dataclasses.replace(wl, cases=tuple((bs, input_len) for bs in sizes))
    if args.output_len:
        wl = dataclasses.replace(wl, output_len=args.output_len)
    return wl


def environment(device: torch.device) -> dict:
    """Where the figures come from: device, software versions and this
    radixserve's sources (``source_fingerprint``)."""
    def version(pkg: str) -> str | None:
        try:
            return importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            return None

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device_name": name, "torch": torch.__version__, "transformers": version("transformers"),
            "triton": version("triton"), "date": time.strftime("%Y-%m-%d"), "source": source_fingerprint()}


class Report:
    """Turns timings into JSON lines: prints each, appends it to ``path`` (if
    any) and keeps it. ``common`` goes into every line of a backend."""

    def __init__(self, common: dict, shape: ModelShape, peaks: Peaks, output_len: int, path: str | None):
        self.common, self.shape, self.peaks, self.output_len, self.path = common, shape, peaks, output_len, path
        self.records: list[dict] = []

    def case(self, backend: str, bs: int, input_len: int, timing: Timing, **extra) -> dict:
        return self.emit({
            **self.common, "backend": backend, **extra,
            "batch_size": bs, "input_len": input_len, "output_len": self.output_len,
            **case_metrics(self.shape, self.peaks, bs, input_len, self.output_len, timing),
            "load_avg_1m": round(os.getloadavg()[0], 2),  # other processes on a small CPU skew the figures
        })

    def summary(self, ours: dict, hf: dict) -> dict:
        keys = ("bench", "workload", "full_size", "model", "device", "batch_size", "input_len", "output_len")
        line = {"summary": True, **{k: ours[k] for k in keys}}
        line["speedup_prefill"] = round(hf["prefill_ms"] / ours["prefill_ms"], 3)
        if self.output_len > 1:  # mean against mean: HF's steps are only known on average
            line["speedup_decode"] = round(hf["decode_mean_ms"] / ours["decode_mean_ms"], 3)
        return self.emit(line)

    def emit(self, record: dict) -> dict:
        self.records.append(record)
        line = json.dumps(record)
        print(line, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(line + "\n")
        return record


def build_runner(server_args: ServerArgs, model_config, wl: Workload, tp_rank: int = 0, init: str | None = None):
    """A ModelRunner (of TP rank ``tp_rank``) whose KV pool and request table fit the largest case."""
    from radixserve.managers.scheduler_factory import build_model_runner

    max_len = max(n for _, n in wl.cases) + wl.output_len
    if max_len > model_config.context_len:
        raise SystemExit(f"input + output = {max_len} tokens exceeds the context length {model_config.context_len}")
    return build_model_runner(server_args, model_config, tp_rank, init,
                              max_total_tokens=_pool_tokens(server_args, wl),
                              max_running_requests=max(bs for bs, _ in wl.cases), max_context_len=max_len)


def build_engine(server_args: ServerArgs, wl: Workload):
    """An ``Engine`` of the same options whose KV pool and running batch fit
    the largest case, its radix cache off (``run_engine_case``)."""
    from radixserve.entrypoints.engine import Engine

    options = {**dataclasses.asdict(server_args), "max_total_tokens": _pool_tokens(server_args, wl),
               "max_running_requests": max(bs for bs, _ in wl.cases), "disable_radix_cache": True,
               "disable_tqdm": True}
    return Engine(**options)


def fits(runner, case: tuple[int, int], output_len: int) -> bool:
    """Whether the runner's KV pool holds every request of ``case`` (batch
    size, input length) whole: the pool may come out smaller than asked
    where the weights leave little memory. A case that does not fit is
    reported as skipped, not run (an Engine would retract)."""
    bs, input_len = case
    return bs * page_aligned(input_len + output_len, runner.page_size) <= runner.max_total_tokens


def _pool_tokens(server_args: ServerArgs, wl: Workload) -> int:
    """``--max-total-tokens``, else every request of the largest case whole."""
    page = server_args.page_size
    return server_args.max_total_tokens or max(bs * page_aligned(n + wl.output_len, page) for bs, n in wl.cases)


ALLREDUCE_REPEATS = 50


def allreduce_ms_per_step(runner, batch_size: int) -> float | None:
    """What a decode step's all-reduces cost alone: two per layer (after
    attention and after the MLP) of ``[batch_size, hidden]`` activations, plus
    the embedding's, timed eagerly on this rank's device (every rank calls it)."""
    group = runner.tp_group
    if group.size == 1:
        return None
    config = runner.model_config
    x = torch.ones(batch_size, config.hidden_size, dtype=runner.dtype, device=runner.device)
    per_step = 2 * config.num_hidden_layers + 1
    group.all_reduce(x)
    sync(runner.device)
    start = time.perf_counter()
    for _ in range(ALLREDUCE_REPEATS * per_step):
        group.all_reduce(x)
    sync(runner.device)
    return (time.perf_counter() - start) / ALLREDUCE_REPEATS * 1e3


def _follower(argv: list[str] | None, tp_rank: int, init: str) -> None:
    """TP ranks 1..: the same cases as rank 0, nothing reported."""
    main(argv, tp_rank, init)


def _start_followers(argv: list[str] | None, tp_size: int) -> tuple[str, list]:
    """Where the ranks meet, and the processes of ranks 1.. (spawned)."""
    import multiprocessing as mp

    from radixserve.entrypoints.launcher import free_local_port

    init = f"tcp://127.0.0.1:{free_local_port()}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_follower, args=(argv, rank, init), daemon=True) for rank in range(1, tp_size)]
    for p in procs:
        p.start()
    return init, procs


def main(argv: list[str] | None = None, tp_rank: int = 0, init: str | None = None) -> list[dict]:
    """Run the workload's cases; with ``--tp-size N``, rank 0 (this call)
    starts ranks 1.. as processes running the same cases."""
    from radixserve.layers.sampler import Sampler
    from radixserve.model_loader import resolve_model

    argv = sys.argv[1:] if argv is None else argv  # the followers parse the same
    args = parse_args(argv)
    followers = []
    if args.tp_size > 1 and tp_rank == 0:
        init, followers = _start_followers(argv, args.tp_size)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    wl, spec = args.workload_spec, WORKLOADS[args.workload]
    engine = {name: getattr(args, name) for name in _ENGINE_OPTIONS}
    model_path = engine["model_path"] or wl.model_path
    device = torch.device(ServerArgs(**engine).resolved_device())  # validates them
    model_config = resolve_model(model_path, engine["load_format"], engine["dtype"], str(device))
    lora = {}
    if args.lora_adapters:
        from radixserve.bench.lora_adapters import server_options

        lora = server_options(model_config, args.lora_adapters, args.lora_rank)
    server_args = ServerArgs(**engine, **lora)
    bench_engine = build_engine(server_args, wl) if args.engine else None
    runner = bench_engine.scheduler.model_runner if bench_engine else build_runner(server_args, model_config, wl,
                                                                                   tp_rank, init)
    if tp_rank > 0:
        _run_cases(runner, Sampler(), wl, {c: make_prompts(*c, model_config.vocab_size, args.seed) for c in wl.cases},
                   args.prefill_repeats, args.lora_adapters, args.kernel_profile, None)
        runner.shutdown()
        return []
    report = Report({
        "bench": "one_batch", "workload": args.workload, "full_size": wl == spec and model_path == spec.model_path,
        "model": os.path.basename(model_path.rstrip("/")), "device": device.type,
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "kv_cache_dtype": str(runner.kv_cache_dtype).removeprefix("torch."), "quantization": runner.quantization,
        "torch_threads": torch.get_num_threads(),
        "tp_size": runner.tp_size, "prefill_repeats": args.prefill_repeats if wl.output_len == 1 else 1,
        **environment(device),
    }, ModelShape.of(runner.model, model_config, runner.head_layout, runner.kv_cache_dtype), Peaks(args.peak_bandwidth, args.gemv_bandwidth, args.peak_flops),
        wl.output_len, args.output_json)
    prompts = {case: make_prompts(*case, model_config.vocab_size, args.seed) for case in wl.cases}

    ours = {}
    profiled = {k: report.common[k] for k in ("workload", "model", "device", "dtype", "quantization", "tp_size")}
    for case in wl.cases:
        if not fits(runner, case, wl.output_len):  # the others still run
            report.emit({**report.common, "backend": "radixserve", "batch_size": case[0], "input_len": case[1],
                         "output_len": wl.output_len, "kv_pool_tokens": runner.max_total_tokens,
                         "skipped": f"the KV pool cannot hold {case[0]} x {case[1] + wl.output_len} tokens"})
    if bench_engine:
        results = {(case, None): (run_engine_case(bench_engine, prompts[case], wl.output_len)[0], None)
                   for case in wl.cases if fits(runner, case, wl.output_len)}
    else:
        results = _run_cases(runner, Sampler(), wl, prompts, args.prefill_repeats, args.lora_adapters,
                             args.kernel_profile, {"bench": "one_batch_kernels", **profiled})
    driver = {"driver": "engine", "overlap": bench_engine.scheduler.overlap} if bench_engine else {"driver": "runner"}
    for (case, adapters), (timing, allreduce_ms) in results.items():
        ours[case] = report.case("radixserve", *case, timing, **driver,
                                 attention_backend=server_args.resolved_attention_backend(),
                                 cuda_graph=runner.cuda_graph_runner is not None,
                                 piecewise_cuda_graph=runner.piecewise_runner is not None, page_size=server_args.page_size,
                                 kv_pool_tokens=runner.max_total_tokens, allreduce_ms_per_step=allreduce_ms,
                                 **({"lora_adapters": adapters, "lora_rank": args.lora_rank} if adapters is not None
                                    else {}))
    if bench_engine:
        bench_engine.shutdown()
        del bench_engine
    else:
        runner.shutdown()
    for p in followers:
        p.join(timeout=60)
    if args.compare_hf:
        del runner  # our weights and KV pool go before HF's model comes
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        hf_model = load_hf_model(model_config, device)
        for case in ours:
            try:
                timing = run_hf_case(hf_model, prompts[case], wl.output_len, device, args.prefill_repeats)
            except torch.OutOfMemoryError as exc:  # "where it fits": HF's cache may not, beside its weights
                timing = f"out of memory: {str(exc).splitlines()[0]}"
            if isinstance(timing, str):  # the next case starts with the failed one's blocks returned
                torch.cuda.empty_cache()
                report.emit({**report.common, "backend": "hf_transformers", "batch_size": case[0],
                             "input_len": case[1], "output_len": wl.output_len, "error": timing})
            else:
                report.summary(ours[case], report.case("hf_transformers", *case, timing))
    return report.records


def _run_cases(runner, sampler, wl: Workload, prompts: dict, repeats: int, lora_counts: list[int] | None,
               kernel_profile: str | None, profile_fields: dict | None) -> dict:
    """Each (case, distinct adapters) timing and, under TP, its all-reduce
    cost per decode step (every rank runs this, in the same order). With
    ``kernel_profile``, each decode case then runs again under the profiler;
    the rank given ``profile_fields`` writes its table."""
    from radixserve.bench.lora_adapters import spread

    out = {}
    for case in filter(lambda case: fits(runner, case, wl.output_len), wl.cases):
        for count in lora_counts or [None]:
            lora = spread(runner.lora_manager, case[0], count) if count else None
            timing, _ = warm_and_run(runner, sampler, prompts[case], wl.output_len, repeats, lora)
            out[case, count] = timing, allreduce_ms_per_step(runner, case[0])
            if kernel_profile and wl.output_len >= 3:
                case_info = {**(profile_fields or {}), "batch_size": case[0], "input_len": case[1], "lora_adapters": count}
                _profile_case(runner, sampler, prompts[case], wl.output_len, lora, kernel_profile,
                              case_info if profile_fields is not None else None)
    return out


def _profile_case(runner, sampler, prompts: torch.Tensor, output_len: int, lora, path: str,
                  case_fields: dict | None) -> None:
    """Decode steps of one case under ``bench.kernel_profile`` (up to
    ``PROFILED_STEPS``, the profiler's warm-up step aside); the table goes to
    ``path`` when ``case_fields`` is given."""
    from radixserve.bench.kernel_profile import decode_profiler, host_rows, idle_rows, kernel_rows, timeline, write_rows

    steps = min(PROFILED_STEPS, output_len - 2)
    prof = decode_profiler(runner.device, steps)
    with prof:
        run_case(runner, sampler, prompts, steps + 2, lora, on_step=prof.step)
    if case_fields is not None:
        rows = kernel_rows(prof, runner.device, steps)
        if runner.device.type == "cuda":
            rows += host_rows(prof, steps) + idle_rows(*timeline(prof))
        write_rows(path, {**case_fields, "profiled_steps": steps}, rows)


if __name__ == "__main__":
    main()
