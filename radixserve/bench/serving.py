"""bench-serving: drive a running server as users do, over HTTP with streaming,
and measure TTFT, TPOT, ITL, end-to-end latency, throughput, goodput, prefix-cache
hit rate and peak batch size (SGLang's ``bench_serving``, for radixserve).

    python -m radixserve.launch_server &
    python -m radixserve.bench.serving --dataset-name random --num-prompts 64 \\
        --random-input-len 256 --random-output-len 64 --request-rate inf
    python -m radixserve.bench.serving --dataset-name generated-shared-prefix \\
        --gsp-num-groups 8 --gsp-prompts-per-group 8 --request-rate 1 2 inf --plot

Against sglang-router (docs/router.md), ``--worker-urls`` names the workers
behind it: their own counters, read before and after each rate, give the
requests and hit rate of each replica (``serving_workers.py``).

Requests arrive as a Poisson process at ``--request-rate`` per second (``inf``:
all at once; several rates run one after another over the same prompts). The
table goes to stderr, one JSON line per rate to stdout, everything to
``--output-json``. Ctrl-C stops the run and reports what finished.

Metrics are pure functions of ``RequestRecord``s (start time, arrival time and
cumulative token count of each streamed chunk, end time), so they can be checked
on a hand-made timeline. A chunk that brings n tokens after a gap g counts as n
inter-token latencies of g / n (SGLang's convention).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import numpy as np

# The metric functions are re-exported: callers and tests use them from here.
from radixserve.bench.serving_metrics import (RequestRecord, compute_metrics, counters_hit_rate, e2e, itls,  # noqa: F401
                                              meets_slo, parse_prometheus_gauges, record_to_json, summarize, tpot,
                                              ttft)
from radixserve.bench.serving_plots import plot_compare, plot_latencies, plot_rates
from radixserve.bench.serving_report import format_table, write_json
from radixserve.bench.serving_workers import (http_call, poll_server, read_server_state, read_workers, total_counters,
                                              worker_breakdown)
from radixserve.bench.datasets import (Conversation, Dataset, TokenSampler, generated_shared_prefix_dataset,
                                       jsonl_dataset, multi_turn_dataset, random_dataset)
from radixserve.bench.serving_backends import (BACKENDS, Chunk, NativeBackend, OpenAIChatBackend,  # noqa: F401
                                               OpenAICompletionsBackend, make_backend)

# --------------------------------------------------------------------------- the client


@dataclass
class ClientConfig:
    base_url: str
    backend: str = "radixserve"
    model: str = ""
    api_key: str | None = None
    sampling: dict = field(default_factory=dict)  # extra sampling params (temperature, ignore_eos, ...)
    request_timeout: float = 3600.0
    incremental: bool = False  # the server streams what is new (--incremental-streaming-output; from /get_server_info)
    lora_names: list[str] = field(default_factory=list)  # conversation i uses lora_names[i % n] (none: the base model)

    def lora(self, conv_id: int) -> str | None:
        return self.lora_names[conv_id % len(self.lora_names)] if self.lora_names else None

    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def render_prompt(segments: list, backend, tokenizer) -> Any:
    """The prompt of one turn from the history's segments (user messages and
    replies, each text or token ids): ids if every segment is ids and the
    backend takes ids, else text; chat messages for the chat backend."""
    def text(seg):
        if isinstance(seg, str):
            return seg
        if tokenizer is None:
            raise ValueError("this backend needs text: a token-id prompt needs the tokenizer (--tokenizer)")
        return tokenizer.decode(seg)

    if backend.chat:
        return [{"role": "user" if i % 2 == 0 else "assistant", "content": text(s)} for i, s in enumerate(segments)]
    if all(not isinstance(s, str) for s in segments):
        return [t for s in segments for t in s]
    return "".join(text(s) for s in segments)


async def send_request(client, cfg: ClientConfig, backend, prompt, max_tokens: int, record: RequestRecord,
                       lora: str | None = None) -> Chunk:
    """Stream one request (under LoRA adapter ``lora``) into ``record``; returns
    the last reply (its text / ids). Events read in one go from the socket
    share their arrival time."""
    last, reply_text, tokens = Chunk(), "", 0
    body = backend.payload(prompt, max_tokens, cfg.sampling, cfg.model, lora)
    record.start = time.perf_counter()
    try:
        async with client.post(cfg.base_url + backend.path, json=body, headers=cfg.headers()) as resp:
            if resp.status != 200:
                record.error = f"HTTP {resp.status}: {(await resp.text(errors='replace'))[:300]}"
                return last
            async for line, now in _sse_lines(resp):
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                if payload == "[DONE]":
                    break
                chunk = backend.parse(json.loads(payload), tokens)
                if chunk.error:
                    record.error = chunk.error
                    return last
                if chunk.arrived:
                    record.chunk_times.append(now)
                    record.chunk_tokens.append(chunk.tokens)
                    tokens = chunk.tokens if chunk.tokens is not None else tokens + 1
                reply_text = chunk.text if backend.cumulative else reply_text + chunk.text
                last.finished |= chunk.finished
                for name in ("prompt_len", "cached_tokens", "completion_tokens"):
                    if getattr(chunk, name) is not None:
                        setattr(last, name, getattr(chunk, name))
                if chunk.output_ids is not None:
                    last.output_ids = (chunk.output_ids if backend.cumulative
                                       else (last.output_ids or []) + chunk.output_ids)
    except Exception as exc:  # noqa: BLE001 - any transport failure is a failed request, not a crash
        record.error = f"{type(exc).__name__}: {exc}"
        return last
    record.end = time.perf_counter()
    last.text = reply_text
    record.prompt_len = last.prompt_len if last.prompt_len is not None else record.prompt_len
    record.output_len = last.completion_tokens if last.completion_tokens is not None else len(record.chunk_times)
    record.cached_tokens = last.cached_tokens
    record.success = bool(record.chunk_times) and last.finished
    if not record.success:
        record.error = "the stream ended before the reply finished"
    return last


async def _sse_lines(resp) -> AsyncIterator[tuple[str, float]]:
    """A streamed body's lines, each with the time its bytes arrived. Splits
    the raw reads itself: aiohttp's line iterator refuses lines past its
    buffer size, and a cumulative reply's events grow with the reply."""
    rest = b""
    async for data in resp.content.iter_any():
        now = time.perf_counter()
        *lines, rest = (rest + data).split(b"\n")
        for line in lines:
            yield line.decode(errors="replace").rstrip("\r"), now
    if rest:
        yield rest.decode(errors="replace"), time.perf_counter()


