"""``python -m radixserve.bench.kv_transfer`` on the CPU (gloo), tiny shapes:
it pairs a prefill and a decode rank through a bootstrap server, measures
the p2p ceiling and the transfer, and reports every page as arrived exactly.
(Its figures are for two GPUs; here only that it runs and checks.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

TINY = ["--devices", "cpu,cpu", "--requests", "3", "--tokens", "32", "--layers", "2", "--kv-heads", "2",
        "--head-dim", "8", "--dtype", "float32", "--page-size", "4", "--rounds", "2", "--p2p-mib", "1",
        "--repeats", "1"]


def test_kv_transfer_bench_runs_on_the_cpu_and_checks_the_pages():
    out = subprocess.run([sys.executable, "-m", "radixserve.bench.kv_transfer", *TINY], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["backend"] == "gloo" and report["exact"] is True
    assert report["bytes_per_token"] == 2 * 2 * 2 * 8 * 4
    assert report["transfer"]["bytes_per_round"] == 3 * 32 * report["bytes_per_token"]
    assert len(report["transfer"]["seconds"]) == 2 and report["p2p"]["gbs"] > 0
    assert report["fraction_of_p2p"] == pytest.approx(report["transfer"]["gbs_best"] / report["p2p"]["gbs"])


def test_two_ranks_on_one_gpu_are_refused():
    out = subprocess.run([sys.executable, "-m", "radixserve.bench.kv_transfer", "--devices", "cuda:0,cuda:0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--devices: two different GPUs" in out.stderr
