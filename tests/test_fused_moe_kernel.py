"""The fused MoE kernels (``radixserve.layers.moe.triton_ops``) against a
float32 torch reference.

On the CPU the kernels run in Triton's interpreter, in one subprocess for
the whole module (the flag must be set before triton is imported), on tiny
shapes. The GPU tests run the same checks on CUDA at the models' sizes,
in bf16, and under CUDA graph capture and replay.
"""

from __future__ import annotations

import functools
import json
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import run_interpreted



@dataclass(frozen=True)
class Case:
    name: str
    experts: int
    top_k: int
    tokens: int
    hidden: int
    inter: int
    dtype: torch.dtype = torch.float32
    skipped: float = 0.0  # the share of choices set to -1
    config: dict | None = None  # over TINY_CONFIG on the CPU; None on the GPU: the tuned or default one
    ids_dtype: torch.dtype = torch.int32


KERNEL_CASES = [
    Case("one token", 4, 2, 1, 40, 24),  # K and N not multiples of the tiles
    Case("one token, some choices on other ranks", 16, 6, 1, 40, 24, skipped=0.5, ids_dtype=torch.int64),
    Case("tokens past a block", 8, 2, 37, 40, 24, config=dict(GROUP_SIZE_M=4)),
    Case("experts without tokens", 16, 4, 3, 32, 16),
    Case("skipped ids", 8, 3, 20, 32, 16, skipped=0.3),
    Case("several align programs", 6, 2, 70, 32, 16, skipped=0.2),
    Case("bf16", 8, 2, 19, 64, 32, torch.bfloat16, config=dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=32, BLOCK_SIZE_K=32)),
    Case("fp16, odd expert count, int64 ids", 3, 1, 5, 32, 16, torch.float16, ids_dtype=torch.int64),
    # BLOCK_SIZE_M below 16: the CUDA cores
    # one token there: the down GEMM and the top-k sum in one launch
    Case("one token, CUDA cores", 4, 2, 1, 40, 24, config=dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=8, BLOCK_SIZE_K=32)),
    Case("one token, CUDA cores, choices on other ranks", 16, 6, 1, 40, 24, skipped=0.5,
         config=dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=16, BLOCK_SIZE_K=8)),
    Case("one token, CUDA cores, bf16", 8, 4, 1, 64, 32, torch.bfloat16,
         config=dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)),
    Case("one token, CUDA cores, one column a program", 4, 2, 1, 40, 24,
         config=dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=1, BLOCK_SIZE_K=16)),
    Case("tokens on the CUDA cores, skipped ids", 8, 3, 6, 32, 16, skipped=0.3,
         config=dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16)),
    Case("bf16, two rows a block on the CUDA cores", 8, 2, 5, 64, 32, torch.bfloat16,
         config=dict(BLOCK_SIZE_M=2, BLOCK_SIZE_N=16, BLOCK_SIZE_K=32)),
]
# (tokens, top_k, experts, block size, share of -1 ids[, count_first]): the last four counted first,
# as past 64 programs, on a few programs here
ALIGN_CASES = [(1, 1, 4, 16, 0.0), (5, 3, 7, 4, 0.3), (100, 3, 7, 8, 0.2), (64, 8, 128, 16, 0.0), (3, 2, 5, 4, 1.0),
               (5, 3, 7, 4, 0.3, True), (100, 3, 7, 8, 0.2, True), (64, 8, 128, 16, 0.0, True), (3, 2, 5, 4, 1.0, True)]
# max |fused - reference| / max |reference|: float32 end to end; half precision rounds
# SiLU * up and each expert's output once (the interpreter truncates to bf16 where the GPU rounds)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
TINY_CONFIG = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=16, BLOCK_SIZE_K=16, GROUP_SIZE_M=1, num_warps=4, num_stages=2)


def routing(tokens, top_k, experts, skipped, *, seed, device="cpu"):
    """Softmax top-k routing of random logits; a ``skipped`` share of the
    choices set to -1 (and token 0's all of them, when there are any)."""
    gen = torch.Generator().manual_seed(seed)
    weights, ids = torch.softmax(torch.randn(tokens, experts, generator=gen), dim=-1).topk(top_k, dim=-1)
    ids = ids.to(torch.int32)
    if skipped:
        ids[torch.rand(tokens, top_k, generator=gen) < skipped] = -1
        if tokens > 1:
            ids[0] = -1
    return weights.to(device), ids.to(device)


