"""The offline throughput benchmark end to end on a tiny dummy model."""

from __future__ import annotations

import json

from radixserve.bench.offline_throughput import main


def test_offline_throughput_reports_both_backends(capsys, tmp_path):
    out_file = tmp_path / "bench.jsonl"
    records = main([
        "--workload", "W1", "--model-path", "tiny-llama", "--num-prompts", "5", "--input-len-range", "4", "12",
        "--output-len-range", "2", "6", "--compare-hf", "--hf-batch-size", "2", "--disable-tqdm",
        "--output-json", str(out_file),
    ])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed == records == [json.loads(line) for line in out_file.read_text().splitlines()]
    ours, hf, summary = records
    assert (ours["backend"], hf["backend"]) == ("radixserve", "hf_transformers")
    for rec in (ours, hf):
        assert rec["workload"] == "W1" and rec["model"] == "tiny-llama" and rec["full_size"] is False
        assert rec["num_prompts"] == 5 and rec["input_len_range"] == [4, 12] and rec["output_len_range"] == [2, 6]
        assert 5 * 4 <= rec["input_tokens"] <= 5 * 12
        assert rec["output_tokens"] == ours["output_tokens"]  # ignore_eos: every request runs to its max_new_tokens
        assert rec["output_tok_s"] > 0 and rec["wall_s"] > 0
    assert 5 * 2 <= ours["output_tokens"] <= 5 * 6
    assert 2 <= ours["forward_ct"] <= ours["output_tokens"]  # batched: fewer steps than tokens
    assert summary["speedup_output_tok_s"] == round(ours["output_tok_s"] / hf["output_tok_s"], 3)
