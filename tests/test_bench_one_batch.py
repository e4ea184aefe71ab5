"""The static-batch benchmark (W2 / W3) end to end on a tiny dummy model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve.bench.generations import run_engine_case
from radixserve.bench.one_batch import Workload, build_engine, main, make_prompts, parse_args, run_case
from radixserve.entrypoints.engine import Engine
from radixserve.layers.sampler import Sampler
from radixserve.mem_cache import ChunkCache
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.model_loader import dummy_config, resolve_model
from radixserve.server_args import ServerArgs


def test_one_batch_reports_rooflines_for_both_backends(capsys, tmp_path):
    out_file = tmp_path / "bench.jsonl"
    records = main([
        "--workload", "W2", "--model-path", "tiny-llama", "--batch-sizes", "1", "3", "--input-len", "16",
        "--output-len", "4", "--compare-hf", "--output-json", str(out_file),
    ])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == records == [json.loads(line) for line in out_file.read_text().splitlines()]
    ours1, ours3, hf1, summary1, hf3, summary3 = records
    assert [r["backend"] for r in (ours1, ours3, hf1, hf3)] == ["radixserve"] * 2 + ["hf_transformers"] * 2

    # The rooflines' inputs, counted independently on HF's model of the same config (float32 on CPU).
    hf_params = sum(p.numel() for p in AutoModelForCausalLM.from_config(dummy_config("tiny-llama")).parameters())
    non_embedding = hf_params - 2 * 512 * 64  # untied embedding and LM head
    kv_per_token = 2 * 2 * 16 * 2 * 4  # layers x kv heads x head_dim x (K, V) x float32
    for rec, bs in ((ours1, 1), (ours3, 3), (hf1, 1), (hf3, 3)):
        assert rec["workload"] == "W2" and rec["model"] == "tiny-llama" and rec["full_size"] is False
        assert (rec["batch_size"], rec["input_len"], rec["output_len"], rec["decode_steps"]) == (bs, 16, 4, 3)
        assert rec["weight_bytes"] == 4 * hf_params
        assert rec["kv_bytes_per_step"] == bs * (16 + 4 / 2) * kv_per_token
        assert rec["prefill_flops"] == 2 * non_embedding * bs * 16 + 4 * 2 * 4 * 16 * bs * 16 * 17 / 2
        assert rec["prefill_ms"] > 0 and rec["prefill_tok_s"] == pytest.approx(bs * 16e3 / rec["prefill_ms"], rel=1e-3)
        step_ms = rec["decode_median_ms"] or rec["decode_mean_ms"]
        assert rec["decode_tok_s"] == pytest.approx(bs / step_ms * 1e3, rel=1e-3)
        bandwidth = (rec["weight_bytes"] + rec["kv_bytes_per_step"]) / (step_ms / 1e3)
        assert rec["decode_pct_peak_bandwidth"] == pytest.approx(100 * bandwidth / 4.25e12, rel=1e-3)
        assert rec["decode_pct_gemv_bandwidth"] == pytest.approx(100 * bandwidth / 3.7e12, rel=1e-3)
    for rec in (ours1, ours3):  # per-step times are ours only; HF's are an average
        assert 0 < rec["decode_median_ms"] <= rec["decode_p90_ms"] and rec["decode_mean_ms"] > 0
        assert rec["kv_pool_tokens"] == 3 * (16 + 4)  # sized to the largest case
    assert hf1["decode_median_ms"] is None and hf1["decode_p90_ms"] is None
    for summary, ours, hf in ((summary1, ours1, hf1), (summary3, ours3, hf3)):
        assert summary["summary"] and summary["batch_size"] == ours["batch_size"]
        assert summary["speedup_decode"] == round(hf["decode_mean_ms"] / ours["decode_mean_ms"], 3)
        assert summary["speedup_prefill"] == round(hf["prefill_ms"] / ours["prefill_ms"], 3)


def test_static_batch_decodes_like_the_engine_and_frees_its_memory():
    config = resolve_model("tiny-qwen2", "dummy", "auto", "cpu")
    runner = ModelRunner(config, page_size=4, max_total_tokens=64, max_running_requests=3, max_context_len=32)
    prompts = make_prompts(3, 9, config.vocab_size, seed=1)
    _, ours = run_case(runner, Sampler(), prompts, output_len=5)

    engine = Engine(model_path="tiny-qwen2", disable_tqdm=True)
    outs = engine.generate(input_ids=prompts.tolist(),
                           sampling_params={"max_new_tokens": 5, "temperature": 0, "ignore_eos": True})
    engine.shutdown()
    assert ours.tolist() == [o["output_ids"] for o in outs]
    assert runner.token_to_kv_pool_allocator.available_size() == 64
    assert runner.req_to_token_pool.available_size() == 3
    runner.token_to_kv_pool_allocator.check_invariants()


def test_the_engine_driver_decodes_what_the_bare_runner_does(capsys):
    """--engine times whole generations through the Engine: the same greedy
    tokens as the runner's static batch, every request generated in full,
    and the radix cache off so that each timed run prefills."""
    config = resolve_model("tiny-qwen2", "dummy", "auto", "cpu")
    runner = ModelRunner(config, page_size=4, max_total_tokens=64, max_running_requests=3, max_context_len=32)
    prompts = make_prompts(3, 9, config.vocab_size, seed=1)
    _, ours = run_case(runner, Sampler(), prompts, output_len=5)

    engine = build_engine(ServerArgs(model_path="tiny-qwen2", page_size=4), Workload(((3, 9),), 5, "tiny-qwen2"))
    try:
        assert isinstance(engine.scheduler.tree_cache, ChunkCache) and engine.scheduler.max_running == 3
        timing, ids = run_engine_case(engine, prompts, output_len=5)
        assert engine.get_stats()["cached_tokens"] == 0
    finally:
        engine.shutdown()
    assert ids.tolist() == ours.tolist()
    assert timing.prefill_s > 0 and timing.decode_mean_s > 0 and timing.decode_s is None

    (rec,) = main(["--workload", "W2", "--model-path", "tiny-llama", "--batch-sizes", "2", "--input-len", "8",
                   "--output-len", "4", "--engine"])
    assert (rec["driver"], rec["overlap"], rec["decode_steps"]) == ("engine", False, 3)  # a CPU forward never overlaps
    assert rec["decode_mean_ms"] > 0 and rec["decode_median_ms"] is None
    for bad in (["--kernel-profile", "k.jsonl"], ["--lora-adapters", "2"], ["--tp-size", "2"]):
        with pytest.raises(SystemExit):
            parse_args(["--workload", "W2", "--engine", *bad])
    with pytest.raises(SystemExit):  # the bare runner has no overlap to turn off
        parse_args(["--workload", "W2", "--disable-overlap-schedule"])
    assert "--engine" in capsys.readouterr().err


def test_w3_overrides_need_an_input_length():
    assert parse_args(["--workload", "W3", "--input-len", "64"]).workload_spec.cases == ((8, 64), (1, 64))
    with pytest.raises(SystemExit):
        parse_args(["--workload", "W3", "--batch-sizes", "2"])


def test_prefill_only_cases_report_the_median_of_their_repeats(monkeypatch):
    import radixserve.bench.one_batch as one_batch

    prefills, real = [], one_batch.run_case

    def recording(*args, **kwargs):
        timing, ids = real(*args, **kwargs)
        prefills.append(timing.prefill_s)
        return timing, ids

    monkeypatch.setattr(one_batch, "run_case", recording)
    (rec,) = main(["--workload", "W3", "--model-path", "tiny-llama", "--batch-sizes", "2", "--input-len", "8",
                   "--prefill-repeats", "3"])
    assert len(prefills) == 4  # the untimed run, then three
    assert rec["prefill_repeats"] == 3 and rec["prefill_ms"] == round(sorted(prefills[1:])[1] * 1e3, 4)
    with pytest.raises(SystemExit):
        parse_args(["--workload", "W3", "--input-len", "8", "--prefill-repeats", "0"])


def test_an_fp8_kv_cache_reads_a_quarter_of_float32_kv_bytes():
    (fp32,) = main(["--workload", "W2", "--model-path", "tiny-llama", "--batch-sizes", "2", "--input-len", "8",
                    "--output-len", "3"])
    (fp8,) = main(["--workload", "W2", "--model-path", "tiny-llama", "--batch-sizes", "2", "--input-len", "8",
                   "--output-len", "3", "--kv-cache-dtype", "fp8_e4m3"])
    assert (fp32["kv_cache_dtype"], fp8["kv_cache_dtype"]) == ("float32", "float8_e4m3fn")
    assert fp8["kv_bytes_per_step"] * 4 == fp32["kv_bytes_per_step"] and fp8["weight_bytes"] == fp32["weight_bytes"]


def test_one_batch_at_tp2_runs_every_rank_and_times_the_all_reduces():
    """--tp-size 2: rank 1 runs the same cases in its own process; rank 0
    reports per-rank shapes and what a step's all-reduces cost."""
    records = main(["--workload", "W2", "--model-path", "tiny-llama", "--load-format", "dummy", "--device", "cpu",
                    "--dtype", "float32", "--batch-sizes", "1", "3", "--input-len", "16", "--output-len", "4",
                    "--tp-size", "2", "--dist-timeout", "120"])
    ours = [r for r in records if r.get("backend") == "radixserve"]
    assert [r["batch_size"] for r in ours] == [1, 3]
    assert all(r["tp_size"] == 2 and r["allreduce_ms_per_step"] > 0 and r["decode_steps"] == 3 for r in ours)


