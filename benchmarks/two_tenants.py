"""Servers that share one GPU (W9 of docs/benchmarks.md) and what the elastic
KV pool costs a lone server (W5), in one device call. Phases (``--phases``):

- ``lone``: one server with a static pool, then one with ``--enable-elastic-kv``,
  each alone on the device: W5 at ``--cost-rate`` req/s (the cost of
  elasticity); the static one then runs the pairs' W9 bursts, turn by turn
  (``--lone-bursts``), as the reference each pair's burst is divided by.
- ``static-pair``: two servers, each with a static pool of half the KV
  that two servers leave room for, bursts in turn: A, then B. Half is
  ``--half-tokens``, or else taken from the lone static server: its KV
  (``memory_usage`` of ``/get_server_info``) less what else it took of the
  device (nvidia-smi's used memory, before it started and at its end),
  halved, so the pair takes what the lone server took.
- ``elastic-pair``: two elastic servers, each allowed the whole free memory
  (one ``--elastic-kv-group``), alternating bursts A, B, A, B
  (``--elastic-turns``): while one runs, the other is idle with its radix
  cache full of the last burst's prompts.
  Both servers' mapped and used KV bytes are read every 0.1 s, so each idle
  server's footprint while the busy one needs memory shows.

A burst is ``radixserve.bench.serving``: random prompts, ``--input-len`` in and
``--output-len`` out, Poisson at ``--rate`` req/s, the cache not flushed
first. Turn ``t`` of every phase has the seed ``100 + t``, so the lone server
and the pairs see the same prompts at the same times: at a fixed rate a burst's
throughput is mostly its arrivals' span (256 Poisson arrivals at 16 req/s span
16 s give or take one), so bursts of other seeds cannot be compared. A pair's
burst carries ``of_lone``, its output throughput over the lone server's for
that seed. Prints one JSON line per figure and writes them, with the servers'
logs' tails on failure, to ``OUT/two_tenants.jsonl``::

    python benchmarks/two_tenants.py --out DIR [--model llama-3.1-8b] [--phases lone,static-pair,elastic-pair]

A CPU smoke run (a minute or two): ``--model tiny-llama --device cpu --dtype float32
--attention-backend torch_native --prompts 6 --input-len 32 --output-len 8 --half-tokens 4096``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Server:
    """A radixserve server in its own process group, stopped on exit."""

    def __init__(self, name: str, port: int, args: argparse.Namespace, flags: list[str]):
        self.name, self.port = name, port
        self.log_path = os.path.join(args.log_dir, f"server-{name}.log")
        cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", args.model, "--load-format", "dummy",
               "--dtype", args.dtype, "--port", str(port), "--attention-backend", args.attention_backend,
               *(["--device", args.device] if args.device else []), *args.server_args.split(), *flags]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.started = time.time()

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server {self.name} exited: {self.tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2)
                return
            except OSError:
                time.sleep(1)
        raise RuntimeError(f"server {self.name} not healthy after {timeout:.0f} s: {self.tail()}")

    def info(self) -> dict:
        """The server's options and its (first replica's) scheduler figures, in one dict."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/get_server_info", timeout=5) as r:
            info = json.load(r)
        return {**info, **(info.pop("internal_states") or [{}])[0]}

    def tail(self, n: int = 15) -> str:
        """The log's last ``n`` lines, after its first traceback's first 30 if it has one."""
        self.log.flush()
        with open(self.log_path) as f:
            lines = f.readlines()
        first = next((i for i, line in enumerate(lines) if line.startswith("Traceback")), None)
        head = lines[first:first + 30] + ["...\n"] if first is not None and first < len(lines) - n else []
        return "".join(head + lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.log.close()


class Watcher(threading.Thread):
    """Reads each server's KV bytes every ``period`` seconds."""

    KEYS = ("elastic_kv_mapped_bytes", "elastic_kv_used_bytes", "elastic_kv_lead_bytes", "elastic_kv_floor_bytes",
            "elastic_kv_given_pages", "elastic_kv_asks", "elastic_kv_reserve_pages")

    def __init__(self, servers: list[Server], period: float = 0.1):
        super().__init__(daemon=True)
        self.servers, self.period, self.samples = servers, period, []
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            now = time.time()
            for s in self.servers:
                try:
                    info = s.info()
                except OSError:
                    continue
                self.samples.append({"t": now, "server": s.name, **{k: info.get(k) for k in self.KEYS}})
            self.stop_event.wait(self.period)


def emit(out, record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    out.write(line + "\n")
    out.flush()


def burst(server: Server, args: argparse.Namespace, rate: float, prompts: int, seed: int, label: str) -> dict:
    """One bench.serving run against ``server``; its JSON figures (without the per-request timelines)."""
    cmd = [sys.executable, "-m", "radixserve.bench.serving", "--port", str(server.port), "--dataset-name", "random",
           "--num-prompts", str(prompts), "--random-input-len", str(args.input_len), "--random-output-len",
           str(args.output_len), "--random-range-ratio", "1", "--request-rate", str(rate), "--seed", str(seed),
           "--disable-flush-cache", "--disable-tqdm", "--slo-ttft", "1000", "--slo-tpot", "50", "--label", label]
    start = time.time()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.burst_timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        raise RuntimeError(f"bench {label} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    res = json.loads(lines[-1])
    res.pop("requests", None)
    return {"start": start, "end": time.time(), **res}


def footprint(samples: list[dict], name: str, start: float, end: float) -> dict:
    """The idle server ``name``'s KV bytes while the other ran [start, end]:
    at the start, the least, and how long after the other server's first
    ask it first came down to its least plus 64 MB, and to its floor plus
    64 MB (E13's goal: the floor plus the reserve, at most 64 MB above the
    floor, within a second)."""
    mine = [s for s in samples if s["server"] == name and start <= s["t"] <= end]
    theirs = [s for s in samples if s["server"] != name and start <= s["t"] <= end]
    if not mine:
        return {}
    asked = next((s["t"] for s in theirs if s["elastic_kv_asks"] and s["elastic_kv_asks"] >
                  (theirs[0]["elastic_kv_asks"] or 0)), None)
    floor = mine[0]["elastic_kv_floor_bytes"] or 0
    low = min(s["elastic_kv_mapped_bytes"] for s in mine)

    def first_at(bound: int) -> float | None:
        t = next((s["t"] for s in mine if asked and s["t"] >= asked and s["elastic_kv_mapped_bytes"] <= bound), None)
        return None if t is None else round(t - asked, 2)

    return {"idle_mapped_gb_at_start": round(mine[0]["elastic_kv_mapped_bytes"] / 2**30, 3),
            "idle_mapped_gb_min": round(low / 2**30, 3), "idle_floor_gb": round(floor / 2**30, 3),
            "other_first_ask_s": None if asked is None else round(asked - start, 2),
            "idle_down_to_min_s_after_ask": first_at(max(floor, low) + (64 << 20)),
            "idle_within_64mb_of_floor_s_after_ask": first_at(floor + (64 << 20)),
            "idle_given_pages": mine[-1]["elastic_kv_given_pages"] - (mine[0]["elastic_kv_given_pages"] or 0)}


TURN_SEED = 100  # turn t's burst has the seed TURN_SEED + t in every phase


def pool_figures(server: Server) -> dict:
    info = server.info()
    return {k: v for k, v in info.items()
            if k.startswith("elastic_kv_") or k == "max_total_tokens" and isinstance(v, (int, float))}


def device_used_bytes() -> int | None:
    """The first GPU's used memory (nvidia-smi, so this process opens no
    CUDA context), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30, check=True).stdout
        return int(out.split()[0]) << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


def half_split(server: Server, used_before: int | None) -> dict:
    """Each static pair server's KV tokens, so that the two take what the
    lone ``server`` took of the device: its KV, less its other memory
    (weights, CUDA graphs, activations: nvidia-smi's growth less the KV),
    halved."""
    used_after, usage = device_used_bytes(), server.info()["memory_usage"]
    kv, tokens = usage["kvcache"] * 2**30, usage["token_capacity"]
    if used_before is None or used_after is None:
        return {"half_tokens": None, "why": "no nvidia-smi: give --half-tokens"}
    other = used_after - used_before - kv
    return {"half_tokens": int((kv - other) / 2 / (kv / tokens)), "lone_kv_gib": usage["kvcache"],
            "lone_tokens": tokens, "lone_other_gib": round(other / 2**30, 2)}


def run_lone(args, out) -> dict[int, float]:
    """The lone servers' runs; returns the static one's W9 output tok/s by
    seed, and sets ``args.half_tokens`` from it unless given."""
    lone = {}
    for name, flags in (("lone-static", []), ("lone-elastic", ["--enable-elastic-kv"])):
        used_before = device_used_bytes()
        server = Server(name, args.port, args, flags)
        try:
            server.wait_healthy(args.start_timeout)
            emit(out, {"phase": name, "event": "started", "start_s": round(time.time() - server.started, 1)})
            res = burst(server, args, args.cost_rate, args.cost_prompts, 3, f"W5 {args.cost_rate} req/s, {name}")
            emit(out, {"phase": name, "workload": "W5", **res, **pool_figures(server)})
            watcher = Watcher([server])  # read as the pairs' servers are, so the bursts differ only in the pair
            watcher.start()
            try:
                for turn in range(args.lone_bursts if not flags else 0):
                    seed = TURN_SEED + turn
                    res = burst(server, args, args.rate, args.prompts, seed, f"W9 burst {turn}, {name}")
                    lone[seed] = res["output_throughput"]
                    emit(out, {"phase": name, "workload": "W9", "turn": turn, "seed": seed, **res})
                    time.sleep(args.idle_s)
            finally:
                watcher.stop_event.set()
            if not flags and args.half_tokens is None:
                split = half_split(server, used_before)
                args.half_tokens = split["half_tokens"]
                emit(out, {"phase": name, "event": "split", **split})
        except Exception as exc:  # noqa: BLE001 - the next phase still runs
            emit(out, {"phase": name, "error": str(exc)[-3000:]})
        finally:
            server.stop()
    return lone


def run_pair(args, out, elastic: bool, lone: dict[int, float]) -> None:
    phase = "elastic-pair" if elastic else "static-pair"
    if not elastic and args.half_tokens is None:
        emit(out, {"phase": phase, "error": "no split: give --half-tokens, or run the lone phase on a GPU first"})
        return
    flags = (["--enable-elastic-kv", "--elastic-kv-group", f"w9-{os.getpid()}"] if elastic
             else ["--max-total-tokens", str(args.half_tokens)])
    servers = [Server(f"{phase}-{x}", args.port + i, args, flags) for i, x in enumerate("AB")]
    watcher = Watcher(servers)
    try:
        for s in servers:
            s.wait_healthy(args.start_timeout)
        emit(out, {"phase": phase, "event": "started", "start_s": round(time.time() - servers[0].started, 1)})
        watcher.start()
        order = [0, 1] * (args.elastic_turns // 2 if elastic else 1)
        for turn, i in enumerate(order):
            busy, idle = servers[i], servers[1 - i]
            seed = TURN_SEED + turn
            res = burst(busy, args, args.rate, args.prompts, seed, f"W9 burst {turn} on {busy.name}")
            of_lone = round(res["output_throughput"] / lone[seed], 4) if seed in lone else None
            emit(out, {"phase": phase, "workload": "W9", "turn": turn, "seed": seed, "server": busy.name, **res,
                       "of_lone": of_lone,
                       **(footprint(watcher.samples, idle.name, res["start"], res["end"]) if elastic else {})})
            time.sleep(args.idle_s)
        for s in servers:
            emit(out, {"phase": phase, "event": "end", "server": s.name, **pool_figures(s)})
    except Exception as exc:  # noqa: BLE001
        emit(out, {"phase": phase, "error": str(exc)[-3000:], "tails": {s.name: s.tail() for s in servers}})
    finally:
        watcher.stop_event.set()
        for s in servers:
            s.stop()
        if watcher.samples:
            with open(os.path.join(args.out, f"{phase}-footprint.jsonl"), "w") as f:
                f.writelines(json.dumps(s) + "\n" for s in watcher.samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="lone,static-pair,elastic-pair")
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default=None)
    p.add_argument("--attention-backend", default="triton")
    p.add_argument("--server-args", default="", help="more flags for every server")
    p.add_argument("--port", type=int, default=31000)
    p.add_argument("--rate", type=float, default=16.0, help="W9 bursts, req/s")
    p.add_argument("--prompts", type=int, default=384, help="prompts per W9 burst")
    p.add_argument("--lone-bursts", type=int, default=4, help="the lone server's W9 bursts: the pairs' turns it covers")
    p.add_argument("--elastic-turns", type=int, default=4, help="the elastic pair's bursts, A and B in turn (even)")
    p.add_argument("--cost-rate", type=float, default=20.0, help="W5 for the cost of elasticity, req/s")
    p.add_argument("--cost-prompts", type=int, default=256)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--half-tokens", type=int, default=None,
                   help="each static server's KV tokens in the pair (default: from the lone static server)")
    p.add_argument("--idle-s", type=float, default=2.0, help="pause between bursts")
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--burst-timeout", type=float, default=240)
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    args.log_dir = tempfile.mkdtemp(prefix="two-tenants-")
    phases = args.phases.split(",")
    with open(os.path.join(args.out, "two_tenants.jsonl"), "a") as out:
        emit(out, {"event": "begin", "phases": phases, "model": args.model, "rate": args.rate, "prompts": args.prompts,
                   "input_len": args.input_len, "output_len": args.output_len})
        lone = run_lone(args, out) if "lone" in phases else {}
        if "static-pair" in phases:
            run_pair(args, out, elastic=False, lone=lone)
        if "elastic-pair" in phases:
            run_pair(args, out, elastic=True, lone=lone)


if __name__ == "__main__":
    main()
