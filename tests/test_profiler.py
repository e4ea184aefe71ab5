"""``StepProfiler`` without a server: when a profile starts and stops in
scheduler steps, which replies are due when, and what it refuses; and,
against a server, that a client cannot make it write outside the operator's
profiler directory."""

from __future__ import annotations

import gzip
import json
import os

import httpx
import pytest
import torch

from radixserve.managers.profiler import StepProfiler, check_profile_options, phase
from radixserve.server_args import ServerArgs
from server_harness import ServerProcess


def work():
    torch.ones(8) @ torch.ones(8)


def test_start_step_and_num_steps_count_scheduler_steps_and_answer_when_the_trace_is_written(tmp_path):
    prof = StepProfiler("TP-0", torch.device("cpu"), str(tmp_path))
    for _ in range(2):
        prof.step()
    assert prof.start({"output_dir": str(tmp_path), "profile_id": "w", "start_step": 4, "num_steps": 2}, 7) == []
    replies = []
    for step in range(3, 8):  # steps 3 .. 7
        work()
        replies += [(step, r) for r in prof.step()]
    assert [(step, r.req_id, r.success) for step, r in replies] == [(6, 7, True)], "started at step 4, two steps"
    trace = json.loads(gzip.open(tmp_path / "w-TP-0.trace.json.gz").read())
    assert any(e.get("name") == "aten::matmul" for e in trace["traceEvents"])
    assert not prof.stop(8)[0].success, "it already stopped"


def test_a_stop_before_the_steps_answers_the_waiting_start_then_itself(tmp_path):
    prof = StepProfiler("DP-1-TP-0", torch.device("cpu"), str(tmp_path))
    assert prof.start({"output_dir": str(tmp_path), "profile_id": "s", "num_steps": 100}, 1) == []
    assert not prof.start({"output_dir": str(tmp_path)}, 2)[0].success, "one profile at a time"
    work()
    prof.step()
    replies = prof.stop(3)
    assert [(r.req_id, r.success) for r in replies] == [(1, True), (3, True)]
    assert (tmp_path / "s-DP-1-TP-0.trace.json.gz").exists()


def test_a_start_without_num_steps_is_answered_at_once_and_a_stop_before_its_start_step_writes_nothing(tmp_path):
    prof = StepProfiler("TP-0", torch.device("cpu"), str(tmp_path))
    [reply] = prof.start({"output_dir": str(tmp_path), "profile_id": "x", "start_step": 50}, 4)
    assert reply.success and reply.req_id == 4
    prof.step()
    [stopped] = prof.stop(5)
    assert stopped.success and "no trace" in stopped.message and not list(tmp_path.iterdir())


def test_options_sglang_clients_leave_unset_are_accepted_and_real_ones_it_lacks_are_refused(tmp_path):
    unset = {"activities": [], "num_steps": None, "profile_by_stage": None, "profile_stages": None,
             "merge_profiles": False, "profile_prefix": None, "output_dir": None}
    assert check_profile_options(unset, "cpu", str(tmp_path)) is None
    assert check_profile_options({"num_steps": "12", "start_step": "0"}, "cpu", str(tmp_path)) is None
    assert check_profile_options({"profile_stages": ["prefill"]}, "cpu", str(tmp_path))[0] == "profile_stages"
    assert check_profile_options({"activities": ["GPU"]}, "cuda:0", str(tmp_path)) is None
    assert check_profile_options({"profile_prefix": "a/b"}, "cpu", str(tmp_path))[0] == "profile_prefix"
    assert check_profile_options({"output_dir": "a\0b"}, "cpu", str(tmp_path))[0] == "output_dir"


def tree(path) -> list[str]:
    return sorted(str(p) for p in path.rglob("*"))


def test_a_rank_writes_only_under_its_directory_and_refuses_before_creating_anything(tmp_path):
    """Each rank checks again (the offline Engine and every TP rank meet the
    same check): an ``output_dir`` outside the directory is refused with
    nothing created; a relative one is taken inside it."""
    root, outside = tmp_path / "traces", tmp_path / "outside"
    root.mkdir(), outside.mkdir()
    (root / "elsewhere").symlink_to(outside)
    prof = StepProfiler("TP-1", torch.device("cpu"), str(root))
    before = tree(tmp_path)
    for output_dir in (str(outside / "abs"), "../up", "runs/../../up", "elsewhere/x", str(root / "elsewhere")):
        [reply] = prof.start({"output_dir": output_dir}, 1)
        assert not reply.success and reply.message.startswith("output_dir:"), output_dir
    assert tree(tmp_path) == before, "nothing created"
    prof.start({"output_dir": "runs/a", "profile_id": "r"}, 2)
    work()
    prof.step()
    [stopped] = prof.stop(3)
    assert stopped.success and (root / "runs" / "a" / "r-TP-1.trace.json.gz").exists(), stopped.message