@dataclass
class RunState:
    """What a run has seen so far; kept outside the event loop so Ctrl-C can report it."""

    records: list[RequestRecord] = field(default_factory=list)
    sent: int = 0  # requests sent ...
    answered: int = 0  # ... and those whose reply ended (well or not)
    start: float = 0.0
    end: float = 0.0
    peak_running: int | None = None
    peak_waiting: int | None = None
    peak_kv_usage: float | None = None
    # 1-minute load average of this host at the start and the end: on a shared
    # machine it says how much the neighbours took (the server is usually local)
    load_start: float = field(default_factory=lambda: _loadavg())

    def duration(self) -> float:
        end = self.end or max((r.end for r in self.records if r.success), default=self.start)
        return max(end - self.start, 0.0)


async def run_conversation(client, cfg: ClientConfig, backend, tokenizer, conv: Conversation, conv_id: int,
                           sem: asyncio.Semaphore | None, state: RunState, on_done: Callable[[], None]) -> None:
    """Send a conversation's turns in order, each with the history of the ones before."""
    history: list = []
    history_tokens = 0  # the prompt length if the server does not report it
    for k, turn in enumerate(conv.turns):
        record = RequestRecord(conv_id, k, time.perf_counter(), prompt_len=history_tokens + turn.prompt_len)
        segments = history + [turn.prompt]
        try:
            prompt = render_prompt(segments, backend, tokenizer)
        except ValueError as exc:
            record.error = str(exc)
        else:
            async with sem or contextlib.nullcontext():
                state.sent += 1
                last = await send_request(client, cfg, backend, prompt, turn.output_len, record, cfg.lora(conv_id))
                state.answered += 1
        state.records.append(record)
        on_done()
        if not record.success:
            for j in range(k + 1, len(conv.turns)):  # the rest of a broken conversation cannot be sent
                state.records.append(RequestRecord(conv_id, j, record.start, error="an earlier turn failed"))
                on_done()
            return
        # token ids in, token ids back: the next turn's history stays exact
        reply = last.output_ids if last.output_ids is not None and not isinstance(prompt, str) else last.text
        history = segments + [reply]
        history_tokens = record.prompt_len + record.output_len


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def arrival_offsets(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """Send times (s from the start) of a Poisson process at ``rate``/s; all 0 for inf."""
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


async def run_at_rate(client, cfg: ClientConfig, dataset: Dataset, rate: float, seed: int, tokenizer,
                      max_concurrency: int | None, state: RunState, poll_interval: float = 0.25,
                      progress: bool = True, worker_urls: list[str] | None = None) -> None:
    """Send every conversation, Poisson-spaced at ``rate``, and wait for all replies."""
    from tqdm import tqdm

    backend = make_backend(cfg.backend, cfg.incremental)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    offsets = arrival_offsets(len(dataset.conversations), rate, np.random.default_rng(seed))
    bar = tqdm(total=dataset.num_requests, desc=f"rate {rate:g}", disable=not progress, file=sys.stderr)
    poller = (asyncio.create_task(poll_server(client, cfg, state, poll_interval, worker_urls))
              if poll_interval > 0 else None)
    state.start = time.perf_counter()
    tasks = []
    try:
        for i, (conv, offset) in enumerate(zip(dataset.conversations, offsets)):
            delay = state.start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(
                run_conversation(client, cfg, backend, tokenizer, conv, i, sem, state, lambda: bar.update(1))))
        await asyncio.gather(*tasks)
        state.end = time.perf_counter()
    finally:
        for t in tasks + ([poller] if poller else []):
            t.cancel()
        bar.close()


