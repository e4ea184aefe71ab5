"""Piecewise CUDA graphs' cutting and padding, on a CPU: the runner replays
its pieces eagerly (``use_graphs=False``) on the same static buffers, so the
token counts, the padding rows and the eager attention between pieces run
here as on a GPU, with the CPU's attention and with the GPU's Triton kernels
(Triton's interpreter). The graphs themselves are checked on the H200
(``test_gpu_engine.py``). Also the server flags, as SGLang names them."""

from __future__ import annotations

import bisect

import pytest
import torch
from test_engine import GREEDY, hf_greedy, llama, prompts, tiny  # noqa: F401 (fixtures)
from triton_interpreter import run_interpreted

import radixserve
from radixserve.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner, supports_pieces
from radixserve.server_args import ServerArgs, piecewise_token_sizes

SIZES = [8, 32, 64, 128]  # small, so that most extends pad and the largest do not fit


def plain_engine(folder, **kw):
    kw = {"max_total_tokens": 4096, "max_running_requests": 16, **kw}
    return radixserve.Engine(model_path=folder, check_invariants=True, disable_tqdm=True, device="cpu", **kw)


def piecewise_engine(folder, **kw):
    eng = plain_engine(folder, **kw)
    runner = eng.scheduler.model_runner
    runner.piecewise_runner = PiecewiseCudaGraphRunner(runner, SIZES, use_graphs=False)
    return eng


def spy_on_pieces(eng) -> list[tuple[int, int]]:
    """Record ``(tokens, padded size)`` of every extend the pieces run."""
    pieces, seen = eng.scheduler.model_runner.piecewise_runner, []
    forward = pieces.forward

    def spy(fb):
        seen.append((fb.num_tokens, pieces.padded_size(fb.num_tokens)))
        return forward(fb)

    pieces.forward = spy
    return seen


