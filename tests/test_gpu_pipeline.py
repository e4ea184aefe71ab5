"""Pipeline parallelism on GPUs (two or more CUDA devices): the hidden states
go from stage to stage over NCCL, the tokens back over gloo. pp 2 (and pp 2
with its micro-batches one at a time) in float32 gives HF's greedy tokens on
dummy Llama and Qwen3 (tied LM head on the last stage) checkpoints, with
retraction under a tiny pool; each stage's pool holds its half of the layers."""

from __future__ import annotations

import pytest
import torch
from test_gpu_engine import PROMPT_LENS, checkpoint  # noqa: F401  (a fixture)

import radixserve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]
OUTPUT_LEN = 16
MARGIN = 1e-3  # top-2 logit gap beyond which float32 noise (other kernels, other batches) cannot flip the argmax


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@pytest.mark.parametrize("options", [dict(), dict(pp_micro_batches=1), dict(max_total_tokens=2048)],
                         ids=["pp2", "one-batch-at-a-time", "tiny-pool"])
def test_pp2_on_two_gpus_matches_hf(checkpoint, options):  # noqa: F811
    """HF scores our prompt + output in one forward: each greedy token is its
    argmax wherever the top-2 margin is clear of float32 noise."""
    from transformers import AutoModelForCausalLM

    folder, _ = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
    prompts = _prompts(hf.config.vocab_size)
    params = {"temperature": 0, "max_new_tokens": OUTPUT_LEN, "ignore_eos": True}
    with radixserve.Engine(model_path=folder, device="cuda", dtype="float32", pp_size=2, max_running_requests=16,
                           check_invariants=True, disable_tqdm=True, dist_timeout=120,
                           **{"max_total_tokens": 16384, **options}) as eng:
        stages = eng.scheduler.model_runner.token_to_kv_pool.layer_num
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        stats = eng.get_stats()
    assert stages == hf.config.num_hidden_layers // 2
    if "max_total_tokens" in options:
        assert stats["retractions"] > 0
    checked = 0
    for prompt, out in zip(prompts, outs):
        assert len(out["output_ids"]) == OUTPUT_LEN
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out["output_ids"]], device="cuda")).logits[0, len(prompt) - 1:-1]
        top2 = logits.float().topk(2, dim=-1)
        for k, tok in enumerate(out["output_ids"]):
            if top2.values[k, 0] - top2.values[k, 1] > MARGIN:
                assert tok == int(top2.indices[k, 0]), f"step {k} of a {len(prompt)}-token prompt"
                checked += 1
    assert checked >= len(prompts) * OUTPUT_LEN // 2
