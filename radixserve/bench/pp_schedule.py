"""The micro-batch schedule of pipeline parallelism (docs/pipeline_parallel.md),
measured on the CPU: how busy each stage is during a steady decode with
``--micro-batches`` in flight, against one batch at a time.

    python -m radixserve.bench.pp_schedule [--pp-size 2] [--batch 32] [--micro-batches 1 2]
    python -m radixserve.bench.pp_schedule --model-path tiny-llama --load-format dummy   # a quick check

For each micro-batch count M it starts a server (``--pp-size N
--pp-micro-batches M``, a subprocess on a free port; the default model,
SmolLM2-135M, since a tiny model's forward is too short to show anything but
Python's overhead), sends ``--batch`` requests at once (random prompt ids,
``ignore_eos``, ``--output-len`` tokens each) and waits until every one has
streamed a token after its first (all of them decode). It then reads the
scheduler's counters twice, ``--measure-s`` apart (decode tokens/s, and the
mean tokens of a forward: the batch over M; unprofiled), and profiles ``--profile-steps`` scheduler steps
(``/start_profile``, CPU activities). From TP rank 0's trace of each stage,
over the profile's steady window (common to the stages, between forwards:
no idle time, and not the stalls of a profiler starting or writing its
trace, ``profile_window``):

- ``compute``: the share of the window in ``worker.forward`` (the model's layers);
- ``waiting``: the share in ``pp.wait_hidden`` (the previous stage's hidden
  states), ``pp.wait_tokens`` (the last stage's sampled tokens) and
  ``pp.wait_relay`` (the first stage's messages), each also given alone;
- ``busy``: ``1 - waiting`` (scheduling, sampling and the profiler's own
  cost count as busy).

``concurrent_forward`` is the share of the stages' common window in which at
least two stages run a forward at once (the stages share the host's
monotonic clock): zero with one batch at a time, what the micro-batches buy.
``forward_ms_by_micro_batch`` is each micro-batch's mean forward time on a
stage: unequal when the requests are split unevenly between them.
Profiling slows the host side of each step, so the fractions come from the
profiled steps and the throughput from the unprofiled ones before them.

Prints one JSON line; ``--output-json`` writes it too. Options after ``--`` go
to every server. Every server is stopped, also on errors.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout
from contextlib import contextmanager
from pathlib import Path

from radixserve.bench.datasets import TokenSampler
from radixserve.bench.trace_summary import busy_time
from radixserve.distributed.pipeline import PP_LAYER_PARTITION_ENV
from radixserve.entrypoints.launcher import free_local_port

FORWARD = "worker.forward"
TURN = "scheduler.next_batch"  # once per scheduler step: a micro-batch's turn
WAITS = ("pp.wait_hidden", "pp.wait_tokens", "pp.wait_relay")
# Output tokens between stream events after the first: fewer events keep the
# client and the HTTP process off the cores the stages run on.
STREAM_INTERVAL = 8
LOG_PROBLEMS = re.compile(r"Traceback|Error|error|WARNING|timed out|hang", re.I)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", default=None, help="default: the server's (SmolLM2-135M)")
    parser.add_argument("--load-format", default=None, help="e.g. dummy (random weights)")
    parser.add_argument("--pp-size", type=int, default=2)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2],
                        help="--pp-micro-batches of each server, one after another")
    parser.add_argument("--batch", type=int, default=32, help="requests sent at once")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--measure-s", type=float, default=5.0, help="unprofiled decode timed before the profile")
    parser.add_argument("--profile-steps", type=int, default=40, help="scheduler steps profiled")
    parser.add_argument("--server-threads", type=int, default=1,
                        help="OMP_NUM_THREADS of each server (0: torch's default); one per stage suits a small CPU")
    parser.add_argument("--trace-dir", default=None, help="keep the traces here (default: a temporary directory)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for a server to start, and a profile")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None)
    parser.add_argument("server_args", nargs="*", help="after --: options for every server")
    args = parser.parse_args(argv)
    if args.pp_size < 2:
        parser.error("--pp-size must be at least 2: the schedule is between stages")
    if min(args.micro_batches) < 1 or args.batch < 1 or args.profile_steps < 2:
        parser.error("--micro-batches and --batch must be >= 1, --profile-steps >= 2")
    return args


# --------------------------------------------------------------------------- the server


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"} if data else {})
    with urllib.request.urlopen(req, timeout=timeout) as reply:
        text = reply.read().decode()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text}


@contextmanager
def server(args: argparse.Namespace, micro_batches: int, trace_dir: Path):
    """A server with ``micro_batches``, in a session of its own: stopped with
    SIGTERM on leaving, and whatever of its process group is left killed."""
    port = free_local_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--device", "cpu",
           "--skip-server-warmup", "--pp-size", str(args.pp_size), "--pp-micro-batches", str(micro_batches),
           "--torch-profiler-dir", str(trace_dir), *args.server_args]
    cmd += ["--model-path", args.model_path] if args.model_path else []
    cmd += ["--load-format", args.load_format] if args.load_format else []
    env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.server_threads)} if args.server_threads else {}))
    log_path = trace_dir / f"server-mb{micro_batches}.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, url, args.timeout, log_path)
        yield url, log_path
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, url: str, timeout: float, log_path: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} while starting:\n{_tail(log_path)}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"the server did not start within {timeout:g} s:\n{_tail(log_path)}")


def _stop(proc: subprocess.Popen, timeout: float = 30) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # the server's own session: its children and nothing else
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _tail(path: Path, lines: int = 30) -> str:
    return "".join(path.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def log_problems(path: Path, limit: int = 10) -> list[str]:
    """The server log's lines that look like trouble (the first ``limit``)."""
    return [line for line in path.read_text(errors="replace").splitlines() if LOG_PROBLEMS.search(line)][:limit]


