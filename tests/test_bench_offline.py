"""The offline throughput benchmark end to end on a tiny dummy model, the
walls of its timed regions fixed so that every figure it reports is known."""

from __future__ import annotations

import json

from radixserve.bench import offline_throughput as bench

OURS_S, HF_S = 1.0, 4.0  # the timed walls: HF takes four times as long for the same tokens


def _with_wall(result: tuple, wall: float) -> tuple:
    outputs, _, counters = result
    return outputs, wall, counters


def test_offline_throughput_figures_follow_from_the_tokens_and_the_walls(capsys, tmp_path, monkeypatch):
    made = []  # the requests both backends ran
    real = {name: getattr(bench, name) for name in ("make_requests", "run_radixserve", "run_hf")}
    monkeypatch.setattr(bench, "make_requests", lambda *a: made.append(real["make_requests"](*a)) or made[-1])
    monkeypatch.setattr(bench, "run_radixserve", lambda *a: _with_wall(real["run_radixserve"](*a), OURS_S))
    monkeypatch.setattr(bench, "run_hf", lambda *a: _with_wall(real["run_hf"](*a), HF_S))
    out_file = tmp_path / "bench.jsonl"
    records = bench.main([
        "--workload", "W1", "--model-path", "tiny-llama", "--num-prompts", "5", "--input-len-range", "4", "12",
        "--output-len-range", "2", "6", "--compare-hf", "--hf-batch-size", "2", "--disable-tqdm",
        "--output-json", str(out_file),
    ])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == records == [json.loads(line) for line in out_file.read_text().splitlines()]
    (reqs,) = made
    in_tokens = sum(len(r.input_ids) for r in reqs)
    out_tokens = sum(r.max_new_tokens for r in reqs)  # ignore_eos: each runs to its own max_new_tokens
    ours, hf, summary = records
    assert (ours["backend"], hf["backend"]) == ("radixserve", "hf_transformers")
    for rec, wall in ((ours, OURS_S), (hf, HF_S)):
        assert rec["workload"] == "W1" and rec["model"] == "tiny-llama" and rec["full_size"] is False
        assert rec["num_prompts"] == 5 and rec["input_len_range"] == [4, 12] and rec["output_len_range"] == [2, 6]
        # a batch's padding (HF runs each batch to its longest request) is not output
        assert (rec["input_tokens"], rec["output_tokens"], rec["wall_s"]) == (in_tokens, out_tokens, wall)
        # rates per second of the timed wall (exact: the walls divide the counts into quarters)
        assert rec["output_tok_s"] == out_tokens / wall and rec["total_tok_s"] == (in_tokens + out_tokens) / wall
        assert rec["request_s"] == 5 / wall
    assert hf["generated_tokens_incl_padding"] >= out_tokens
    assert 2 <= ours["forward_ct"] <= out_tokens  # batched: fewer steps than tokens
    assert summary["speedup_output_tok_s"] == HF_S / OURS_S


def test_rounds_alternate_the_backends_and_summarise_each_round(capsys, monkeypatch):
    ours_walls, hf_walls = iter([1.0, 2.0]), iter([4.0, 4.0])  # round speed-ups 4 and 2; summed walls 8 / 3
    real = {name: getattr(bench, name) for name in ("run_radixserve", "run_hf")}
    order = []

    def ours(*a):
        order.append("radixserve")
        return _with_wall(real["run_radixserve"](*a), next(ours_walls))

    def hf(*a):
        order.append("hf")
        return _with_wall(real["run_hf"](*a), next(hf_walls))

    monkeypatch.setattr(bench, "run_radixserve", ours)
    monkeypatch.setattr(bench, "run_hf", hf)
    records = bench.main([
        "--workload", "W1", "--model-path", "tiny-llama", "--num-prompts", "3", "--input-len-range", "4", "8",
        "--output-len-range", "2", "3", "--compare-hf", "--rounds", "2", "--disable-tqdm",
    ])
    capsys.readouterr()
    assert order == ["radixserve", "hf", "radixserve", "hf"]
    *runs, summary = records
    assert [(r["backend"], r["round"], r["wall_s"]) for r in runs] == [
        ("radixserve", 0, 1.0), ("hf_transformers", 0, 4.0), ("radixserve", 1, 2.0), ("hf_transformers", 1, 4.0)]
    assert runs[0]["output_tokens"] == runs[2]["output_tokens"]  # the same requests each round
    assert summary["rounds"] == 2 and summary["speedup_by_round"] == [4.0, 2.0] and summary["speedup_median"] == 3.0
    assert summary["speedup_output_tok_s"] == round(8 / 3, 3)


def test_warm_give_back_makes_the_timed_run_map_its_pool_again(capsys):
    args = ["--workload", "W1", "--model-path", "tiny-llama", "--num-prompts", "6", "--input-len-range", "200", "300",
            "--output-len-range", "2", "4", "--disable-tqdm", "--enable-elastic-kv", "--elastic-kv-page-mb", "0.0625",
            "--warm-runs", "1", "--elastic-kv-max-reserve-pages", "1000"]  # what the warm run mapped stays
    kept, = bench.main(args)
    given, = bench.main(args + ["--warm-give-back"])
    capsys.readouterr()
    assert given["output_tokens"] == kept["output_tokens"]
    # the warm run's pages stay mapped (they are reused), unless given back: then the timed run maps them again
    assert kept["elastic_kv_maps"] == 0 < given["elastic_kv_maps"]
