"""Routing: which experts each token goes to, and with what weight.

As HF computes it for Qwen2/Qwen3-MoE and Mixtral: a softmax over the router
logits in float32, the top k probabilities, renormalised over the chosen k
when the model says so (Qwen's ``norm_topk_prob``; Mixtral always).
"""

from __future__ import annotations

import torch

from radixserve.layers.triton_ops import use_triton


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                   counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int32 [T, k])`` from ``router_logits [T, E]``;
    ``counts`` (int64 [E], the layer's row of ``layer.ExpertLoad``) gains one per choice.

    Ties between equal probabilities go as ``torch.topk`` breaks them, as in HF.
    CUDA rows take one fused Triton launch (``triton_ops/topk.py``), the counting included."""
    if use_triton(router_logits):
        from radixserve.layers.moe.triton_ops.topk import MAX_EXPERTS, fused_topk_softmax

        if router_logits.shape[-1] <= MAX_EXPERTS:
            return fused_topk_softmax(router_logits, top_k, renormalize, counts)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = ids.to(torch.int32)
    if counts is not None:  # a 1 repeated by a stride of 0: no tensor of ones the size of the ids
        counts.index_add_(0, ids.reshape(-1), counts.new_ones(1).expand(ids.numel()))
    return weights, ids