@functools.lru_cache(maxsize=1)  # the GPU tests' cases go model by model
def expert_weights(experts, hidden, inter):
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5,
            torch.randn(experts, hidden, inter, generator=gen) / inter**0.5)


def make_inputs(experts, top_k, tokens, hidden, inter, dtype, skipped, *, seed=0, device="cpu"):
    """Tokens and routing from ``seed``; the experts' weights are the same for every seed."""
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed))
    w13, w2 = expert_weights(experts, hidden, inter)
    weights, ids = routing(tokens, top_k, experts, skipped, seed=seed + 1)
    return (*(t.to(device, dtype) for t in (x, w13, w2)), weights.to(device), ids.to(device))


def reference(x, w13, w2, weights, ids):
    """float32, expert by expert, of the inputs as given (already rounded)."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    out = torch.zeros_like(x)
    tokens, top_k = ids.shape
    for e in range(w13.shape[0]):
        token, slot = (ids == e).nonzero(as_tuple=True)
        if token.numel():
            gate, up = F.linear(x[token], w13[e]).chunk(2, dim=-1)
            out.index_add_(0, token, F.linear(F.silu(gate) * up, w2[e]) * weights[token, slot, None])
    return out


def kernel_case(case: Case, device) -> dict:
    """The fused output's error against the reference, relative to the reference's largest value."""
    from radixserve.layers.moe.triton_ops import fused_experts

    x, w13, w2, weights, ids = make_inputs(case.experts, case.top_k, case.tokens, case.hidden, case.inter, case.dtype,
                                           case.skipped, device=device)
    ids = ids.to(case.ids_dtype)
    config = None if case.config is None and device == "cuda" else {**TINY_CONFIG, **(case.config or {})}
    out = fused_experts(x, w13, w2, weights, ids, config=config)
    want = reference(x, w13, w2, weights, ids)
    skipped_rows = (ids < 0).all(dim=1)
    return {"error": float((out.float() - want).abs().max() / want.abs().max()), "dtype": str(out.dtype),
            "shape": list(out.shape), "skipped_rows_zero": bool((out[skipped_rows] == 0).all()),
            "empty_experts": case.experts - int(ids[ids >= 0].unique().numel()), "skipped": int((ids < 0).sum())}


def align_case(case, device) -> dict:
    from radixserve.layers.moe.triton_ops import moe_align_block_size

    tokens, top_k, experts, block, skipped, *count_first = case
    _, ids = routing(tokens, top_k, experts, skipped, seed=tokens, device=device)
    sorted_ids, expert_ids, num_post = moe_align_block_size(ids, block, experts, count_first=(count_first or [None])[0])
    return {"ids": ids.tolist(), "sorted": sorted_ids.tolist(), "experts": expert_ids.tolist(),
            "num_post": num_post.tolist(), "dtypes": [str(t.dtype) for t in (sorted_ids, expert_ids, num_post)]}


_SCRIPT = """
import json, sys
payload = json.loads(sys.argv[1])
sys.path.insert(0, payload["tests"])
import test_fused_moe_kernel as t
print(json.dumps({"kernel": [t.kernel_case(c, "cpu") for c in t.KERNEL_CASES],
                  "align": [t.align_case(c, "cpu") for c in t.ALIGN_CASES]}))
"""


def _interpreter_takes_runtime_loop_bounds() -> bool:
    """Triton 3.6's interpreter hands a kernel's runtime scalars over as
    one-element arrays, and numpy 2 refuses those as ``range`` bounds (the
    grouped GEMM loops to its runtime K); 3.9's passes them as scalars. A
    host with the older pair runs the GPU cases only."""
    triton = pytest.importorskip("triton")
    import numpy
    from packaging.version import Version

    return Version(triton.__version__) >= Version("3.9") or Version(numpy.__version__) < Version("2")


@pytest.fixture(scope="module")
def interpreted():
    """Every CPU case, run once in Triton's interpreter."""
    if not _interpreter_takes_runtime_loop_bounds():
        pytest.skip("this Triton's interpreter cannot loop to a runtime bound under numpy 2 (Triton 3.9 can)")
    return run_interpreted(_SCRIPT, {"tests": os.path.dirname(__file__)})


def check_kernel_result(case: Case, result):
    assert result["shape"] == [case.tokens, case.hidden] and result["dtype"] == str(case.dtype)
    assert result["error"] < TOLERANCE[case.dtype], (case.name, result["error"])
    assert result["skipped_rows_zero"], "a token whose choices are all -1 gets a zero row"
    if case.tokens == 1 and case.skipped:  # the one-token layout keeps -1 choices: some of each here
        assert 0 < result["skipped"] < case.top_k


