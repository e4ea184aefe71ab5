"""The experts in plain torch (the CPU path, and the reference of the fused kernel).

Tokens are grouped by expert: one argsort of the ``T * k`` choices, then for
each expert that has tokens one gate/up GEMM, SiLU-and-mul, one down GEMM,
the routing weight, and an ``index_add_`` into the token's row. Experts are
visited in increasing id, as HF does, so float32 sums come out in HF's order.
The grouping reads the per-expert counts on the host: fine on a CPU; the GPU
takes the fused kernel (``triton_ops``), which needs no such sync.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_forward_native(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """For each token, the sum over its k experts of ``weight * down(SiLU(gate) * up)``.

    ``hidden [T, H]``, ``w13 [E, 2I, H]`` (gate rows, then up rows), ``w2 [E, H, I]``,
    ``topk_weights float32 [T, k]``, ``topk_ids int32 [T, k]`` (local expert
    ids; -1 for a choice another rank computes, skipped). Returns ``[T, H]``
    in ``hidden``'s dtype: zero rows for tokens with no expert here."""
    out = torch.zeros_like(hidden)
    if hidden.shape[0] == 0:
        return out
    k = topk_ids.shape[1]
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat_ids, stable=True)
    counts = torch.bincount(flat_ids + 1, minlength=w13.shape[0] + 1).tolist()  # slot 0: the skipped (-1) choices
    flat_weights = topk_weights.reshape(-1)
    start = counts[0]
    for expert, n in enumerate(counts[1:]):
        if n == 0:
            continue
        choice = order[start : start + n]
        start += n
        tokens = choice // k
        gate, up = F.linear(hidden[tokens], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert])
        out.index_add_(0, tokens, y * flat_weights[choice, None].to(y.dtype))
    return out


def moe_forward_reference(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """The same, token by token and choice by choice: slow, obviously right (tests)."""
    out = torch.zeros_like(hidden)
    for t in range(hidden.shape[0]):
        for w, e in zip(topk_weights[t].tolist(), topk_ids[t].tolist()):
            if e < 0:
                continue
            gate, up = (w13[e] @ hidden[t]).chunk(2)
            out[t] += w * (w2[e] @ (F.silu(gate) * up))
    return out