# --------------------------------------------------------------------------- the requests


class Streams:
    """``prompts`` sent at once to ``/generate``, each streamed on a thread of
    its own; ``tokens[i]`` is request i's output tokens so far, ``done[i]``
    whether its stream ended (finished, aborted, or cut when the server stops)."""

    def __init__(self, url: str, prompts: list[list[int]], output_len: int):
        self.url = url
        self.rids = [f"pp-schedule-{uuid.uuid4().hex[:8]}-{i}" for i in range(len(prompts))]
        self.tokens = [0] * len(prompts)
        self.done = [False] * len(prompts)
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._stream, args=(url, i, p, output_len), daemon=True)
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _stream(self, url: str, i: int, prompt: list[int], output_len: int) -> None:
        body = {"input_ids": prompt, "stream": True, "rid": self.rids[i], "sampling_params": {
            "max_new_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream_interval": STREAM_INTERVAL}}
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=3600) as reply:
                for line in reply:
                    if line.startswith(b"data: {"):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors.append(str(event["error"])[:200])
                        self.tokens[i] = event.get("meta_info", {}).get("completion_tokens", self.tokens[i])
        except OSError as exc:
            self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
        finally:
            self.done[i] = True

    def abort(self, timeout: float = 30) -> None:
        """Abort every request still running and wait for the streams to end (a
        server stopped with requests in flight takes seconds to let them go)."""
        for rid, done in zip(self.rids, self.done):
            if not done:
                http_json(self.url + "/abort_request", {"rid": rid})
        deadline = time.monotonic() + timeout
        while not all(self.done) and time.monotonic() < deadline:
            time.sleep(0.05)

    def wait_decoding(self, timeout: float) -> None:
        """Until every request has streamed a token after its first (it decodes)."""
        deadline = time.monotonic() + timeout
        while min(self.tokens) < 2:
            if any(self.done) or time.monotonic() > deadline:
                raise RuntimeError(f"requests did not all reach decode (tokens {sorted(self.tokens)}, "
                                   f"errors {self.errors[:3]})")
            time.sleep(0.05)