def check_align_result(case, result):
    """Every kept pair once, in its expert's run, in increasing order; each
    run padded with T * k to whole blocks; each block's expert; the sizes
    within the worst case T * k + E * (block - 1)."""
    tokens, top_k, experts, block, *_ = case
    ids = [e for row in result["ids"] for e in row]
    n, sorted_ids, expert_ids, (num_post,) = len(ids), result["sorted"], result["experts"], result["num_post"]
    assert result["dtypes"] == ["torch.int32"] * 3
    worst = n + experts * (block - 1)
    assert len(sorted_ids) % block == 0 and len(sorted_ids) <= math.ceil(worst / block) * block
    assert len(expert_ids) == len(sorted_ids) // block
    pos = 0
    for e in range(experts):
        pairs = [p for p, x in enumerate(ids) if x == e]
        run = math.ceil(len(pairs) / block) * block
        assert sorted_ids[pos:pos + len(pairs)] == pairs, f"expert {e}'s run"
        assert sorted_ids[pos + len(pairs):pos + run] == [n] * (run - len(pairs)), f"expert {e}'s pads"
        assert expert_ids[pos // block:(pos + run) // block] == [e] * (run // block)
        pos += run
    assert num_post == pos <= len(sorted_ids)


@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c.name for c in KERNEL_CASES])
def test_fused_experts_in_the_interpreter(interpreted, case):
    check_kernel_result(case, interpreted["kernel"][KERNEL_CASES.index(case)])


def test_the_cases_cover_empty_experts_and_skipped_ids(interpreted):
    results = dict(zip((c.name for c in KERNEL_CASES), interpreted["kernel"]))
    assert results["experts without tokens"]["empty_experts"] > 0


@pytest.mark.parametrize("case", ALIGN_CASES,
                         ids=[f"T{c[0]}k{c[1]}E{c[2]}b{c[3]}{'-counted' if c[5:] else ''}" for c in ALIGN_CASES])
def test_moe_align_block_size_in_the_interpreter(interpreted, case):
    check_align_result(case, interpreted["align"][ALIGN_CASES.index(case)])


def test_the_align_check_sees_a_misplaced_pair(interpreted):
    result = {**interpreted["align"][1]}
    kept = [i for i, p in enumerate(result["sorted"][:result["num_post"][0]]) if p < 15]  # 15 pairs: 15 is a pad
    result["sorted"] = result["sorted"][:]
    i, j = kept[0], kept[-1]
    result["sorted"][i], result["sorted"][j] = result["sorted"][j], result["sorted"][i]
    with pytest.raises(AssertionError):
        check_align_result(ALIGN_CASES[1], result)


# --- GPU -------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# the models' shapes (qwen3-30b-a3b's experts; mixtral-8x7b's shrunk to keep the reference quick) and small ones
GPU_CASES = [
    Case(f"{name} T={t} {str(dtype)[6:]}", e, k, t, h, i, dtype, skipped)
    for name, e, k, h, i in (("qwen3-moe", 128, 8, 2048, 768), ("mixtral-ish", 8, 2, 1024, 3584), ("small", 16, 4, 256, 96))
    for t, dtype, skipped in ((1, torch.bfloat16, 0.0), (33, torch.bfloat16, 0.2), (300, torch.bfloat16, 0.0),
                              (300, torch.float32, 0.0))
]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.name for c in GPU_CASES])
def test_fused_experts_on_the_gpu(case):
    check_kernel_result(case, kernel_case(case, "cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", [
    dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, num_warps=4, num_stages=3),
    dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=128, BLOCK_SIZE_K=64, GROUP_SIZE_M=16, num_warps=8, num_stages=3),
    dict(BLOCK_SIZE_M=128, BLOCK_SIZE_N=64, BLOCK_SIZE_K=32, GROUP_SIZE_M=8, num_warps=4, num_stages=4),
    dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=16, BLOCK_SIZE_K=512, GROUP_SIZE_M=1, num_warps=4, num_stages=2),
], ids=["decode tiles", "wide tiles", "tall tiles", "CUDA-core tiles"])
def test_fused_experts_on_the_gpu_with_other_tiles(config):
    case = Case("tiles", 64, 6, 200, 512, 192, torch.bfloat16, 0.1, config)
    check_kernel_result(case, kernel_case(case, "cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("skipped", [0.0, 0.25])
def test_one_token_on_the_cuda_cores_on_the_gpu(skipped):
    """qwen3-30b-a3b's experts, one token, a configuration on the CUDA cores:
    the down GEMM and the top-k sum in one launch."""
    config = dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=8, BLOCK_SIZE_K=512, num_warps=4, num_stages=2)
    case = Case("one token, CUDA cores", 128, 8, 1, 2048, 768, torch.bfloat16, skipped, config)
    check_kernel_result(case, kernel_case(case, "cuda"))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", [(4096, 8, 128, 64, 0.0), (1, 8, 128, 16, 0.0), (513, 2, 8, 128, 0.5),
                                  (300, 8, 256, 16, 0.1), (300, 8, 256, 16, 0.1, True), (1000, 8, 128, 64, 0.0, False)])
