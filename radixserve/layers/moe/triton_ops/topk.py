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
(``layer.ExpertLoad``), atomically: no launch of its own.

At a decode step of a few tokens the router's GEMM (a ``[tokens, hidden]``
by ``[experts, hidden]`` product: 0.5 MB of weight for qwen3-30b-a3b) is a
launch of its own that reads too little to fill the GPU, then the routing
is another. :func:`fused_router_topk` does both in one launch: each program
multiplies the rows by a block of the router's rows (the weight tile read
once for every token row), rounds the logits to the model's dtype as the
GEMM's output would be and stores them; the program that finishes last
(a ticket taken with an acquire-release atomic add, then reset for the
next launch) takes every row's softmax and top k as the kernel above does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.tile import rows_product

MAX_EXPERTS = 1024  # the most experts a row may have (one row in one Triton block)
MAX_FUSED_ROUTER_TOKENS = 8  # fused_router_topk takes up to this many token rows


@triton.jit
def _topk_rows(x, valid, Weights, Ids, Counts, rows, row_ok, R: tl.constexpr, TOP_K: tl.constexpr,
               K_PAD: tl.constexpr, E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr):
    """Rows ``x`` ``[R, E_PAD]`` of logits (float32, ``valid`` masks the
    experts that exist): each row's softmax, its top k stored at
    ``Weights`` / ``Ids`` row ``rows``, and its choices added to ``Counts``."""
    cols = tl.arange(0, E_PAD)[None, :]
    x = tl.where(valid, x, -float("inf"))
    x = x - tl.max(x, axis=1)[:, None]
    e = tl.where(valid, tl.exp(x), 0.0)
    probs = e / tl.sum(e, axis=1)[:, None]
    left = tl.where(valid, probs, -1.0)  # probabilities are >= 0: -1 marks a taken or missing expert
    slots = tl.arange(0, K_PAD)[None, :]
    weights = tl.zeros([R, K_PAD], dtype=tl.float32)  # the choices, kept in registers until the one store
    ids = tl.zeros([R, K_PAD], dtype=tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(left, axis=1)[:, None]
        idx = tl.min(tl.where(left == best, cols, E_PAD), axis=1)[:, None]  # the lowest index among equal ones
        weights = tl.where(slots == j, best, weights)
        ids = tl.where(slots == j, idx, ids)
        left = tl.where(cols == idx, -1.0, left)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=1)[:, None]  # the padding slots hold 0
    out = rows[:, None] * TOP_K + slots
    mask = row_ok[:, None] & (slots < TOP_K)
    tl.store(Weights + out, weights, mask=mask)
    tl.store(Ids + out, ids, mask=mask)
    if COUNT:
        tl.atomic_add(Counts + ids, tl.full(ids.shape, 1, tl.int64), mask=mask, sem="relaxed")


@triton.jit
def _topk_softmax_kernel(Logits, Weights, Ids, Counts, num_experts, stride_l, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                         E_PAD: tl.constexpr, RENORMALIZE: tl.constexpr, COUNT: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, E_PAD)[None, :]
    valid = cols < num_experts
    x = tl.load(Logits + row * stride_l + cols, mask=valid).to(tl.float32)
    rows = tl.full([1], row, tl.int32)
    _topk_rows(x, valid, Weights, Ids, Counts, rows, rows >= 0, 1, TOP_K, K_PAD, E_PAD, RENORMALIZE, COUNT)