def counters(url: str) -> tuple[float, int, int]:
    """``(time, output tokens, forwards)`` from the first stage's scheduler."""
    state = http_json(url + "/get_server_info")["internal_states"][0]
    return time.monotonic(), state["generated"], state["forward_ct"]


def measure_decode(url: str, seconds: float) -> dict:
    t0, gen0, fwd0 = counters(url)
    time.sleep(seconds)
    t1, gen1, fwd1 = counters(url)
    return {"decode_tok_s": round((gen1 - gen0) / (t1 - t0), 2), "measured_s": round(t1 - t0, 3),
            "tokens_per_forward": round((gen1 - gen0) / (fwd1 - fwd0), 2) if fwd1 > fwd0 else None}


def profile(url: str, options: dict, streams: Streams, timeout: float) -> dict:
    """``/start_profile`` with ``num_steps``, answered once the traces are
    written. An idle server takes no step: if every request ends first, the
    profile is stopped (``/stop_profile``) rather than waited for."""
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(http_json, url + "/start_profile", options, timeout)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return started.result(timeout=0.2)
            except FuturesTimeout:
                if all(streams.done):
                    http_json(url + "/stop_profile", {}, timeout)
                    return started.result(timeout)
        raise RuntimeError(f"the profile did not end within {timeout:g} s")


# --------------------------------------------------------------------------- the traces


def annotations(path: Path) -> dict[str, list[tuple[float, float]]]:
    """The scheduler phases of a trace: name -> ``(start, end)`` spans in µs."""
    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in events:
        if e.get("cat") == "user_annotation" and e.get("ph") == "X":
            start = float(e["ts"])
            spans.setdefault(e["name"], []).append((start, start + float(e.get("dur", 0))))
    return spans


def clip(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(max(a, lo), min(b, hi)) for a, b in spans if b > lo and a < hi]


def profile_window(stages: list[dict], skip: int) -> tuple[float, float]:
    """The steady part of a profile, common to every stage: from the latest
    start of a stage's forward number ``skip`` (0-based) to the earliest
    start of a stage's last forward. Each stage starts and stops its profiler
    in its own step, and a profiler that starts or writes its trace stalls the
    other stages: ``skip`` forwards (one round of the micro-batches) let the
    pipeline fill again after the last stage to start profiling, and the end
    comes before the first stage to stop writes its trace."""
    starts = [sorted(a for a, _ in spans.get(FORWARD, [])) for spans in stages]
    if min(len(s) for s in starts) < skip + 2:
        raise RuntimeError(f"a stage ran {min(len(s) for s in starts)} forward(s) in the profile: the requests "
                           "ended or never decoded (raise --output-len or --profile-steps, or lower --measure-s)")
    lo, hi = max(s[skip] for s in starts), min(s[-1] for s in starts)
    if hi <= lo:
        raise RuntimeError("the stages' profiles do not overlap in a steady decode: raise --profile-steps")
    return lo, hi


def forward_ms_by_micro_batch(spans: dict, lo: float, hi: float, micro_batches: int) -> list[float | None]:
    """The mean forward time of each micro-batch in ``[lo, hi)`` (None: it ran
    none), numbered by its first turn in the trace. Every scheduler step is
    the next micro-batch's turn and asks for one batch (``scheduler.next_batch``),
    so a forward belongs to the micro-batch of the turn it follows. Unequal
    times mean the requests are split unevenly between the micro-batches."""
    turns = sorted(a for a, _ in spans.get(TURN, []))
    times: list[list[float]] = [[] for _ in range(micro_batches)]
    for a, b in spans.get(FORWARD, []):
        if lo <= a < hi:
            times[(bisect.bisect(turns, a) - 1) % micro_batches].append(b - a)
    return [round(sum(t) / len(t) / 1e3, 2) if t else None for t in times]