# --------------------------------------------------------------------------- one benchmark invocation


def _make_dataset(args, vocab_size: int, special_ids, tokenizer) -> Dataset:
    sampler = TokenSampler(vocab_size, special_ids, seed=args.seed)
    if args.dataset_name == "random":
        return random_dataset(sampler, args.num_prompts, args.random_input_len, args.random_output_len,
                              args.random_range_ratio)
    if args.dataset_name == "generated-shared-prefix":
        return generated_shared_prefix_dataset(sampler, args.gsp_num_groups, args.gsp_prompts_per_group,
                                               args.gsp_system_prompt_len, args.gsp_question_len,
                                               args.gsp_output_len, ordered=args.gsp_ordered)
    if args.dataset_name == "multi-turn":
        return multi_turn_dataset(sampler, args.num_prompts, args.mt_num_turns, args.mt_first_input_len,
                                  args.mt_turn_input_len, args.mt_output_len)
    return jsonl_dataset(args.dataset_path, args.num_prompts, tokenizer, args.jsonl_output_len, args.jsonl_multi_turn)


def _load_tokenizer(path: str | None):
    if not path:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


SERVER_FIELDS = ("version", "schedule_policy", "disable_radix_cache", "max_total_tokens",
                 "max_running_requests", "chunked_prefill_size", "page_size", "device", "dtype")


async def _get_json(client, cfg: ClientConfig, path: str) -> dict | None:
    try:
        status, text = await http_call(client, "GET", cfg.base_url + path, cfg.headers(), 30)
        return json.loads(text) if status == 200 else None
    except Exception:  # noqa: BLE001
        return None


