"""W4 (generated shared prefix) under cache pressure, the hierarchical cache
off and on (docs/hicache.md): a device KV pool of ``--pool`` tokens (about a
quarter of the group prefixes), then the same with the host tier, with the
host and file tiers, a server restarted on that file tier's directory, and
an unlimited device pool (the reference hit rate). One server per
configuration, started and stopped around its run; prints one JSON line per
configuration: hit rate (and the dataset's ideal), output throughput, TTFT
p50/p99, and the server's tier figures after the run.

    python benchmarks/hicache_w4.py --out-dir /tmp/hicache-w4 \\
        --configs off host host_file file_restart unlimited > results/DATE_cpu-2core_hicache_w4.jsonl

On the H200 (full scale): ``--server-args "--model-path llama-3.1-8b --load-format dummy"
--pool 32768 --groups 64 --prompts-per-group 16 --system-len 2048 --question-len 128
--output-len 256 --max-concurrency 1024``. Every process started is stopped,
also on errors.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import httpx

from router_cpu import Proc, bench, free_port, summary

CONFIGS = ("off", "host", "host_file", "file_restart", "unlimited")


def server_flags(args, name: str, storage_dir: str) -> list[str]:
    flags = [] if name == "unlimited" else ["--max-total-tokens", str(args.pool)]
    if name in ("host", "host_file", "file_restart"):
        flags += ["--enable-hierarchical-cache", "--hicache-ratio", str(args.hicache_ratio),
                  "--hicache-write-policy", args.write_policy]
    if name in ("host_file", "file_restart"):
        flags += ["--hicache-storage-backend", "file", "--hicache-storage-dir", storage_dir]
        if args.storage_extra_config:
            flags += ["--hicache-storage-backend-extra-config", args.storage_extra_config]
    return flags + args.server_args.split()


def run_config(args, name: str, storage_dir: str) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), *server_flags(args, name, storage_dir)]
    proc = Proc(cmd, args.out_dir / f"{name}-server.log")
    url = f"http://127.0.0.1:{port}"
    try:
        proc.wait_until(lambda: httpx.get(url + "/health", timeout=2).status_code == 200, args.start_timeout, url)
        # file_restart keeps what the file tier holds: no flush before its run (a flush keeps files anyway)
        run = bench(args, name, url, [url])
        state = httpx.get(url + "/get_server_info", timeout=30).json()["internal_states"][0]
    finally:
        proc.stop()
    line = summary(name, 1, run, None)
    line.pop("host_load_1min")
    line.pop("workers")
    line["interrupted"] = run.get("interrupted", False)
    line["pool"] = state["max_total_tokens"]
    line["tiers"] = {k: v for k, v in state.items() if k.startswith("hicache_")}
    return line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", type=Path, required=True, help="bench JSON files and server logs")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--pool", type=int, default=768, help="--max-total-tokens of the pressured configurations")
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--write-policy", default="write_through")
    p.add_argument("--storage-dir", default=None, help="the file tier's directory (default: a new temp folder)")
    p.add_argument("--storage-extra-config", default=None,
                   help="the file tier's --hicache-storage-backend-extra-config, e.g. '{\"max_gb\": 24}'")
    p.add_argument("--server-args", default="--schedule-policy lpm", help="more radixserve options")
    p.add_argument("--groups", type=int, default=12)
    p.add_argument("--prompts-per-group", type=int, default=6)
    p.add_argument("--system-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--max-concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--start-timeout", type=float, default=300)
    p.add_argument("--bench-timeout", type=float, default=1800)
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    storage_dir = args.storage_dir or tempfile.mkdtemp(prefix="hicache-w4-")
    print(json.dumps({"workload": "W4", "groups": args.groups, "prompts_per_group": args.prompts_per_group,
                      "system_len": args.system_len, "question_len": args.question_len, "output_len": args.output_len,
                      "max_concurrency": args.max_concurrency, "pool": args.pool,
                      "group_prefix_tokens": args.groups * args.system_len, "hicache_ratio": args.hicache_ratio,
                      "write_policy": args.write_policy,
                      "storage_extra_config": args.storage_extra_config, "server_args": args.server_args}), flush=True)
    for name in args.configs:
        try:
            print(json.dumps(run_config(args, name, storage_dir)), flush=True)
        except Exception as exc:  # the next configuration still runs
            print(json.dumps({"config": name, "error": repr(exc)[:500]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
