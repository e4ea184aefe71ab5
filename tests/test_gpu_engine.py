"""The whole GPU path against HF transformers (GPU only): the Engine with the
triton backend, CUDA graphs (decode, and piecewise for extends) on and off,
overlap scheduling on and off, on dummy Llama and Qwen3 models in bfloat16
whose weights HF saved (mixtures of experts: tests/test_gpu_moe.py).

Requests of mixed prompt lengths and output lengths make the decode batch
shrink step by step, so graphs replay padded. HF then scores our prompt +
output in one forward (teacher forcing): each of our greedy tokens must be
HF's argmax wherever HF's top-2 margin is clear, and our logprobs (of the
outputs, and of the prompts' own tokens as the extend scores them, and of
the ids ``token_ids_logprob`` names at each) must match HF's within bf16
tolerance. A tiny KV pool checks retraction on the GPU.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

import radixserve

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SHAPE = dict(
    vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=4096, initializer_range=0.1,
)
CONFIGS = {
    "llama": lambda: LlamaConfig(**SHAPE, rope_theta=500000.0, architectures=["LlamaForCausalLM"]),
    "qwen3": lambda: Qwen3Config(**SHAPE, head_dim=128, tie_word_embeddings=True, architectures=["Qwen3ForCausalLM"]),
}
PROMPT_LENS = (5, 300, 1, 77, 1000, 33, 128, 9, 513, 64)
OUTPUT_LENS = (24, 3, 17, 1, 32, 9, 24, 12, 5, 30)
MARGIN = 0.5  # top-2 logprob gap beyond which bf16 noise cannot flip the argmax
# |our logprob - HF's| of the chosen tokens: two bf16 computations of a
# 4-layer model differ by ~0.05 typically, with outliers near 0.2.
LOGPROB_MAX_DIFF, LOGPROB_MEAN_DIFF = 0.3, 0.08
ASKED = [0, 17, 4095]  # token_ids_logprob: ids scored at every position, whichever token comes
# Mostly unlikely tokens there: logprobs of larger magnitude, so bf16's relative error is larger in absolute terms.
ASKED_MAX_DIFF = 0.6


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    with torch.device("cuda"):
        hf = AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    return str(folder), hf


def _prompts(vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def _hf_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: HF's next-token logprobs before each of our output tokens."""
    ids = torch.tensor([prompt + output], device="cuda")
    logits = hf(ids).logits[0, len(prompt) - 1 : len(prompt) + len(output) - 1].float()
    return torch.log_softmax(logits, dim=-1).cpu()


@pytest.mark.parametrize("cuda_graph", [True, False], ids=["graph", "eager"])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_greedy_and_logprobs_match_hf(checkpoint, cuda_graph, overlap):
    folder, hf = checkpoint
    prompts = _prompts(SHAPE["vocab_size"])
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in OUTPUT_LENS]
    with radixserve.Engine(
        model_path=folder, device="cuda", dtype="bfloat16", attention_backend="triton", max_running_requests=16,
        max_total_tokens=16384, disable_cuda_graph=not cuda_graph,
        disable_overlap_schedule=not overlap, check_invariants=True, disable_tqdm=True,
    ) as eng:
        runner = eng.scheduler.model_runner
        assert (runner.cuda_graph_runner is not None) == (runner.piecewise_runner is not None) == cuda_graph
        assert eng.scheduler.overlap == overlap
        pieces = _count_piecewise_extends(runner)
        plain = eng.generate(input_ids=prompts, sampling_params=params)
        scored = eng.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2,
                              token_ids_logprob=ASKED)
        inputs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0, token_ids_logprob=ASKED)
        assert (len(pieces) >= 2) == cuda_graph  # the prompts' extends replayed pieces
        if cuda_graph:
            del runner.piecewise_runner.forward  # no cycle keeps the KV pool alive after the engine
        assert eng.scheduler.is_idle()
        eng.scheduler.check_memory()

    checked, diffs, in_diffs, asked_diffs = 0, [], [], []
    for prompt, out, with_lp, prompt_lp in zip(prompts, plain, scored, inputs):
        checked += _check_greedy(hf, prompt, out["output_ids"])
        assert len(out["output_ids"]) == len(with_lp["output_ids"])
        ref = _hf_logprobs(hf, prompt, with_lp["output_ids"])
        diffs += [abs(lp - float(ref[k, tok])) for k, (lp, tok) in enumerate(with_lp["meta_info"]["output_token_logprobs"])]
        asked = with_lp["meta_info"]["output_token_ids_logprobs"]
        asked_diffs += [abs(lp - float(ref[k, tok])) for k, entry in enumerate(asked) for lp, tok in entry]
        if len(prompt) > 1:  # the prompt's own tokens, scored by the extend
            ref_in = _hf_logprobs(hf, prompt[:1], prompt[1:])
            in_diffs += [abs(lp - float(ref_in[k, tok]))
                         for k, (lp, tok) in enumerate(prompt_lp["meta_info"]["input_token_logprobs"][1:])]
            asked = prompt_lp["meta_info"]["input_token_ids_logprobs"][1:]
            assert [[tok for _, tok in entry] for entry in asked] == [ASKED] * (len(prompt) - 1)
            asked_diffs += [abs(lp - float(ref_in[k, tok])) for k, entry in enumerate(asked) for lp, tok in entry]
    in_diffs.sort()
    print(f"logprob |diff| vs HF: max {max(diffs):.3f} mean {sum(diffs) / len(diffs):.4f}; {checked} tokens checked; "
          f"{len(in_diffs)} prompt tokens: max {in_diffs[-1]:.3f} p99.9 {in_diffs[len(in_diffs) * 999 // 1000]:.3f} "
          f"mean {sum(in_diffs) / len(in_diffs):.4f}")
    assert max(diffs) <= LOGPROB_MAX_DIFF and sum(diffs) / len(diffs) <= LOGPROB_MEAN_DIFF
    # The prompts' ~2,000 scored tokens: the same bound on all but the rarest outliers.
    assert in_diffs[len(in_diffs) * 999 // 1000] <= LOGPROB_MAX_DIFF and sum(in_diffs) / len(in_diffs) <= LOGPROB_MEAN_DIFF
    assert checked >= sum(OUTPUT_LENS) // 3  # many steps have a clear winner
    print(f"token_ids_logprob |diff| vs HF: max {max(asked_diffs):.3f} mean {sum(asked_diffs) / len(asked_diffs):.4f} "
          f"over {len(asked_diffs)}")
    assert max(asked_diffs) <= ASKED_MAX_DIFF and sum(asked_diffs) / len(asked_diffs) <= LOGPROB_MEAN_DIFF


@pytest.mark.parametrize("page_size, pool, new_tokens", [(1, 160, 40), (16, 160, 80)])
def test_retraction_on_a_tiny_pool_keeps_outputs(checkpoint, page_size, pool, new_tokens):
    """Graphs and overlap on; a pool of a few requests' worth forces retraction and re-prefill."""
    folder, hf = checkpoint
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, SHAPE["vocab_size"], (n,), generator=gen).tolist() for n in (20, 25, 18, 30, 22, 16)]
    with radixserve.Engine(
        model_path=folder, device="cuda", dtype="bfloat16", max_running_requests=8, max_total_tokens=pool,
        page_size=page_size, check_invariants=True, disable_tqdm=True,
    ) as eng:
        outs = eng.generate(input_ids=prompts, sampling_params={"temperature": 0, "max_new_tokens": new_tokens, "ignore_eos": True})
        assert eng.scheduler.stats.retractions > 0
        assert eng.scheduler.overlap and eng.scheduler.model_runner.cuda_graph_runner is not None
    checked = sum(_check_greedy(hf, p, o["output_ids"]) for p, o in zip(prompts, outs))
    assert all(len(o["output_ids"]) == new_tokens for o in outs) and checked >= 6 * new_tokens // 4