def test_moe_align_block_size_on_the_gpu(case):
    check_align_result(case, align_case(case, "cuda"))


@pytest.mark.gpu
@needs_cuda
def test_a_prefills_alignment_counted_first_matches_one_launch():
    """131,072 tokens of qwen3-30b-a3b's routing (a million pairs: W2's
    prefill at batch 256), counted first as by default there, against the
    one-launch kernel that counts every pair in every program."""
    from radixserve.layers.moe.triton_ops import moe_align_block_size

    _, ids = routing(131072, 8, 128, 0.0, seed=0, device="cuda")
    counted = moe_align_block_size(ids, 64, 128)
    one_launch = moe_align_block_size(ids, 64, 128, count_first=False)
    num_post = int(counted[2])
    assert num_post == int(one_launch[2])
    assert torch.equal(counted[0][:num_post], one_launch[0][:num_post])
    assert torch.equal(counted[1][:num_post // 64], one_launch[1][:num_post // 64])


@pytest.mark.gpu
@needs_cuda
def test_fused_experts_under_a_cuda_graph():
    """Captured once, replayed on new tokens and new routing (-1 ids
    included): the same output as eager launches of the same inputs."""
    from radixserve.layers.moe.triton_ops import fused_experts

    experts, top_k, tokens, hidden, inter = 128, 8, 32, 2048, 768
    x, w13, w2, weights, ids = make_inputs(experts, top_k, tokens, hidden, inter, torch.bfloat16, 0.0, device="cuda")
    stream = torch.cuda.Stream()  # compile and warm up off the default stream, as graph capture wants
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fused_experts(x, w13, w2, weights, ids)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for seed, skipped in ((5, 0.0), (6, 0.3), (7, 0.0)):
        new_x, _, _, new_weights, new_ids = make_inputs(experts, top_k, tokens, hidden, inter, torch.bfloat16, skipped,
                                                        seed=seed, device="cuda")
        x.copy_(new_x), weights.copy_(new_weights), ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, fused_experts(x, w13, w2, weights, ids), atol=0, rtol=0)
        want = reference(x, w13, w2, weights, ids)
        assert float((out.float() - want).abs().max() / want.abs().max()) < TOLERANCE[torch.bfloat16]


def test_a_tuned_table_covers_the_batches_up_to_its_largest(tmp_path, monkeypatch):
    """The table of these shapes and this GPU name: the nearest batch's entry
    up to the largest the table has; the default beyond it (unless that is a
    prefill-sized batch) and off CUDA."""
    pytest.importorskip("triton")
    from radixserve.layers.moe.triton_ops import fused_moe

    monkeypatch.setattr(fused_moe, "device_name", lambda device: "Fake_GPU")
    name = fused_moe.config_file_name(128, 2048, 768, torch.bfloat16, "Fake_GPU")
    one = dict(BLOCK_SIZE_M=1, BLOCK_SIZE_N=8, BLOCK_SIZE_K=1024, GROUP_SIZE_M=1, num_warps=4, num_stages=2)
    four = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=32, BLOCK_SIZE_K=256, GROUP_SIZE_M=1, num_warps=2, num_stages=3)
    (tmp_path / name).write_text(json.dumps({"1": one, "4": four}))
    cuda = torch.device("cuda", 0)

    def get(tokens, device=cuda):
        return fused_moe.get_config(128, 2048, 768, 8, torch.bfloat16, tokens, device, config_dir=tmp_path)

    assert get(1) == one and get(2) == one and get(3) == four and get(4) == four
    assert get(5) == fused_moe.default_config(128, 5, 8) and get(64) == fused_moe.default_config(128, 64, 8)
    assert get(1, torch.device("cpu")) == fused_moe.default_config(128, 1, 8)
    (tmp_path / name).write_text(json.dumps({"1": one, "4096": four}))
    fused_moe.load_configs.cache_clear()
    assert get(8192) == four and get(2) == one