def test_piecewise_token_sizes_pad_little():
    for max_tokens in (1, 7, 100, 1024, 4096, 8192):
        sizes = piecewise_token_sizes(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] >= 1
        for n in range(1, max_tokens + 1):
            padded = sizes[bisect.bisect_left(sizes, n)]
            assert n <= padded <= (n * 9 // 8 + 1 if n >= 128 else n + 15), (max_tokens, n, padded)


def test_greedy_through_pieces_matches_hf(tiny):
    """Every architecture (Qwen3's per-head norm, Qwen2's biases, tied
    embeddings): prompts that pad to each size, one past the largest (eager)."""
    folder, hf = tiny
    batch = prompts([5, 1, 31, 64, 100, 200], seed=3)
    with piecewise_engine(folder, chunked_prefill_size=256) as eng:
        seen = spy_on_pieces(eng)
        for ids in batch:  # one at a time: extends of these exact lengths
            out = eng.generate(input_ids=ids, sampling_params=GREEDY)
            assert out["output_ids"] == hf_greedy(hf, ids, GREEDY["max_new_tokens"])
        eng.scheduler.check_memory()
    assert [n for n, _ in seen] == [5, 1, 31, 64, 100]  # 200 tokens ran eagerly
    assert [t for _, t in seen] == [8, 8, 32, 64, 128]


@pytest.mark.parametrize("overlap", [False, True])
def test_mixed_steps_cached_prefixes_and_logprobs_through_pieces(llama, overlap):
    """Mixed steps (riders decoding inside chunks), prefix hits and input
    logprobs through the pieces: tokens equal HF's, logprobs an eager engine's."""
    folder, hf = llama
    shared = prompts([24], seed=11)[0]
    batch = prompts([40, 9, 70, 23, 5, 55], seed=7) + prompts([6, 13], seed=8, shared=shared)
    params = [{**GREEDY, "max_new_tokens": n} for n in (9, 14, 6, 12, 10, 7, 8, 11)]
    kw = dict(enable_mixed_chunk=True, max_running_requests=3, chunked_prefill_size=16)
    results = []
    for use_pieces in (True, False):
        with piecewise_engine(folder, **kw) if use_pieces else plain_engine(folder, **kw) as eng:
            eng.scheduler.overlap = overlap
            seen = spy_on_pieces(eng) if use_pieces else None
            eng.generate(input_ids=shared + [1], sampling_params=GREEDY)
            outs = eng.generate(input_ids=batch, sampling_params=params)
            scored = eng.generate(input_ids=batch[:4], sampling_params=params[:4], return_logprob=True,
                                  logprob_start_len=0, top_logprobs_num=2)
            eng.scheduler.check_memory()
        results.append((outs, scored))
        if use_pieces:
            assert all(o["meta_info"]["cached_tokens"] >= 24 for o in outs[-2:])
            assert len(seen) >= 10 and any(n < t for n, t in seen)
    (piece_outs, piece_scored), (plain_outs, plain_scored) = results
    for ids, p, piece, plain in zip(batch, params, piece_outs, plain_outs):
        assert piece["output_ids"] == plain["output_ids"] == hf_greedy(hf, ids, p["max_new_tokens"])
    for piece, plain in zip(piece_scored, plain_scored):
        assert piece["output_ids"] == plain["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            got, want = piece["meta_info"][key], plain["meta_info"][key]
            assert [t for _, t in got] == [t for _, t in want]
            assert [lp for lp, _ in got[1:]] == pytest.approx([lp for lp, _ in want[1:]], abs=1e-4)


_TRITON_SCRIPT = """
import json, sys
import radixserve
from radixserve.model_executor.piecewise_cuda_graph_runner import PiecewiseCudaGraphRunner
batch, params = json.loads(sys.argv[1])
result = {}
for pieces in (False, True):
    eng = radixserve.Engine(model_path="tiny-llama", device="cpu", attention_backend="triton", disable_tqdm=True,
                            max_total_tokens=2048, max_running_requests=2, chunked_prefill_size=16,
                            enable_mixed_chunk=True)
    seen = []
    if pieces:
        runner = eng.scheduler.model_runner
        runner.piecewise_runner = PiecewiseCudaGraphRunner(runner, [8, 16, 32], use_graphs=False)
        forward = runner.piecewise_runner.forward
        runner.piecewise_runner.forward = lambda fb: (seen.append(fb.num_decoding), forward(fb))[1]
    result[str(pieces)] = [o["output_ids"] for o in eng.generate(input_ids=batch, sampling_params=params)]
    result["riders"] = sum(seen)
    eng.shutdown()
print(json.dumps(result))
"""


def test_triton_attention_between_pieces():
    """The GPU's attention kernels between the pieces (Triton's interpreter,
    in a process of its own: the flag is read when kernels are defined),
    riders of mixed steps through the decode kernel included: the same tokens
    as without pieces."""
    batch = prompts([40, 9, 30, 5], seed=7)
    params = [{**GREEDY, "max_new_tokens": n} for n in (6, 9, 5, 7)]
    result = run_interpreted(_TRITON_SCRIPT, [batch, params])
    assert result["True"] == result["False"] and result["riders"] > 0


def test_models_without_the_layout_are_not_cut():
    assert not supports_pieces(torch.nn.Linear(2, 2))


def test_server_flags():
    on = dict(model_path="m")  # the default on CUDA; SGLang's --enable-piecewise-cuda-graph changes nothing
    assert ServerArgs(**on, device="cpu").resolved_piecewise_cuda_graph_tokens() == []
    assert ServerArgs(**on, device="cuda", enable_piecewise_cuda_graph=True
                      ).resolved_piecewise_cuda_graph_tokens() == ServerArgs(**on, device="cuda").resolved_piecewise_cuda_graph_tokens()
    assert ServerArgs(**on, device="cuda", disable_cuda_graph=True).resolved_piecewise_cuda_graph_tokens() == []
    assert ServerArgs(**on, device="cuda", chunked_prefill_size=1024
                      ).resolved_piecewise_cuda_graph_tokens() == piecewise_token_sizes(1024)
    assert ServerArgs(**on, device="cuda").resolved_piecewise_cuda_graph_tokens()[-1] == 4096
    assert ServerArgs(**on, device="cuda", chunked_prefill_size=-1,
                      piecewise_cuda_graph_max_tokens=300).resolved_piecewise_cuda_graph_tokens()[-1] == 300
    assert ServerArgs(**on, device="cuda", disable_piecewise_cuda_graph=True).resolved_piecewise_cuda_graph_tokens() == []
    assert ServerArgs(**on, device="cuda", disaggregation_mode="decode").resolved_piecewise_cuda_graph_tokens() == []
    assert ServerArgs(**on, device="cuda", piecewise_cuda_graph_tokens="[64, 16, 64]"
                      ).resolved_piecewise_cuda_graph_tokens() == [16, 64]
    for bad in ("[]", "[0, 8]", "16", "[1.5]", "[8,"):
        with pytest.raises(ValueError, match="piecewise_cuda_graph_tokens"):
            ServerArgs(model_path="m", piecewise_cuda_graph_tokens=bad)
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
        ServerArgs(model_path="m", piecewise_cuda_graph_max_tokens=0)
