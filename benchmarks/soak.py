"""A soak: tens of thousands of mixed requests against one server, with the
resident memory of each of its processes sampled through the run, to tell a
leak (memory that grows with the requests served) from allocator growth
(memory that rises to a plateau). Prints one JSON line per sample and a
summary line last.

    python benchmarks/soak.py --requests 20000 --concurrency 16 [-- server args]

The mix (seeded): native ``/generate`` (plain, streamed, ``n`` = 2, stop
strings, logprobs), OpenAI chat (plain and streamed) and completions with
logprobs, JSON schemas (half of them new each time: the grammar cache turns
over), regular expressions, streams the client drops after the first event,
and bad requests (400s). Prompts are random words of 1 to 300 tokens, so the
radix cache fills the KV pool and then evicts. The server is SmolLM2 on the
CPU by default.

SIGINT or SIGTERM stops sending requests: the summary covers those done.
The summary gives each process's resident MB at 10%, 50% and 100% of the
requests and its slope over the second half in MB per 1,000 requests: a
leak keeps a slope there; allocator growth flattens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from radixserve.entrypoints.launcher import free_local_port

WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact be have do say get make go know take see come think look "
         "want give use find tell ask seem feel try leave call good new first last long great little own other old "
         "right big high different small large next early young important few public bad same able").split()
MODEL = ["default"]  # the served model's name, read from /v1/models at start
KINDS = {  # kind: weight
    "generate": 20, "stream": 12, "n2": 6, "stop": 6, "logprobs": 6, "chat": 12, "chat_stream": 8,
    "completion": 6, "json": 8, "regex": 4, "dropped": 6, "bad": 6,
}


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 300)))


def schema(rng: random.Random, fresh: int) -> str:
    """A small object schema: one of 50 seen before, or (half the time) a new one."""
    tag = fresh if rng.random() < 0.5 else rng.randrange(50)
    return json.dumps({"type": "object", "properties": {f"k{tag}": {"type": "string", "maxLength": 6},
                                                        "n": {"type": "integer"}}, "required": [f"k{tag}"]})


def one_request(client: httpx.Client, rng: random.Random, kind: str, i: int) -> int:
    """Send one request of ``kind``; its HTTP status."""
    sp = {"max_new_tokens": rng.randint(1, 16), "temperature": rng.choice([0.0, 0.7])}
    text = prompt(rng)
    if kind == "generate":
        return client.post("/generate", json={"text": text, "sampling_params": sp}).status_code
    if kind == "n2":
        return client.post("/generate", json={"text": text, "sampling_params": {**sp, "n": 2, "temperature": 0.8}}).status_code
    if kind == "stop":
        return client.post("/generate", json={"text": text, "sampling_params": {**sp, "stop": ["the", "."]}}).status_code
    if kind == "logprobs":
        return client.post("/generate", json={"text": text, "sampling_params": sp, "return_logprob": True,
                                              "top_logprobs_num": 3, "logprob_start_len": 0}).status_code
    if kind in ("stream", "dropped"):
        with client.stream("POST", "/generate", json={"text": text, "sampling_params": {**sp, "max_new_tokens": 16},
                                                      "stream": True}) as r:
            for _ in r.iter_lines():
                if kind == "dropped":
                    break  # the client leaves: the server aborts the request
            return r.status_code
    messages = [{"role": "user", "content": text[:400]}]
    if kind == "chat":
        return client.post("/v1/chat/completions", json={"model": MODEL[0], "messages": messages,
                                                         "max_tokens": sp["max_new_tokens"]}).status_code
    if kind == "chat_stream":
        with client.stream("POST", "/v1/chat/completions", json={"model": MODEL[0], "messages": messages,
                                                                 "max_tokens": sp["max_new_tokens"], "stream": True}) as r:
            for _ in r.iter_lines():
                pass
            return r.status_code
    if kind == "completion":
        return client.post("/v1/completions", json={"model": MODEL[0], "prompt": text, "max_tokens": sp["max_new_tokens"],
                                                    "logprobs": 2}).status_code
    if kind == "json":
        return client.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": 24, "json_schema": schema(rng, i)}}).status_code
    if kind == "regex":
        return client.post("/generate", json={"text": text, "sampling_params": {
            "max_new_tokens": 12, "regex": r"(yes|no), \d{1,3}"}}).status_code
    # bad: a field of the wrong type, a grammar that does not parse, a prompt past the context
    bad = rng.choice([{"text": text, "sampling_params": {"max_new_tokens": "many"}},
                      {"text": text, "sampling_params": {"regex": "(unclosed"}},
                      {"input_ids": [1] * 9000, "sampling_params": sp}])
    return client.post("/generate", json=bad).status_code


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and its descendants, by pid: a role read from the command line."""
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            for task in os.listdir(f"/proc/{p}/task"):  # a child is listed under the thread that started it
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            continue
        found[p] = role(cmd, p == pid)
    return found


def role(cmd: str, is_root: bool) -> str:
    if is_root:
        return "http"
    if "grammar_sandbox" in cmd:
        return "grammar_sandbox"
    if "spawn_main" in cmd or "multiprocessing" in cmd:
        return "child"
    return "other"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


