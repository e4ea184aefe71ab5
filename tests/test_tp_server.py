"""The HTTP server at tensor-parallel size 2 (tiny-llama, CPU, gloo): it
serves what tp 1 serves; a rank that dies or hangs ends every request with
an error and the server with it, within a bounded time; a model that does
not split refuses to start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import httpx
import pytest

import radixserve
from server_harness import ServerProcess, alive
from test_faults import (IN_FLIGHT_POOL, _assert_answered, _in_flight_then, _wait_exit,
                         check_a_killed_rank_ends_everything, killed_rank_args)

pytestmark = pytest.mark.slow

TP2 = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
       "--max-total-tokens", "4096", "--tp-size", "2")
PROMPTS = [[1, 5, 9, 33, 70, 2, 8], [4, 4, 100, 7, 12, 13], list(range(40, 75))]
GREEDY = {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True}


@pytest.fixture(scope="module")
def tp1_outputs():
    with radixserve.Engine(model_path="tiny-llama", load_format="dummy", device="cpu", dtype="float32",
                           max_total_tokens=4096, disable_tqdm=True) as eng:
        return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


def test_tp2_server_serves_tp1_tokens_streamed_or_not(tp1_outputs):
    srv = ServerProcess(*TP2, "--check-invariants")
    try:
        assert len([k for k in srv.children() if k.startswith("scheduler")]) == 2
        body = {"input_ids": PROMPTS, "sampling_params": GREEDY}
        outs = httpx.post(srv.url + "/generate", json=body, timeout=60).json()
        assert [o["output_ids"] for o in outs] == tp1_outputs
        with httpx.stream("POST", srv.url + "/generate", json={**body, "input_ids": PROMPTS[2], "stream": True},
                          timeout=60) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["output_ids"] == tp1_outputs[2]
        again = httpx.post(srv.url + "/generate", json={**body, "input_ids": PROMPTS[2]}, timeout=60).json()
        assert again["meta_info"]["cached_tokens"] > 0 and again["output_ids"] == tp1_outputs[2]
        state = srv.wait_idle()
        assert state["memory_check"] == "ok"
        assert httpx.post(srv.url + "/flush_cache", timeout=30).status_code == 200
        after = httpx.post(srv.url + "/generate", json={**body, "input_ids": PROMPTS[2]}, timeout=60).json()
        assert after["meta_info"]["cached_tokens"] == 0 and after["output_ids"] == tp1_outputs[2]
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize("victim", ["scheduler", "scheduler-tp1"])
def test_a_killed_rank_ends_every_request_and_the_server(tmp_path, victim):
    check_a_killed_rank_ends_everything(ServerProcess(*killed_rank_args(TP2), env={"TMPDIR": str(tmp_path)}), victim)


def test_a_hung_rank_ends_the_server_after_the_collective_timeout(tmp_path):
    """A stopped (not dead) rank: rank 0's next collective with it times out
    after --dist-timeout, rank 0 exits, and the server with it."""
    srv = ServerProcess(*TP2, *IN_FLIGHT_POOL, "--dist-timeout", "8", env={"TMPDIR": str(tmp_path)})
    kids = srv.children()
    try:
        results = _in_flight_then(srv, lambda: os.kill(kids["scheduler-tp1"], signal.SIGSTOP))
        _assert_answered(results, 60, lambda error: error is not None and error["code"] == 503)
        code = _wait_exit(srv.proc, 60)
        assert code is not None and code != 0
    finally:
        if alive(kids["scheduler-tp1"]):
            os.kill(kids["scheduler-tp1"], signal.SIGKILL)
        srv.stop()


def test_a_model_that_does_not_split_refuses_to_start():
    cmd = [sys.executable, "-m", "radixserve.launch_server", *TP2[:-1], "3"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "num_attention_heads 4 is not divisible by tp_size 3" in proc.stdout + proc.stderr
