"""The fused routing kernel (``layers/moe/triton_ops/topk.py``) against
``topk.select_experts``'s torch code: Triton's interpreter on the CPU (one
subprocess), CUDA with a GPU."""

from __future__ import annotations

import os
import re

import pytest
import torch

from triton_interpreter import run_interpreted

# (tokens, experts, top_k, renormalize, logits' column stride)
CASES = [(1, 128, 8, True, 1), (5, 60, 4, False, 1), (33, 8, 2, True, 1), (3, 7, 3, True, 2), (0, 16, 2, True, 1),
         (4, 6, 6, False, 1)]

_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, json.loads(sys.argv[1])["tests"])
from test_moe_topk_kernel import CASES, check
print(json.dumps({"errors": [check(*case, device="cpu") for case in CASES]}))
"""


def check(tokens, experts, top_k, renormalize, stride, device):
    """The largest |difference| of the weights, after checking the ids are
    the same and that each choice was counted once in the expert histogram."""
    from radixserve.layers.moe import topk
    from radixserve.layers.moe.triton_ops.topk import fused_topk_softmax

    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    logits = (torch.randn(tokens, experts * stride, generator=gen) * 3)[:, ::stride].to(device)
    logits[:, 0] = logits[:, 1] if tokens and experts > 2 else logits[:, 0]  # a tie: the lower index first
    before = torch.arange(experts, dtype=torch.int64) * 7  # the histogram is added to, not written
    counts = before.to(device, copy=True)
    weights, ids = fused_topk_softmax(logits, top_k, renormalize, counts)
    assert torch.equal(counts.cpu() - before, torch.bincount(ids.long().cpu().reshape(-1), minlength=experts))
    probs = torch.softmax(logits.float().cpu(), dim=-1)
    ref_w, ref_ids = probs.topk(top_k, dim=-1)
    if renormalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (tokens, top_k)
    # ties: the same set of probabilities either way; the kernel takes the lower index first
    assert torch.equal(probs.gather(1, ids.long().cpu()), probs.gather(1, ref_ids))
    first = ids.long().cpu()[:, :2] if tokens and experts > 2 else None
    if first is not None and top_k >= 2:
        both = (first == 0).any(1) & (first == 1).any(1)
        assert all(row.tolist() == [0, 1] for row in first[both])
    return float((weights.cpu() - ref_w).abs().max()) if tokens else 0.0


def test_fused_routing_in_the_interpreter():
    result = run_interpreted(_SCRIPT, {"tests": os.path.dirname(__file__)})
    assert max(result["errors"]) < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_routing_on_cuda_and_select_experts_takes_it():
    from radixserve.layers.moe.topk import select_experts

    for case in CASES:
        assert check(*case, device="cuda") < 1e-6
    logits = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(64, dtype=torch.int64, device="cuda")
    weights, ids = select_experts(logits, 8, True, counts)
    assert ids.dtype == torch.int32 and torch.allclose(weights.sum(-1), torch.ones(4, device="cuda"))
    assert torch.equal(counts, torch.bincount(ids.long().reshape(-1), minlength=64))


def test_the_histogram_add_compiles_to_one_reduction_for_hopper():
    """With ``counts`` the routing kernel adds to the histogram with one
    relaxed atomic add (no launch of its own), and without it carries none.
    Triton 3.9 writes it as a ``red`` (no value returned), Triton 3.6 as an
    ``atom`` whose value nothing reads. Triton compiles for an NVIDIA target
    on any machine whose wheel has the NVIDIA backend."""
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixserve.layers.moe.triton_ops.topk import _topk_softmax_kernel

    signature = {"Logits": "*bf16", "Weights": "*fp32", "Ids": "*i32", "Counts": "*i64", "num_experts": "i32",
                 "stride_l": "i32", **dict.fromkeys(("TOP_K", "K_PAD", "E_PAD", "RENORMALIZE", "COUNT"), "constexpr")}
    adds = {}
    for count in (True, False):
        constexprs = {"TOP_K": 8, "K_PAD": 8, "E_PAD": 128, "RENORMALIZE": True, "COUNT": count}
        try:
            source = ASTSource(fn=_topk_softmax_kernel, signature=signature, constexprs=constexprs)
            ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        except Exception as exc:  # noqa: BLE001 - no NVIDIA backend or ptxas, or an older compile API
            pytest.skip(f"this Triton cannot compile for sm_90 here: {exc}")
        adds[count] = [line.strip() for line in ptx.splitlines() if ".global" in line and ".add." in line]
    assert adds[False] == []
    assert len(adds[True]) == 1 and "relaxed" in adds[True][0], adds[True]
    assert re.search(r"\b(red|atom)\.global\.", adds[True][0]), adds[True]