def _count_piecewise_extends(runner) -> list[int]:
    """Record the token count of every extend that replays piecewise graphs."""
    seen = []
    if runner.piecewise_runner is not None:
        forward = runner.piecewise_runner.forward
        runner.piecewise_runner.forward = lambda fb: (seen.append(fb.num_tokens), forward(fb))[1]
    return seen


def _check_greedy(hf, prompt: list[int], output: list[int]) -> int:
    """Assert each token is HF's argmax where the top-2 margin is clear; return how many were checked."""
    top2 = _hf_logprobs(hf, prompt, output).topk(2, dim=-1)
    checked = 0
    for k, tok in enumerate(output):
        if top2.values[k, 0] - top2.values[k, 1] > MARGIN:
            assert tok == int(top2.indices[k, 0]), f"step {k} of a {len(prompt)}-token prompt"
            checked += 1
    return checked


def test_mixed_chunk_keeps_outputs(checkpoint):
    """--enable-mixed-chunk with graphs (piecewise too) and overlap on: with
    three running slots and 64-token chunks, running requests decode inside
    prefills."""
    folder, hf = checkpoint
    prompts = _prompts(SHAPE["vocab_size"])
    with radixserve.Engine(
        model_path=folder, device="cuda", dtype="bfloat16", max_running_requests=3, chunked_prefill_size=64,
        max_total_tokens=16384, enable_mixed_chunk=True, check_invariants=True,
        disable_tqdm=True,
    ) as eng:
        launch, mixed = eng.scheduler.launch_batch, []

        def spy(batch):
            mixed.append(len(batch.decoding_reqs))
            return launch(batch)

        eng.scheduler.launch_batch = spy
        pieces = _count_piecewise_extends(eng.scheduler.model_runner)
        outs = eng.generate(input_ids=prompts, sampling_params=[
            {"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in OUTPUT_LENS])
        del eng.scheduler.launch_batch  # no cycle keeps the KV pool alive after the engine
        del eng.scheduler.model_runner.piecewise_runner.forward
    assert sum(1 for n in mixed if n) >= 5 and len(pieces) >= sum(1 for n in mixed if n)
    checked = sum(_check_greedy(hf, p, o["output_ids"]) for p, o in zip(prompts, outs))
    assert [len(o["output_ids"]) for o in outs] == list(OUTPUT_LENS) and checked >= sum(OUTPUT_LENS) // 4


def test_a_second_engine_in_the_process_sizes_its_pool_like_the_first(checkpoint):
    """A pool sized from free memory: the memory a shut-down engine's pool
    left in torch's cache counts as free for the next one."""
    folder, _ = checkpoint
    sizes = []
    for _ in range(2):
        with radixserve.Engine(model_path=folder, device="cuda", dtype="bfloat16", disable_tqdm=True) as eng:
            sizes.append(eng.scheduler.allocator.size)
            assert eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2})["output_ids"]
    assert sizes[1] >= 0.95 * sizes[0]
