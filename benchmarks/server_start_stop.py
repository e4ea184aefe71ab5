"""How long the HTTP server takes to start (launch to the first 200 from
``/health``) and to stop (SIGTERM to the exit of its main process), as the
test suite and an operator see it. Prints one JSON line per tree.

    python benchmarks/server_start_stop.py --rounds 3 --tree . --tree /path/to/older/checkout

Each ``--tree`` is a checkout whose ``radixserve`` package the server runs
(``python -m`` puts the working directory first on the path); the trees take
turns, so a change of the machine's speed falls on both. Extra arguments after
``--`` go to every server (SmolLM2 by default, ``--skip-server-warmup``).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from radixserve.entrypoints.launcher import free_local_port


def healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as reply:
            return reply.status == 200
    except OSError:
        return False


def start_and_stop(tree: Path, server_args: list[str], timeout: float) -> tuple[float, float]:
    port = free_local_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--port", str(port), "--skip-server-warmup", *server_args]
    begin = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not healthy(url):
            if proc.poll() is not None or time.monotonic() - begin > timeout:
                raise RuntimeError(f"the server in {tree} did not start (exit code {proc.poll()})")
            time.sleep(0.05)
        started = time.monotonic() - begin
        stop_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout)
        return started, time.monotonic() - stop_at
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", type=Path, help="a checkout to run (default: this one)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=300)
    parser.add_argument("server_args", nargs="*", help="after --: options for every server")
    args = parser.parse_args()
    trees = args.tree or [Path(__file__).resolve().parent.parent]
    times: dict[Path, list[tuple[float, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            times[tree].append(start_and_stop(tree, args.server_args, args.timeout))
    for tree, runs in times.items():
        print(json.dumps({
            "bench": "server_start_stop", "tree": str(tree), "server_args": args.server_args, "rounds": args.rounds,
            "start_s": [round(s, 2) for s, _ in runs], "stop_s": [round(s, 2) for _, s in runs],
            "start_median_s": round(statistics.median(s for s, _ in runs), 2),
            "stop_median_s": round(statistics.median(s for _, s in runs), 2),
        }))


if __name__ == "__main__":
    main()