def test_kernel_profile_tables_the_decode_steps_of_each_case(tmp_path, capsys):
    path = tmp_path / "kernels.jsonl"
    main(["--workload", "W2", "--model-path", "tiny-llama", "--batch-sizes", "1", "2", "--input-len", "8",
          "--output-len", "5", "--kernel-profile", str(path)])
    capsys.readouterr()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for bs in (1, 2):
        case = [r for r in rows if r["batch_size"] == bs]
        assert {r["bench"] for r in case} == {"one_batch_kernels"} and {r["profiled_steps"] for r in case} == {3}
        *ops, total = case
        assert total["name"] == "(all)" and total["share"] == 1.0 and ops == sorted(ops, key=lambda r: -r["us_per_step"])
        assert sum(r["us_per_step"] for r in ops) <= total["us_per_step"] + 0.01 * len(ops)
        names = {r["name"] for r in ops}
        # a decode step's work, and nothing of the prefill: 3 steps of a 2-layer model
        assert "mkldnn::_linear_pointwise" in names and not any(n.startswith("ProfilerStep") for n in names)
        calls = {r["name"]: r["calls_per_step"] for r in ops}
        assert calls["mkldnn::_linear_pointwise"] == 2 * 4 + 1  # qkv, o, gate_up, down per layer, and the LM head
        # decode attends once a layer for the whole batch (C kernel or SDPA); the prefill once a request and layer
        assert calls.get("aten::scaled_dot_product_attention", 2) == 2