def named(tree: dict[int, str]) -> dict[str, int]:
    """Stable names: http, scheduler and detokenizer (the two spawned children, told apart by size), others."""
    children = sorted((p for p, r in tree.items() if r == "child"), key=rss_mb, reverse=True)
    names = {"http": next(p for p, r in tree.items() if r == "http")}
    names.update(zip(("scheduler", "detokenizer"), children))
    names.update({r: p for p, r in tree.items() if r == "grammar_sandbox"})
    return names


def scheduler_figures(url: str) -> dict:
    """The scheduler's own view (``/get_server_info``): its malloc heap in use
    and kept free, and the caches that may grow to their bounds, in MB."""
    try:
        state = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
    except (httpx.HTTPError, KeyError, ValueError):
        return {}
    mem = state.get("process_memory", {})
    mb = {"malloc_in_use": mem.get("malloc_in_use_bytes"), "malloc_free": mem.get("malloc_free_bytes"),
          "trimmed": mem.get("trimmed_bytes"), "grammar_cache": state.get("grammar_cache_bytes")}
    return {"scheduler_mb": {k: round(v / 2**20, 1) for k, v in mb.items() if v is not None},
            "scheduler_python_blocks": mem.get("python_blocks"), "kv_cached_tokens": state.get("kv_cached")}


def series_of(samples: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """(requests done, MB) per process's resident memory and per scheduler figure."""
    out: dict[str, list[tuple[int, float]]] = {}
    for s in samples:
        for name, mb in s["rss_mb"].items():
            out.setdefault(f"rss:{name}", []).append((s["done"], mb))
        for name, mb in s.get("scheduler_mb", {}).items():
            out.setdefault(f"scheduler:{name}", []).append((s["done"], mb))
    return out


def summary(samples: list[dict], total: int) -> dict:
    out = {}
    for name, series in series_of(samples).items():
        at = lambda frac: next((mb for done, mb in series if done >= frac * total), series[-1][1])  # noqa: E731
        half = [(d, mb) for d, mb in series if d >= total / 2]
        slope = None
        if len(half) >= 3:
            n = len(half)
            mx, my = sum(d for d, _ in half) / n, sum(mb for _, mb in half) / n
            var = sum((d - mx) ** 2 for d, _ in half)
            slope = round(1000 * sum((d - mx) * (mb - my) for d, mb in half) / var, 3) if var else None
        out[name] = {"mb_at_10pct": round(at(0.1), 1), "mb_at_50pct": round(at(0.5), 1),
                     "mb_at_end": round(series[-1][1], 1), "mb_per_1k_requests_second_half": slope}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--sample-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("server_args", nargs="*", help="after --: options for the server")
    args = parser.parse_args()
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port",
                             str(port), *args.server_args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        run(url, proc, args)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def run(url: str, proc: subprocess.Popen, args) -> None:
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the server did not start")
        time.sleep(0.5)
    MODEL[0] = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
    rng = random.Random(args.seed)
    plan = rng.choices(list(KINDS), weights=list(KINDS.values()), k=args.requests)
    done, statuses, lock, stop = [0], {}, threading.Lock(), threading.Event()
    local = threading.local()
    start = time.monotonic()

    def work(i: int) -> None:
        if not hasattr(local, "client"):
            local.client = httpx.Client(base_url=url, timeout=300)
        try:
            status = one_request(local.client, random.Random(args.seed * 1_000_003 + i), plan[i], i)
        except httpx.HTTPError as exc:  # counted: the server dropped or stalled a connection
            status = type(exc).__name__
        with lock:
            done[0] += 1
            statuses[status] = statuses.get(status, 0) + 1

    samples = []

    def sample() -> None:
        names = named(process_tree(proc.pid))
        while not stop.wait(args.sample_s):
            try:
                rss = {name: round(rss_mb(pid), 1) for name, pid in names.items()}
            except OSError:
                names = named(process_tree(proc.pid))  # the grammar sandbox was replaced
                continue
            if len(names) < len(process_tree(proc.pid)):
                names = named(process_tree(proc.pid))
            line = {"t": round(time.monotonic() - start, 1), "done": done[0], "rss_mb": rss, **scheduler_figures(url)}
            samples.append(line)
            print(json.dumps(line), flush=True)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    interrupted = threading.Event()  # SIGINT or SIGTERM: no new requests, the summary of those done
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: interrupted.set())
    with ThreadPoolExecutor(args.concurrency) as pool:
        gate = threading.Semaphore(2 * args.concurrency)
        for i in range(args.requests):
            while not gate.acquire(timeout=0.5):
                if interrupted.is_set():
                    break
            if interrupted.is_set():
                break
            pool.submit(work, i).add_done_callback(lambda _: gate.release())
    time.sleep(args.sample_s * 2)  # the server idle: one more sample or two
    stop.set()
    sampler.join()
    elapsed = time.monotonic() - start
    print(json.dumps({"summary": True, "requests": done[0], "interrupted": interrupted.is_set(),
                      "concurrency": args.concurrency, "seconds": round(elapsed, 1),
                      "statuses": {str(k): v for k, v in sorted(statuses.items())},
                      "rss": summary(samples, done[0])}), flush=True)


if __name__ == "__main__":
    main()
