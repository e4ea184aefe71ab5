"""Two radixserve replicas behind sglang-router on the CPU: the scaled-down W4
(generated shared prefix, more group prompts than one replica's KV pool holds)
through ``--policy cache_aware``, then ``round_robin``, then against one replica
alone; and one server of two replicas (``--dp-size 2``) with
``--load-balance-method cache_aware`` and ``round_robin`` (configs
``dp_cache_aware``, ``dp_round_robin``). Prints one JSON line per configuration: hit rate (and the dataset's
ideal), output throughput, TTFT p50/p99, and the per-replica breakdown that
``bench.serving --worker-urls`` reads from the workers.

    python benchmarks/router_cpu.py --out-dir /tmp/router-cpu > results/DATE_cpu-2core_router_w4.jsonl

The replicas start once (SmolLM2 by default, ``OMP_NUM_THREADS`` threads each:
one core per replica on a 2-core host) and serve every configuration; each
router starts and stops around its run, and bench.serving flushes the caches
before each. ``--rounds 2`` runs the configurations again in reverse order.
Every process started is stopped at the end, also on errors and Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child in its own process group, logging to ``log``; ``stop`` ends the group."""

    def __init__(self, cmd: list[str], log: Path, env: dict | None = None):
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=HERE,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def wait_until(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what}: exited with {self.proc.returncode} (log: {self.log.name})")
            try:
                if ready():
                    return
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{what}: not ready after {timeout:g} s (log: {self.log.name})")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


def start_replica(args, i: int) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port),
           "--max-total-tokens", str(args.pool), *args.server_args.split()]
    proc = Proc(cmd, args.out_dir / f"replica{i}.log", env={"OMP_NUM_THREADS": str(args.threads)})
    return proc, f"http://127.0.0.1:{port}"


def dp_run(args, label: str, method: str) -> tuple[dict, list[dict]]:
    """One server of two replicas (--dp-size 2) with ``method``: its bench
    run and each replica's requests and hit rate, from its internal states."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--max-total-tokens", str(args.pool),
           "--dp-size", "2", "--load-balance-method", method, *args.server_args.split()]
    proc = Proc(cmd, args.out_dir / f"{label}-server.log", env={"OMP_NUM_THREADS": str(args.threads)})
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 300, url)
        run = bench(args, label, url, [url])
        states = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"]
    finally:
        proc.stop()
    replicas = [{"dp_rank": st["dp_rank"], "prompt_tokens": st["prompt_tokens"],
                 "hit_rate": r3(st["cached_tokens"] / max(st["prompt_tokens"], 1))} for st in states]
    return run, replicas


def start_router(args, urls: list[str], policy: str) -> tuple[Proc, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", policy,
           "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
           "--prometheus-port", str(free_port()), "--log-level", "warn", *args.router_args.split()]
    proc = Proc(cmd, args.out_dir / f"router-{policy}.log")
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        workers = httpx.get(url + "/workers", timeout=2).json()["workers"]
        return {w["url"] for w in workers if w["is_healthy"]} == set(urls)

    proc.wait_until(ready, 60, f"router ({policy})")
    return proc, url


def bench(args, name: str, base_url: str, worker_urls: list[str]) -> dict:
    """One bench.serving run; its result file is OUT_DIR/NAME.json."""
    out = args.out_dir / f"{name}.json"
    cmd = [sys.executable, "-m", "radixserve.bench.serving", "--base-url", base_url, "--worker-urls", *worker_urls,
           "--disable-tqdm", "--label", name, "--output-json", str(out), "--no-tokenizer",
           "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(args.groups),
           "--gsp-prompts-per-group", str(args.prompts_per_group), "--gsp-system-prompt-len", str(args.system_len),
           "--gsp-question-len", str(args.question_len), "--gsp-output-len", str(args.output_len),
           "--max-concurrency", str(args.max_concurrency), "--seed", str(args.seed)]
    with open(args.out_dir / f"{name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=HERE)
        try:
            proc.wait(args.bench_timeout)
        except subprocess.TimeoutExpired:  # Ctrl-C: it reports the requests that finished ("interrupted")
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
    return json.loads(out.read_text())["runs"][0]


def r3(v: float | None) -> float | None:
    return None if v is None else round(v, 3)


def summary(name: str, replicas: int, run: dict, load: float | None) -> dict:
    """The figures of one configuration, for its JSON line."""
    return {"config": name, "replicas": replicas, "completed": run["completed"], "failed": run["failed"],
            "duration_s": r3(run["duration_s"]), "hit_rate": r3(run["cache_hit_rate"]),
            "ideal_hit_rate": r3(run["ideal_cache_hit_rate"]), "output_throughput": r3(run["output_throughput"]),
            "ttft_p50_ms": r3(run["ttft_ms"]["median"]), "ttft_p99_ms": r3(run["ttft_ms"]["p99"]),
            "host_load_1min": load,
            "workers": [{"url": w["url"], "requests": w["requests"], "hit_rate": r3(w["cache_hit_rate"])}
                        for w in run.get("workers", [])]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True, help="bench JSON files and process logs")
    p.add_argument("--configs", nargs="+", default=["cache_aware", "round_robin", "single"],
                   choices=["cache_aware", "round_robin", "single", "dp_cache_aware", "dp_round_robin"])
    p.add_argument("--rounds", type=int, default=1, help="repeat, every other round in reverse order")
    p.add_argument("--pool", type=int, default=1536, help="--max-total-tokens of each replica")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each replica")
    # lpm: under fcfs, prompts of one group admitted in the same prefill batch cannot reuse each other
    # (benchmarks/README.md, W4 on the CPU), which would blur what the router's choice does
    p.add_argument("--server-args", default="--schedule-policy lpm",
                   help="radixserve options of each replica (e.g. add '--model-path tiny-llama')")
    p.add_argument("--router-args", default="", help="more launch_router options")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=8)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--bench-timeout", type=float, default=1800)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps({"workload": "W4 scaled down", "groups": args.groups, "prompts_per_group": args.prompts_per_group,
                      "system_len": args.system_len, "question_len": args.question_len, "output_len": args.output_len,
                      "max_concurrency": args.max_concurrency, "pool_per_replica": args.pool,
                      "group_prefix_tokens": args.groups * args.system_len, "threads_per_replica": args.threads,
                      "server_args": args.server_args, "router_args": args.router_args}), flush=True)
    procs: list[Proc] = []
    try:
        replicas = [start_replica(args, i) for i in range(2)]
        procs += [proc for proc, _ in replicas]
        for proc, url in replicas:
            proc.wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, 300, url)
        urls = [url for _, url in replicas]
        for rnd in range(args.rounds):
            for name in (args.configs if rnd % 2 == 0 else args.configs[::-1]):
                label = name if args.rounds == 1 else f"{name}-r{rnd + 1}"
                if name.startswith("dp_"):
                    run, per_replica = dp_run(args, label, name.removeprefix("dp_"))
                    line = summary(label, 2, run, os.getloadavg()[0])
                    line["workers"] = per_replica  # the replicas inside the one server
                    print(json.dumps(line), flush=True)
                    continue
                if name == "single":
                    run = bench(args, label, urls[0], urls[:1])
                    print(json.dumps(summary(label, 1, run, os.getloadavg()[0])), flush=True)
                    continue
                router, router_url = start_router(args, urls, name)
                procs.append(router)
                try:
                    run = bench(args, label, router_url, urls)
                finally:
                    router.stop()
                    procs.remove(router)
                print(json.dumps(summary(label, 2, run, os.getloadavg()[0])), flush=True)
    finally:
        for proc in procs:
            proc.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