async def _flush_cache(client, cfg: ClientConfig, wait_s: float = 30.0) -> bool:
    """radixserve refuses (400) while requests run, e.g. the aborted tail of a
    run stopped by Ctrl-C: retry for up to ``wait_s`` seconds."""
    deadline = time.perf_counter() + wait_s
    while True:
        try:
            status, _ = await http_call(client, "POST", cfg.base_url + "/flush_cache", cfg.headers(), 30)
        except Exception:  # noqa: BLE001
            return False
        if status != 400 or time.perf_counter() > deadline:
            return status == 200
        await asyncio.sleep(0.5)


async def _warmup(client, cfg: ClientConfig, n: int, sampler: TokenSampler) -> None:
    """Short requests unrelated to the dataset, so they leave nothing it could reuse."""
    backend = make_backend(cfg.backend, cfg.incremental)
    prompt = [{"role": "user", "content": "Say hello."}] if backend.chat else sampler.ids(16)
    records = [RequestRecord(-1, 0, 0.0) for _ in range(n)]
    await asyncio.gather(*(send_request(client, cfg, backend, prompt, 8, r) for r in records))
    failed = [r.error for r in records if not r.success]
    if failed:
        raise RuntimeError(f"warm-up failed: {failed[0]}")


def run_result(args, rate: float, state: RunState, dataset: Dataset, before: dict | None, after: dict | None,
               interrupted: bool = False, workers: tuple[dict, dict] | None = None) -> dict:
    """One rate's figures; ``workers``: the counters of the workers behind a
    router (``--worker-urls``) before and after, for the per-replica breakdown
    (the hit rate is then theirs summed, unless the server itself counts)."""
    metrics = compute_metrics(state.records, state.duration(), args.slo_ttft, args.slo_tpot)
    if workers and counters_hit_rate(before, after) is None:
        before, after = total_counters(workers[0]), total_counters(workers[1])
    return {"label": args.label, "backend": args.backend, "dataset": dataset.name,
            "request_rate": "inf" if math.isinf(rate) else rate,  # strict JSON has no Infinity
            "max_concurrency": args.max_concurrency, "interrupted": interrupted,
            "unfinished": state.sent - state.answered,
            **metrics,
            "cache_hit_rate": counters_hit_rate(before, after),
            "ideal_cache_hit_rate": dataset.summary()["ideal_cache_hit_rate"],
            "peak_running_requests": state.peak_running, "peak_waiting_requests": state.peak_waiting,
            "peak_kv_usage": state.peak_kv_usage, "host_load_1min": [state.load_start, _loadavg()],
            **({"workers": worker_breakdown(*workers)} if workers else {}),
            **({"requests": [record_to_json(r, state.start) for r in state.records]} if args.save_requests else {})}


def _report(args, output: dict, res: dict) -> None:
    output["runs"].append(res)
    print(format_table(res), file=sys.stderr, flush=True)
    print(json.dumps(res), flush=True)
    if args.output_json:
        write_json(args.output_json, output)


