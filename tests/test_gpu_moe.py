"""Mixtures of experts on the GPU (GPU only): the fused Triton MoE path
(layers/moe/triton_ops) inside the whole engine, CUDA graphs (decode and
piecewise) and overlap scheduling on, against HF transformers greedy
decoding on the same tiny random Qwen3-MoE, Mixtral and Qwen2-MoE models.

In float32 (the kernel's IEEE dots): in bfloat16 a near tie between two
experts' router scores flips the choice in one computation and not the
other, and the outputs then part by more than any logit margin can absorb
(tests/test_gpu_engine.py's check), so exact tokens are checked here, where
the two computations differ by float32 rounding only."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

import radixserve
from test_moe_models import CONFIGS, GREEDY, prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return str(folder), hf


@torch.no_grad()
def _hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
def test_greedy_tokens_match_hf_on_the_fused_path(checkpoint, cuda_graph):
    """Chunks of 16 tokens with running requests riding in them, then
    prompts whose shared prefix the first batch cached."""
    folder, hf = checkpoint
    shared = prompts([40], seed=5)[0]
    first = prompts([37, 5, 21], seed=1) + [shared + [1, 2]]
    second = prompts([6, 19], seed=2, shared=shared)
    params = {**GREEDY, "max_new_tokens": 16}
    with radixserve.Engine(model_path=folder, device="cuda", dtype="float32", attention_backend="triton",
                           disable_cuda_graph=not cuda_graph, chunked_prefill_size=16, enable_mixed_chunk=True,
                           max_total_tokens=4096, max_running_requests=8, check_invariants=True,
                           disable_tqdm=True) as eng:
        runner = eng.scheduler.model_runner
        assert (runner.cuda_graph_runner is not None) == cuda_graph and eng.scheduler.overlap
        for batch in (first, second):
            outs = eng.generate(input_ids=batch, sampling_params=params)
            assert [o["output_ids"] for o in outs] == [_hf_greedy(hf, ids, params["max_new_tokens"]) for ids in batch]
        assert all(o["meta_info"]["cached_tokens"] >= 32 for o in outs), "the shared prefix came from the cache"