def test_host_rows_table_the_hosts_calls_and_the_steps_wall_time():
    """The host's side of a profile (added to a GPU profile's table): its
    calls by own CPU time, most first, then the steps' wall time, which no
    step's own calls exceed."""
    from radixserve.bench.kernel_profile import decode_profiler, host_rows

    prof = decode_profiler(torch.device("cpu"), steps=3)
    x = torch.randn(64, 64)
    with prof:
        for _ in range(6):  # the first two are skipped and warm-up: three recorded
            for _ in range(4):
                x = torch.tanh(x @ x)
            prof.step()
    *calls, wall = host_rows(prof, steps=3)
    assert wall["name"] == "(step wall)" and all(r["where"] == "host" for r in calls + [wall])
    assert calls == sorted(calls, key=lambda r: -r["us_per_step"]) and len(calls) <= 15
    assert {r["name"]: r["calls_per_step"] for r in calls}["aten::tanh"] == 4
    assert sum(r["us_per_step"] for r in calls) <= wall["us_per_step"] * 1.01


def test_idle_rows_split_each_step_into_lead_gaps_tail_and_busy():
    """The device's idle time on a timeline of two steps: before each step's
    first kernel, between kernels (overlapping ones are not a gap, a kernel
    that starts in no step is not counted), after the last; the kernels
    that waited longest first."""
    from radixserve.bench.kernel_profile import idle_rows

    steps = [(0.0, 100.0), (100.0, 200.0), (200.0, 300.0)]  # the last step ran no kernel
    work = [("a", 10, 30), ("b", 25, 40), ("c", 50, 60), ("d", 90, 95),  # step 1: gaps 10 before c, 30 before d
            ("a", 120, 150), ("c", 170, 180),  # step 2: a gap of 20 before c
            ("x", -5, -1)]  # before the first step
    rows = {r["name"]: r for r in idle_rows(work, steps)}
    assert {r["where"] for r in rows.values()} == {"device idle"}
    assert rows["(before the first kernel)"]["us_per_step"] == (10 + 20) / 2
    assert rows["(between kernels)"]["us_per_step"] == (10 + 30 + 20) / 2
    assert rows["(after the last kernel)"]["us_per_step"] == (5 + 20) / 2
    assert rows["(busy)"]["us_per_step"] == (30 + 10 + 5 + 30 + 10) / 2
    lead, gaps, tail, busy = (rows[k]["us_per_step"] for k in ("(before the first kernel)", "(between kernels)",
                                                              "(after the last kernel)", "(busy)"))
    assert lead + gaps + tail + busy == 100.0  # each step's wall time, all of it accounted for
    ranked = [r for r in idle_rows(work, steps) if r["name"].startswith("before ")]
    assert [(r["name"], r["calls_per_step"], r["us_per_step"]) for r in ranked] == [("before c", 1.0, 15.0),
                                                                                  ("before d", 0.5, 15.0)]
    assert idle_rows(work, []) == [] and idle_rows([], steps) == []


