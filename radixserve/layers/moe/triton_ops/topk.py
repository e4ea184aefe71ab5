"""Routing in one launch: the softmax over a row's router logits in float32,
its top k, renormalised over the k when asked (``topk.select_experts``'s
torch code, which takes four or five launches: the softmax, ``topk``, the sum
and the division, the cast of the ids). At the batch sizes of a decode step
the launches, not the arithmetic, are the routing's cost.

One program per token row: the row's E logits are loaded once, the softmax
computed in registers, then the k largest taken one at a time (the largest
left, its lowest index on ties, as ``torch.topk`` on a CPU picks; then masked
out). E up to a few hundred (a row fits in one block). With ``counts``, the
program also adds its row's choices to the expert-load histogram
(``layer.ExpertLoad``), atomically: no launch of its own."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_EXPERTS = 1024  # the most experts a row may have (one row in one Triton block)


@triton.jit
def _topk_softmax_kernel(Logits, Weights, Ids, Counts, num_experts, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    valid = cols < num_experts
    x = tl.load(Logits + row * stride_l + cols, mask=valid, other=-float("inf")).to(tl.float32)
    x = x - tl.max(x, axis=0)
    e = tl.where(valid, tl.exp(x), 0.0)
    probs = e / tl.sum(e, axis=0)
    left = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks a taken or missing expert
    slots = tl.arange(0, K_PAD)
    weights = tl.zeros([K_PAD], dtype=tl.float32)  # the choices, kept in registers until the one store
    ids = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        idx = tl.min(tl.where(left == best, cols, E_PAD), axis=0)  # the lowest index among equal ones
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx, ids)
        left = tl.where(cols == idx, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)  # the padding slots hold 0
    tl.store(Weights + row * TOP_K + slots, weights, mask=slots < TOP_K)
    tl.store(Ids + row * TOP_K + slots, ids, mask=slots < TOP_K)
    if COUNT:
        tl.atomic_add(Counts + ids, tl.full([K_PAD], 1, tl.int64), mask=slots < TOP_K, sem="relaxed")


def fused_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int32 [T, k])`` from ``router_logits [T, E]``,
    as ``topk.select_experts`` computes them; ``counts`` (int64 [E]) gains one per choice."""
    tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {num_experts} experts: need 0 < top_k <= experts <= {MAX_EXPERTS}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(tokens,)](logits, weights, ids, ids if counts is None else counts, num_experts,
                                        logits.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                        E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                        COUNT=counts is not None)
    return weights, ids
