"""Routing: which experts each token goes to, and with what weight.

As HF computes it for Qwen2/Qwen3-MoE and Mixtral: a softmax over the router
logits in float32, the top k probabilities, renormalised over the chosen k
when the model says so (Qwen's ``norm_topk_prob``; Mixtral always).
"""

from __future__ import annotations

import torch

from radixserve.layers.triton_ops import use_triton


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int32 [T, k])`` from ``router_logits [T, E]``.

    Ties between equal probabilities go as ``torch.topk`` breaks them, as in HF.
    CUDA rows take one fused Triton launch (``triton_ops/topk.py``)."""
    if use_triton(router_logits):
        from radixserve.layers.moe.triton_ops.topk import MAX_EXPERTS, fused_topk_softmax

        if router_logits.shape[-1] <= MAX_EXPERTS:
            return fused_topk_softmax(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
