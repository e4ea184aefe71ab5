"""Tensor parallelism on two GPUs (NCCL), against HF transformers: the
Engine at tp 2, CUDA graphs (capturing the all-reduces) and overlap on, on
the dummy Llama and Qwen3 checkpoints of test_gpu_engine.py. Skipped with
fewer than two CUDA devices."""

from __future__ import annotations

import pytest
import torch

import radixserve
from test_gpu_engine import (  # noqa: F401  (checkpoint is a fixture)
    LOGPROB_MAX_DIFF, LOGPROB_MEAN_DIFF, OUTPUT_LENS, SHAPE, _check_greedy, _hf_logprobs, _prompts, checkpoint,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def test_tp2_greedy_and_logprobs_match_hf(checkpoint):
    folder, hf = checkpoint
    prompts = _prompts(SHAPE["vocab_size"])
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in OUTPUT_LENS]
    with radixserve.Engine(
        model_path=folder, device="cuda", dtype="bfloat16", tp_size=2, max_running_requests=16,
        max_total_tokens=16384, check_invariants=True, disable_tqdm=True, dist_timeout=120,
    ) as eng:
        runner = eng.scheduler.model_runner
        assert runner.tp_size == 2 and runner.cuda_graph_runner is not None and eng.scheduler.overlap
        plain = eng.generate(input_ids=prompts, sampling_params=params)
        scored = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        eng.scheduler.check_memory()
    checked, diffs = 0, []
    for prompt, out, with_lp in zip(prompts, plain, scored):
        checked += _check_greedy(hf, prompt, out["output_ids"])
        ref = _hf_logprobs(hf, prompt, with_lp["output_ids"])
        diffs += [abs(lp - float(ref[k, tok])) for k, (lp, tok) in enumerate(with_lp["meta_info"]["output_token_logprobs"])]
    print(f"tp 2: logprob |diff| vs HF: max {max(diffs):.3f} mean {sum(diffs) / len(diffs):.4f}; {checked} tokens checked")
    assert max(diffs) <= LOGPROB_MAX_DIFF and sum(diffs) / len(diffs) <= LOGPROB_MEAN_DIFF
    assert checked >= sum(OUTPUT_LENS) // 3


def test_tp2_retraction_on_a_tiny_pool_keeps_outputs(checkpoint):
    folder, hf = checkpoint
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (20, 25, 18, 30, 22, 16)]
    with radixserve.Engine(
        model_path=folder, device="cuda", dtype="bfloat16", tp_size=2, max_running_requests=8, max_total_tokens=160,
        check_invariants=True, disable_tqdm=True, dist_timeout=120,
    ) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": 40, "ignore_eos": True})
        assert eng.scheduler.stats.retractions > 0
    checked = sum(_check_greedy(hf, p, o["output_ids"]) for p, o in zip(prompts, outs))
    assert all(len(o["output_ids"]) == 40 for o in outs) and checked >= 6 * 40 // 4