def stage_figures(spans: dict, lo: float, hi: float) -> dict:
    """One stage's shares of the window ``[lo, hi)`` (see the module docstring)."""
    window = hi - lo

    def share(names) -> float:
        return busy_time([s for n in names for s in clip(spans.get(n, []), lo, hi)]) / window

    waiting = share(WAITS)
    forwards = sum(lo <= a < hi for a, _ in spans.get(FORWARD, []))
    return {"busy": round(1 - waiting, 4), "compute": round(share([FORWARD]), 4), "waiting": round(waiting, 4),
            "waits": {name: round(share([name]), 4) for name in WAITS}, "window_s": round(window / 1e6, 6),
            "forwards": forwards, "ms_per_forward": round(window / 1e3 / forwards, 3) if forwards else None}


def concurrent_forward(stages: list[dict], lo: float, hi: float) -> float:
    """The share of ``[lo, hi)`` in which two stages or more run a forward."""
    edges = sorted((t, d) for s in stages for a, b in clip(s.get(FORWARD, []), lo, hi) for t, d in ((a, 1), (b, -1)))
    total, running, since = 0.0, 0, lo
    for t, delta in edges:
        if running >= 2:
            total += t - since
        running, since = running + delta, t
    return round(total / (hi - lo), 4)


# --------------------------------------------------------------------------- one run per micro-batch count


def run(args: argparse.Namespace, micro_batches: int, trace_dir: Path) -> dict:
    with server(args, micro_batches, trace_dir) as (url, log_path):
        info = http_json(url + "/get_server_info")
        sampler = TokenSampler(info["vocab_size"], seed=args.seed)  # ignore_eos: any ids make the same work
        streams = Streams(url, [sampler.ids(args.input_len) for _ in range(args.batch)], args.output_len)
        streams.wait_decoding(args.timeout)
        decode = measure_decode(url, args.measure_s)
        if any(streams.done):
            raise RuntimeError("requests ended before the profile: raise --output-len or lower --measure-s")
        profile_id = f"mb{micro_batches}"
        reply = profile(url, {"output_dir": str(trace_dir), "num_steps": args.profile_steps, "activities": ["CPU"],
                              "profile_id": profile_id}, streams, args.timeout)
        steady = not any(streams.done)  # no request ended before the profile did
        errors = streams.errors[:3]  # before the requests are aborted
        streams.abort()
    spans = [annotations(trace_dir / f"{profile_id}-PP-{s}-TP-0.trace.json.gz") for s in range(args.pp_size)]
    lo, hi = profile_window(spans, skip=micro_batches)
    layers = [stage.get("layers") for stage in info.get("pp_stages") or [{}] * args.pp_size]
    return {
        "micro_batches": micro_batches, **decode, "steady": steady,
        "concurrent_forward": concurrent_forward(spans, lo, hi),
        "stages": [{"stage": s, "layers": layers[s], **stage_figures(sp, lo, hi),
                    "forward_ms_by_micro_batch": forward_ms_by_micro_batch(sp, lo, hi, micro_batches)}
                   for s, sp in enumerate(spans)],
        "profile_reply": str(reply.get("text", reply))[:200].strip(),
        "stream_errors": errors, "server_log_problems": log_problems(log_path),
    }


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pp_schedule-") as tmp:
        trace_dir = Path(args.trace_dir or tmp).resolve()
        trace_dir.mkdir(parents=True, exist_ok=True)
        runs = [run(args, m, trace_dir) for m in args.micro_batches]
    result = {
        "bench": "pp_schedule", "model": args.model_path or "SmolLM2-135M-Instruct",
        "load_format": args.load_format or "auto", "pp_size": args.pp_size, "batch": args.batch,
        "input_len": args.input_len, "output_len": args.output_len, "measure_s": args.measure_s,
        "profile_steps": args.profile_steps, "server_threads": args.server_threads or None,
        "server_args": args.server_args, "layer_partition": os.environ.get(PP_LAYER_PARTITION_ENV),
        "cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2), "date": time.strftime("%Y-%m-%d"),
        "runs": runs,
    }
    print(json.dumps(result))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
