"""sglang-router in front of real radixserve servers, for tests: the router
process, replicas started side by side, and each worker's own counters."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from server_harness import ServerProcess, free_port, start_all, terminate, wait_for

# Short health checks, so that a dead worker leaves the rotation within about a second.
FAST_HEALTH = ("--health-check-interval-secs", "1", "--health-check-timeout-secs", "1",
               "--health-failure-threshold", "1", "--health-success-threshold", "1")
# One replica per core on a small CPU host: two replicas with torch's default
# threads each would fight over the same cores.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


class RouterProcess:
    """``python -m sglang_router.launch_router`` over ``worker_urls``, with
    ``args`` added; the constructor returns once the router lists every worker
    (``healthy_urls``, by default ``worker_urls``: in PD mode ``args`` name the
    workers) as healthy and names the model. Its log goes to ``log_path``."""

    def __init__(self, worker_urls: list[str], *args: str, policy: str = "cache_aware",
                 log_path: Path | None = None, timeout: float = 60, healthy_urls: list[str] | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.worker_urls = list(healthy_urls or worker_urls)
        self.log = open(log_path, "w") if log_path else subprocess.DEVNULL
        workers = ["--worker-urls", *worker_urls] if worker_urls else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_router.launch_router", *workers, "--policy", policy,
             "--host", "127.0.0.1", "--port", str(self.port), "--prometheus-host", "127.0.0.1",
             "--prometheus-port", str(free_port()), "--log-level", "warn", *args],
            stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_for(self._ready, timeout, "the router listing every worker as healthy")
        except BaseException:
            self.stop()
            raise

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the router exited with {self.proc.returncode} during start-up")
        try:
            workers = httpx.get(self.url + "/workers", timeout=2).json()["workers"]
            models = httpx.get(self.url + "/v1/models", timeout=2).json()["data"]
        except (httpx.HTTPError, ValueError, KeyError):
            return False
        healthy = {w["url"] for w in workers if w.get("is_healthy")}
        return bool(models) and healthy == set(self.worker_urls)

    def stop(self) -> int:
        terminate(self.proc, 15)
        if self.log is not subprocess.DEVNULL:
            self.log.close()
        return self.proc.returncode


def start_servers(n: int, *args: str, env: dict | None = None) -> list[ServerProcess]:
    """``n`` servers with the same ``args``, started side by side (``start_all``)."""
    return start_all(*[args] * n, env=env)


def stop_all(*procs) -> None:
    """Stop every process given (ServerProcess or RouterProcess) side by side,
    even when one fails to stop; then raise the first failure."""
    with ThreadPoolExecutor(max(len(procs), 1)) as pool:
        futures = [pool.submit(proc.stop) for proc in procs]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]


def worker_counters(url: str) -> dict:
    """A worker's cumulative counters: finished ``requests`` (/metrics) and the
    scheduler's ``prompt_tokens`` and ``cached_tokens`` (/get_server_info);
    with its ``running`` and ``waiting`` requests now."""
    states = httpx.get(url + "/get_server_info", timeout=10).json()["internal_states"]  # one per --dp-size replica
    metrics = httpx.get(url + "/metrics", timeout=10).text
    requests = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("radixserve:num_requests_total"))
    keys = ("prompt_tokens", "cached_tokens", "running", "waiting")
    return {"requests": int(requests), **{k: sum(s[k] for s in states) for k in keys}}


def counters_delta(before: dict, after: dict) -> dict:
    return {k: after[k] - before[k] for k in ("requests", "prompt_tokens", "cached_tokens")}