def test_the_profiler_directory_is_the_flag_else_sglangs_variable(monkeypatch):
    monkeypatch.setenv("SGLANG_TORCH_PROFILER_DIR", "from-env")
    assert ServerArgs().resolved_torch_profiler_dir() == "from-env"
    assert ServerArgs(torch_profiler_dir="from-flag").resolved_torch_profiler_dir() == "from-flag"


def test_phases_are_named_in_the_trace_only_while_a_profile_records(tmp_path):
    @phase("scheduler.test_phase")
    def step_work(x):
        work()
        return x + 1

    with torch.profiler.profile() as outside:  # someone else's profile: our phases stay unnamed
        assert step_work(1) == 2
    assert "scheduler.test_phase" not in {e.name for e in outside.events()}
    prof = StepProfiler("TP-0", torch.device("cpu"), str(tmp_path))
    prof.start({"output_dir": str(tmp_path), "profile_id": "ph", "num_steps": 1}, 1)
    assert step_work(2) == 3
    prof.step()
    trace = json.loads(gzip.open(tmp_path / "ph-TP-0.trace.json.gz").read())
    assert "scheduler.test_phase" in {e.get("name") for e in trace["traceEvents"]}


# -- against a server ---------------------------------------------------------------------------
TINY = ("--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu", "--dtype", "float32",
        "--max-total-tokens", "4096")


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """A server whose profiler directory is ``base/traces`` (set as SGLang
    sets it, by its variable), run from ``base/cwd``; ``base/outside`` is a
    directory it must never write to, reachable from ``traces/elsewhere``."""
    base = tmp_path_factory.mktemp("profile")
    for name in ("traces", "outside", "cwd"):
        (base / name).mkdir()
    (base / "traces" / "elsewhere").symlink_to(base / "outside")
    here = os.getcwd()
    os.chdir(base / "cwd")  # where a relative output_dir would go if it were not taken inside the directory
    try:
        srv = ServerProcess(*TINY, env={"SGLANG_TORCH_PROFILER_DIR": str(base / "traces")})
    finally:
        os.chdir(here)
    yield srv, base
    assert srv.stop() == 0


@pytest.mark.parametrize("where", ["absolute", "dotdot", "absolute-dotdot", "symlink"])
def test_start_profile_refuses_an_output_dir_outside_the_profiler_directory(profiled, where):
    srv, base = profiled
    output_dir = {"absolute": str(base / "outside" / "abs"), "dotdot": "../escaped",
                  "absolute-dotdot": str(base / "traces" / "runs" / ".." / ".." / "escaped"),
                  "symlink": str(base / "traces" / "elsewhere" / "via-link")}[where]
    before = tree(base)
    r = httpx.post(srv.url + "/start_profile", json={"output_dir": output_dir, "profile_id": where}, timeout=30)
    stopped = httpx.post(srv.url + "/stop_profile", timeout=30)  # before asserting: a failure leaves none running
    assert r.status_code == 400 and r.json()["error"]["param"] == "output_dir", r.text
    assert "output_dir" in r.json()["error"]["message"]
    assert tree(base) == before, "nothing created, inside or outside the directory"
    assert stopped.status_code == 400, "no profile started"


def test_start_profile_creates_a_subdirectory_of_the_profiler_directory_and_writes_there(profiled):
    srv, base = profiled
    body = {"output_dir": "runs/a", "profile_id": "sub"}
    assert httpx.post(srv.url + "/start_profile", json=body, timeout=30).status_code == 200
    out = httpx.post(srv.url + "/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}},
                     timeout=60)
    assert out.status_code == 200
    stopped = httpx.post(srv.url + "/stop_profile", timeout=60)
    trace = base / "traces" / "runs" / "a" / "sub-TP-0.trace.json.gz"
    assert stopped.status_code == 200 and trace.exists(), stopped.text
    assert str(trace.resolve()) in stopped.text and not list((base / "cwd").iterdir())