@pytest.mark.parametrize("driver", [[], ["--engine"]])
def test_a_case_the_pool_cannot_hold_is_reported_as_skipped_and_the_others_run(driver):
    """A pool smaller than the largest case (as 60 GB of MoE weights leave on
    an 80 GB GPU) skips that case, by the runner and by the Engine (which
    would otherwise retract), and HF is compared on the cases that ran."""
    records = main(["--workload", "W2", "--model-path", "tiny-llama", "--batch-sizes", "1", "4", "--input-len", "16",
                    "--output-len", "4", "--max-total-tokens", "40", "--compare-hf", *driver])
    skipped, ours, hf, summary = records
    assert (skipped["batch_size"], skipped["skipped"]) == (4, "the KV pool cannot hold 4 x 20 tokens")
    assert skipped["kv_pool_tokens"] == 40 and "decode_mean_ms" not in skipped
    assert (ours["backend"], ours["batch_size"], ours["decode_steps"]) == ("radixserve", 1, 3) and ours["decode_mean_ms"] > 0
    assert (hf["backend"], hf["batch_size"], summary["batch_size"]) == ("hf_transformers", 1, 1)


def test_the_mean_step_subtracts_the_fastest_of_three_prefills(monkeypatch):
    """Decode timing from whole generations: untimed runs of 1 and a few
    tokens, three timed 1-token runs (the fastest is the prefill, so one run
    slowed by a busy machine cannot make the mean step negative), then the
    whole run."""
    from radixserve.bench import generations

    calls, durations = [], iter([0.050, 0.010, 0.012, 0.040])
    monkeypatch.setattr(generations, "timed", lambda fn, device: (fn(), next(durations))[1])
    timing = generations.generate_timing(calls.append, 7, torch.device("cpu"))
    assert calls == [1, generations.WARMUP_MAX_OUTPUT_LEN, 1, 1, 1, 7]
    assert timing.prefill_s == 0.010 and timing.decode_mean_s == pytest.approx((0.040 - 0.010) / 6)
