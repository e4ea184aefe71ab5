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

# fused_router_topk: (tokens, experts, hidden, top_k, renormalize)
ROUTER_CASES = [(1, 128, 256, 8, True), (3, 8, 96, 2, True), (8, 60, 200, 4, False), (0, 16, 64, 2, True),
                (5, 7, 48, 7, False)]

_SCRIPT = """
import json, sys
import torch
sys.path.insert(0, json.loads(sys.argv[1])["tests"])
from test_moe_topk_kernel import CASES, ROUTER_CASES, check, check_router
print(json.dumps({"errors": [check(*case, device="cpu") for case in CASES],
                  "router": [check_router(*case, device="cpu") for case in ROUTER_CASES]}))
"""


def check(tokens, experts, top_k, renormalize, stride, device):
    """The largest |difference| of the weights, after checking the ids are
    the same and that each choice was counted once in the expert histogram."""
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


def check_router(tokens, experts, hidden, top_k, renormalize, device, dtype=torch.float32):
    """``fused_router_topk`` against the router's GEMM then ``fused_topk_softmax``
    (launched twice, so the ticket is seen back at zero): the logits in the
    model's dtype as the GEMM rounds them, the same ids where a row's
    probabilities are apart, each choice counted. Returns the largest
    |difference| of the weights."""
    from radixserve.layers.moe.triton_ops.topk import fused_router_topk, fused_topk_softmax

    gen = torch.Generator().manual_seed(tokens * 1000 + experts)
    x = torch.randn(tokens, hidden, generator=gen).to(device, dtype)
    w = (torch.randn(experts, hidden, generator=gen) / hidden**0.5).to(device, dtype)
    ticket = torch.zeros(1, dtype=torch.int32, device=device)
    counts = torch.zeros(experts, dtype=torch.int64, device=device)
    ref_w, ref_ids = fused_topk_softmax(torch.nn.functional.linear(x, w), top_k, renormalize)
    worst = 0.0
    for _ in range(2):
        weights, ids = fused_router_topk(x, w, top_k, renormalize, ticket, counts)
        assert int(ticket.item()) == 0 and ids.shape == (tokens, top_k) and ids.dtype == torch.int32
        assert torch.equal(ids.cpu(), ref_ids.cpu())
        worst = max(worst, float((weights - ref_w).abs().max()) if tokens else 0.0)
    assert torch.equal(counts.cpu(), 2 * torch.bincount(ids.long().cpu().reshape(-1), minlength=experts))
    return worst


def test_fused_routing_in_the_interpreter():
    result = run_interpreted(_SCRIPT, {"tests": os.path.dirname(__file__)})
    assert max(result["errors"]) < 1e-6
    assert max(result["router"]) < 1e-5


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fused_router_on_cuda_under_a_graph_and_the_router_takes_it():
    """The router's GEMM and the routing in one launch, on CUDA in float32
    and bfloat16 (ids the same where the probabilities are apart), replayed in
    a CUDA graph (the ticket back at zero after each launch), and
    ``Router.select`` taking it up to ``MAX_FUSED_ROUTER_TOKENS`` rows."""
    from radixserve.layers.moe.layer import Router
    from radixserve.layers.moe.triton_ops.topk import (
        MAX_FUSED_ROUTER_TOKENS, fused_router_topk, fused_topk_softmax,
    )

    for case in ROUTER_CASES:
        assert check_router(*case, device="cuda") < 1e-5
    torch.manual_seed(0)
    router = Router(2048, 128).to("cuda", torch.bfloat16)
    router.weight.data.normal_(0, 0.05)
    apart_rows = 0
    for tokens in (1, MAX_FUSED_ROUTER_TOKENS, MAX_FUSED_ROUTER_TOKENS + 1):
        x = torch.randn(tokens, 2048, device="cuda", dtype=torch.bfloat16)
        weights, ids = router.select(x, 8, True)
        ref_w, ref_ids = fused_topk_softmax(router(x), 8, True)
        # where the 8th and 9th probabilities are apart, the same experts with the same weights (the order
        # within the 8 may differ where two are within the logits' rounding)
        ranked = torch.softmax(router(x).float(), -1).sort(-1, descending=True).values
        apart = ranked[:, 7] - ranked[:, 8] > 1e-3
        order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
        assert torch.equal(ids.gather(1, order)[apart], ref_ids.gather(1, ref_order)[apart])
        torch.testing.assert_close(weights.gather(1, order)[apart], ref_w.gather(1, ref_order)[apart],
                                   rtol=0.02, atol=1e-3)
        apart_rows += int(apart.sum())
    assert apart_rows >= 6  # most rows (the checks above are not vacuous)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    counts = torch.zeros(128, dtype=torch.int64, device="cuda")
    fused_router_topk(x, router.weight, 8, True, router.ticket, counts)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        weights, ids = fused_router_topk(x, router.weight, 8, True, router.ticket, counts)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        eager_w, eager_ids = fused_router_topk(x, router.weight, 8, True, router.ticket)
        assert torch.equal(ids, eager_ids) and torch.equal(weights, eager_w) and int(router.ticket.item()) == 0
    assert int(counts.sum()) == 4 * 4 * 8  # the warm-up and three replays (a capture runs nothing)


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
