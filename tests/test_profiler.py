"""``StepProfiler`` without a server: when a profile starts and stops in
scheduler steps, which replies are due when, and what it refuses."""

from __future__ import annotations

import gzip
import json

import torch

from radixserve.managers.profiler import StepProfiler, check_profile_options, phase


def work():
    torch.ones(8) @ torch.ones(8)


def test_start_step_and_num_steps_count_scheduler_steps_and_answer_when_the_trace_is_written(tmp_path):
    prof = StepProfiler("TP-0", torch.device("cpu"))
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
    prof = StepProfiler("DP-1-TP-0", torch.device("cpu"))
    assert prof.start({"output_dir": str(tmp_path), "profile_id": "s", "num_steps": 100}, 1) == []
    assert not prof.start({"output_dir": str(tmp_path)}, 2)[0].success, "one profile at a time"
    work()
    prof.step()
    replies = prof.stop(3)
    assert [(r.req_id, r.success) for r in replies] == [(1, True), (3, True)]
    assert (tmp_path / "s-DP-1-TP-0.trace.json.gz").exists()


def test_a_start_without_num_steps_is_answered_at_once_and_a_stop_before_its_start_step_writes_nothing(tmp_path):
    prof = StepProfiler("TP-0", torch.device("cpu"))
    [reply] = prof.start({"output_dir": str(tmp_path), "profile_id": "x", "start_step": 50}, 4)
    assert reply.success and reply.req_id == 4
    prof.step()
    [stopped] = prof.stop(5)
    assert stopped.success and "no trace" in stopped.message and not list(tmp_path.iterdir())


def test_options_sglang_clients_leave_unset_are_accepted_and_real_ones_it_lacks_are_refused():
    unset = {"activities": [], "num_steps": None, "profile_by_stage": None, "profile_stages": None,
             "merge_profiles": False, "profile_prefix": None}
    assert check_profile_options(unset, "cpu") is None
    assert check_profile_options({"num_steps": "12", "start_step": "0"}, "cpu") is None
    assert check_profile_options({"profile_stages": ["prefill"]}, "cpu")[0] == "profile_stages"
    assert check_profile_options({"activities": ["GPU"]}, "cuda:0") is None
    assert check_profile_options({"profile_prefix": "a/b"}, "cpu")[0] == "profile_prefix"


def test_phases_are_named_in_the_trace_only_while_a_profile_records(tmp_path):
    @phase("scheduler.test_phase")
    def step_work(x):
        work()
        return x + 1

    with torch.profiler.profile() as outside:  # someone else's profile: our phases stay unnamed
        assert step_work(1) == 2
    assert "scheduler.test_phase" not in {e.name for e in outside.events()}
    prof = StepProfiler("TP-0", torch.device("cpu"))
    prof.start({"output_dir": str(tmp_path), "profile_id": "ph", "num_steps": 1}, 1)
    assert step_work(2) == 3
    prof.step()
    trace = json.loads(gzip.open(tmp_path / "ph-TP-0.trace.json.gz").read())
    assert "scheduler.test_phase" in {e.get("name") for e in trace["traceEvents"]}