@triton.jit
def _router_topk_kernel(X, W, Logits, Ticket, Weights, Ids, Counts, tokens, num_experts, hidden, stride_x, stride_w,
                        TOP_K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, RENORMALIZE: tl.constexpr,
                        COUNT: tl.constexpr):
    """Grid ``(cdiv(num_experts, BLOCK_E),)``: program ``p`` computes the
    logits of experts ``[p * BLOCK_E, (p + 1) * BLOCK_E)`` for every token
    row; the last program to finish routes every row."""
    experts = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    e_ok = experts < num_experts
    t = tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    acc = tl.zeros([BLOCK_E, BLOCK_T], dtype=tl.float32)  # logits transposed: experts, then token rows
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        h_ok = h < hidden
        w = tl.load(W + experts[:, None] * stride_w + h[None, :], mask=e_ok[:, None] & h_ok[None, :], other=0.0)
        acc = rows_product(acc, w, X + h, stride_x, h_ok, tokens, t, BLOCK_T)  # the tile read once for every row
    logits = Logits + t[None, :] * num_experts + experts[:, None]
    tl.store(logits, acc.to(Logits.dtype.element_ty), mask=e_ok[:, None] & t_ok[None, :])
    # release: the logits above are visible to whichever program sees the last ticket (acquire)
    done = tl.atomic_add(Ticket, 1, sem="acq_rel")
    if done == tl.num_programs(0) - 1:
        tl.store(Ticket, 0)  # the next launch (a graph's replay) starts from 0
        cols = tl.arange(0, E_PAD)[None, :]
        valid = (t[:, None] >= 0) & (cols < num_experts)  # padding rows route zeros, stored nowhere
        x = tl.load(Logits + t[:, None] * num_experts + cols, mask=t_ok[:, None] & valid, other=0.0,
                    cache_modifier=".cg").to(tl.float32)
        _topk_rows(x, valid, Weights, Ids, Counts, t, t_ok, BLOCK_T, TOP_K, K_PAD, E_PAD, RENORMALIZE, COUNT)


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 0 < top_k <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"top_k {top_k} of {num_experts} experts: need 0 < top_k <= experts <= {MAX_EXPERTS}")


def fused_topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                       counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(topk_weights float32 [T, k], topk_ids int32 [T, k])`` from ``router_logits [T, E]``,
    as ``topk.select_experts`` computes them; ``counts`` (int64 [E]) gains one per choice."""
    tokens, num_experts = router_logits.shape
    _check_top_k(top_k, num_experts)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if tokens:
        logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
        _topk_softmax_kernel[(tokens,)](logits, weights, ids, ids if counts is None else counts, num_experts,
                                        logits.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                                        E_PAD=triton.next_power_of_2(num_experts), RENORMALIZE=renormalize,
                                        COUNT=counts is not None)
    return weights, ids


def router_blocks(num_experts: int) -> int:
    """Experts a program of :func:`fused_router_topk` takes: about 128
    programs of one warp each, so the router's weight is read by most SMs at
    once and the last program's softmax and top k reduce within one warp."""
    return max(1, min(16, triton.next_power_of_2(triton.cdiv(num_experts, 128))))


def fused_router_topk(hidden: torch.Tensor, router_weight: torch.Tensor, top_k: int, renormalize: bool,
                      ticket: torch.Tensor, counts: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fused_topk_softmax` of ``F.linear(hidden, router_weight)``
    (``hidden [T, H]``, T at most :data:`MAX_FUSED_ROUTER_TOKENS`; the
    router ``[E, H]`` in the same dtype, unit stride along H) in one launch.
    ``ticket``: one int32 zero on the device, this launch's counter of
    finished programs (back at zero when it returns, so a CUDA graph may
    replay it)."""
    tokens, hidden_size = hidden.shape
    num_experts = router_weight.shape[0]
    _check_top_k(top_k, num_experts)
    if tokens > MAX_FUSED_ROUTER_TOKENS or router_weight.shape[1] != hidden_size:
        raise ValueError(f"fused_router_topk takes up to {MAX_FUSED_ROUTER_TOKENS} rows of the router's "
                         f"{router_weight.shape[1]} columns, got {tuple(hidden.shape)}")
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int32, device=hidden.device)
    if tokens:
        x = hidden if hidden.stride(1) == 1 else hidden.contiguous()
        logits = torch.empty(tokens, num_experts, dtype=hidden.dtype, device=hidden.device)
        block_e = router_blocks(num_experts)
        _router_topk_kernel[(triton.cdiv(num_experts, block_e),)](
            x, router_weight, logits, ticket, weights, ids, ids if counts is None else counts, tokens, num_experts,
            hidden_size, x.stride(0), router_weight.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
            E_PAD=triton.next_power_of_2(num_experts), BLOCK_T=triton.next_power_of_2(tokens), BLOCK_E=block_e,
            BLOCK_H=min(triton.next_power_of_2(hidden_size), 4096 // block_e), RENORMALIZE=renormalize,
            COUNT=counts is not None, num_warps=1)
    return weights, ids
