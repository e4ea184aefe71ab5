"""The pipeline schedule's benchmark: its shares on a hand-made two-stage
timeline, and a short run against real pp 2 servers (tiny-llama, dummy
weights) whose JSON has every stage, fractions in [0, 1] and the model's
layers. No figure is checked against a time."""

from __future__ import annotations

import json

import pytest

from radixserve.bench import pp_schedule
from radixserve.model_loader import dummy_config


FORWARD = pp_schedule.FORWARD


def test_shares_of_a_hand_made_pipeline():
    """Two stages, a turn every 10 µs: stage 0 computes 6 µs of each turn and
    waits 4 µs for tokens; stage 1 waits 3 µs for hidden states, then computes
    6 µs, from 5 µs into the turn. Stage 0 starts profiling 100 µs early and
    stops at 60 µs, while stage 1 goes on: both fall outside the window."""
    stage0 = {FORWARD: [(t, t + 6) for t in range(-100, 70, 10)],
              "pp.wait_tokens": [(t + 6, t + 10) for t in range(0, 60, 10)]}
    stage1 = {FORWARD: [(t + 5, t + 11) for t in range(0, 90, 10)],
              "pp.wait_hidden": [(t + 2, t + 5) for t in range(0, 90, 10)], "pp.wait_relay": [(1, 2)]}
    lo, hi = pp_schedule.profile_window([stage0, stage1], skip=1)
    assert (lo, hi) == (15, 60)  # stage 1's second forward; stage 0's last
    first, second = (pp_schedule.stage_figures(s, lo, hi) for s in (stage0, stage1))
    share = lambda us: pytest.approx(us / 45, abs=1e-4)  # noqa: E731
    # stage 0: [15, 16) of the forward from 10, then 6 µs at 20, 30, 40, 50; waits from 16, 26, ... 56
    assert (first["compute"], first["waiting"], first["busy"]) == (share(25), share(20), share(25))
    assert first["waits"] == {"pp.wait_hidden": 0, "pp.wait_tokens": share(20), "pp.wait_relay": 0}
    assert first["forwards"] == 4 and first["window_s"] == second["window_s"] == 45e-6
    # stage 1: forwards at 15, 25, 35, 45 and [55, 60); waits from 22, 32, 42, 52 (the one ending at 15 is out)
    assert (second["compute"], second["waiting"], second["busy"]) == (share(29), share(12), share(33))
    assert second["forwards"] == 5
    # both compute 1 µs at 15, 20, 25, ... 55
    assert pp_schedule.concurrent_forward([stage0, stage1], lo, hi) == share(9)


def test_forward_times_by_micro_batch_follow_the_turns():
    """Turns every 10 ms; micro-batch 0's forwards take 6 ms, micro-batch 1's
    2 ms, except a turn where micro-batch 1 has nothing to run."""
    turns = [(t, t + 100) for t in range(0, 80_000, 10_000)]
    forwards = [(t + 500, t + 500 + (6000 if i % 2 == 0 else 2000)) for i, (t, _) in enumerate(turns) if i != 3]
    spans = {pp_schedule.TURN: turns, FORWARD: forwards}
    assert pp_schedule.forward_ms_by_micro_batch(spans, 0, 80_000, 2) == [6.0, 2.0]
    # numbered by the trace's turns, not the window's
    assert pp_schedule.forward_ms_by_micro_batch(spans, 15_000, 80_000, 2) == [6.0, 2.0]
    assert pp_schedule.forward_ms_by_micro_batch(spans, 0, 80_000, 1) == [4.29]  # (4 x 6 + 3 x 2) / 7
    assert pp_schedule.forward_ms_by_micro_batch(spans, 0, 80_000, 4) == [6.0, 2.0, 6.0, 2.0]
    assert pp_schedule.forward_ms_by_micro_batch({pp_schedule.TURN: turns}, 0, 80_000, 2) == [None, None]


def test_a_profile_without_enough_forwards_is_an_error_not_a_figure():
    with pytest.raises(RuntimeError, match="forward"):
        pp_schedule.profile_window([{FORWARD: [(0, 1), (2, 3)]}, {FORWARD: [(1, 2)]}], skip=1)


@pytest.mark.slow
def test_a_short_run_at_pp_2_reports_every_stage(capsys, tmp_path):
    out_file = tmp_path / "pp.json"
    result = pp_schedule.main([
        "--model-path", "tiny-llama", "--load-format", "dummy", "--pp-size", "2", "--batch", "4",
        "--output-len", "400", "--input-len", "16", "--profile-steps", "10", "--measure-s", "0.3",
        "--micro-batches", "1", "2", "--trace-dir", str(tmp_path / "traces"), "--output-json", str(out_file),
    ])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result == json.loads(out_file.read_text())
    assert (result["pp_size"], result["batch"], result["cpu_count"] > 0) == (2, 4, True)
    num_layers = dummy_config("tiny-llama").num_hidden_layers
    assert [r["micro_batches"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["decode_tok_s"] > 0 and run["stream_errors"] == [] and 0 <= run["concurrent_forward"] <= 1
        assert [s["stage"] for s in run["stages"]] == [0, 1]
        layers = [s["layers"] for s in run["stages"]]
        assert layers[0][0] == 0 and layers[0][1] == layers[1][0] and layers[1][1] == num_layers
        for stage in run["stages"]:
            assert stage["forwards"] > 0 and stage["window_s"] > 0
            assert all(0 <= stage[k] <= 1 for k in ("busy", "compute", "waiting"))
            assert stage["busy"] == pytest.approx(1 - stage["waiting"], abs=1e-3)
            assert stage["compute"] <= stage["busy"] + 1e-3 and set(stage["waits"]) == set(pp_schedule.WAITS)
    traces = sorted(p.name for p in (tmp_path / "traces").glob("*.trace.json.gz"))
    assert traces == [f"mb{m}-PP-{s}-TP-0.trace.json.gz" for m in (1, 2) for s in (0, 1)]