async def _benchmark(args, cfg: ClientConfig, output: dict, live: dict,
                     kept: list[tuple[str, list[RequestRecord]]]) -> None:
    """Warm up, then run each request rate; ``live`` holds the run in progress
    (for a Ctrl-C report), ``kept`` each finished run's records (for the plots)."""
    import aiohttp  # as SGLang's bench_serving: httpx's streams could not keep up with a few hundred (docs/benchmarks.md)

    timeout = aiohttp.ClientTimeout(total=cfg.request_timeout, sock_connect=30)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as client:
        info = await _get_json(client, cfg, "/get_model_info") or {}
        server = await _get_json(client, cfg, "/get_server_info") or {}
        cfg.incremental = bool(server.get("incremental_streaming_output"))
        if not cfg.model:
            models = await _get_json(client, cfg, "/v1/models") or {}
            cfg.model = ((models.get("data") or [{}])[0].get("id") or info.get("served_model_name") or "default")
        tokenizer = None if args.no_tokenizer else _load_tokenizer(args.tokenizer or info.get("tokenizer_path"))
        vocab = args.vocab_size or info.get("vocab_size") or (len(tokenizer) if tokenizer else None)
        if vocab is None:
            raise SystemExit("the vocabulary size is unknown: pass --vocab-size or --tokenizer")
        if tokenizer is not None:
            vocab = min(vocab, len(tokenizer))
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder) if tokenizer else set()
        dataset = _make_dataset(args, vocab, special, tokenizer)
        output["dataset"] = dataset.summary()
        output["server"] = {"model": cfg.model, "context_length": info.get("context_length"),
                            **{k: server[k] for k in SERVER_FIELDS if k in server}}
        print(f"dataset: {json.dumps(output['dataset'])}", file=sys.stderr)
        if args.warmup_requests:
            await _warmup(client, cfg, args.warmup_requests, TokenSampler(vocab, special, seed=args.seed + 1))
        for rate in args.request_rate:
            if not args.disable_flush_cache and not await _flush_cache(client, cfg):
                print("warning: /flush_cache refused or missing; earlier runs may warm the cache", file=sys.stderr)
            state = RunState()
            before = await read_server_state(client, cfg)
            workers_before = await read_workers(client, args.worker_urls, cfg.headers()) if args.worker_urls else None
            live.update(rate=rate, state=state, dataset=dataset, before=before)
            await run_at_rate(client, cfg, dataset, rate, args.seed, tokenizer, args.max_concurrency, state,
                              args.poll_interval, not args.disable_tqdm, args.worker_urls)
            after = await read_server_state(client, cfg)
            workers = ((workers_before, await read_workers(client, args.worker_urls, cfg.headers()))
                       if args.worker_urls else None)
            live.clear()
            kept.append((f"rate {rate:g}", state.records))
            _report(args, output, run_result(args, rate, state, dataset, before, after, workers=workers))


# --------------------------------------------------------------------------- CLI


def _rate(s: str) -> float:
    v = float(s)
    if not v > 0:
        raise argparse.ArgumentTypeError(f"a request rate must be > 0 (or inf), got {s}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m radixserve.bench.serving", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    a = p.add_argument
    a("--backend", choices=sorted(BACKENDS), default="radixserve")
    a("--base-url", help="server address (default http://HOST:PORT)")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=30000)
    a("--api-key")
    a("--worker-urls", nargs="+", metavar="URL",
      help="the workers behind a router at --base-url: read their counters before and after each rate and "
           "report requests and hit rate per worker")
    a("--model", default="", help="model name for the OpenAI routes (default: the server's first)")
    a("--lora-name", nargs="+", default=[], metavar="NAME",
      help="LoRA adapters loaded on the server: conversation i uses the (i mod n)-th, so they spread evenly")
    a("--tokenizer", help="tokenizer folder (default: the server's tokenizer_path)")
    a("--no-tokenizer", action="store_true", help="never load a tokenizer (token-id prompts only)")
    a("--vocab-size", type=int, help="draw random ids below this (default: the server's vocab_size)")
    a("--dataset-name", choices=("random", "generated-shared-prefix", "multi-turn", "jsonl"), default="random")
    a("--dataset-path", help="JSONL file for --dataset-name jsonl")
    a("--num-prompts", type=int, default=64, help="requests (random, jsonl) or conversations (multi-turn)")
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=256)
    a("--random-range-ratio", type=float, default=0.0, help="lengths are U[len * ratio, len]")
    a("--gsp-num-groups", type=int, default=64)
    a("--gsp-prompts-per-group", type=int, default=16)
    a("--gsp-system-prompt-len", type=int, default=2048)
    a("--gsp-question-len", type=int, default=128)
    a("--gsp-output-len", type=int, default=256)
    a("--gsp-ordered", action="store_true", help="send groups one after another (default: shuffled)")
    a("--mt-num-turns", type=int, default=4)
    a("--mt-first-input-len", type=int, default=256)
    a("--mt-turn-input-len", type=int, default=64)
    a("--mt-output-len", type=int, default=64)
    a("--jsonl-output-len", type=int, help="fixed output length for JSONL prompts")
    a("--jsonl-multi-turn", action="store_true", help="send every human turn of a ShareGPT record, with history")
    a("--request-rate", type=_rate, nargs="+", default=[math.inf], help="req/s (Poisson); inf = all at once")
    a("--max-concurrency", type=int, help="requests in flight at most")
    a("--seed", type=int, default=1)
    a("--temperature", type=float, default=0.0)
    a("--disable-ignore-eos", action="store_true", help="let replies stop at EOS (lengths then vary)")
    a("--extra-request-body", default="{}", help="JSON merged into every request's sampling parameters")
    a("--warmup-requests", type=int, default=1)
    a("--disable-flush-cache", action="store_true", help="do not POST /flush_cache before each rate")
    a("--slo-ttft", type=float, help="goodput: TTFT at most this many ms")
    a("--slo-tpot", type=float, help="goodput: TPOT at most this many ms")
    a("--request-timeout", type=float, default=3600.0, help="seconds")
    a("--poll-interval", type=float, default=0.25, help="s between server-state polls (0: none)")
    a("--label", default="", help="free text stored with the results (e.g. 'radix cache off')")
    a("--output-json", help="write every run's figures here")
    a("--save-requests", action="store_true", help="keep every request's timeline in the JSON (for --compare plots)")
    a("--plot", nargs="?", const="", default=None, metavar="PREFIX",
      help="write PNGs PREFIX-latency.png (and PREFIX-rates.png); default prefix: --output-json without .json")
    a("--compare", nargs="+", metavar="JSON", help="no run: draw --plot PREFIX-compare.png from result files")
    a("--disable-tqdm", action="store_true")
    return p


def _compare(args) -> int:
    """Plots over saved results: bars per run, and latency CDFs where the runs kept their requests."""
    runs = []
    for path in args.compare:
        with open(path, encoding="utf-8") as f:
            runs += json.load(f)["runs"]
    prefix = _plot_prefix(args)
    if len(runs) > 1:
        plot_compare(runs, prefix + "-compare.png")
    timelines = [(r.get("label") or str(r["request_rate"]), [RequestRecord(**d) for d in r["requests"]])
                 for r in runs if "requests" in r]
    if timelines:
        plot_latencies(timelines, prefix + "-latency.png")
    print(f"wrote {prefix}-*.png", file=sys.stderr)
    return 0


def _plot_prefix(args) -> str:
    if args.plot:
        return args.plot
    if args.output_json:
        return args.output_json[:-5] if args.output_json.endswith(".json") else args.output_json
    return "bench-serving"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare:
        return _compare(args)
    if args.dataset_name == "jsonl" and not args.dataset_path:
        raise SystemExit("--dataset-name jsonl needs --dataset-path")
    sampling = {"temperature": args.temperature, "ignore_eos": not args.disable_ignore_eos,
                **json.loads(args.extra_request_body)}
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    cfg = ClientConfig(base_url, args.backend, args.model, args.api_key, sampling, args.request_timeout,
                       lora_names=args.lora_name)
    config = {k: v for k, v in vars(args).items() if k not in ("output_json", "plot", "compare", "api_key")}
    config["request_rate"] = ["inf" if math.isinf(r) else r for r in args.request_rate]
    output: dict = {"config": config, "runs": []}
    live: dict = {}
    all_records: list[tuple[str, list[RequestRecord]]] = []
    try:
        asyncio.run(_benchmark(args, cfg, output, live, all_records))
    except KeyboardInterrupt:
        if live:
            state = live["state"]
            state.end = time.perf_counter()
            print("\ninterrupted: figures over the requests that finished", file=sys.stderr)
            _report(args, output, run_result(args, live["rate"], state, live["dataset"], live["before"], None, True))
            all_records.append((f"rate {live['rate']:g}", state.records))
        else:
            print("\ninterrupted", file=sys.stderr)
    if args.plot is not None and all_records:
        prefix = _plot_prefix(args)
        plot_latencies(all_records, prefix + "-latency.png")
        if len(output["runs"]) > 1:
            plot_rates(output["runs"], prefix + "-rates.png")
        print(f"wrote {prefix}-*.png", file=sys.stderr)
    return 0 if output["runs"] and all(r["failed"] == 0 for r in output["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
