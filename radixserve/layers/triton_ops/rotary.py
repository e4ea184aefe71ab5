"""Neox RoPE of q and k in one launch, in the order of
:meth:`radixserve.layers.rotary_embedding.RotaryEmbedding.forward_native`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(X, Out, cos, sin, heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rotates the pairs ``(x[i], x[i + D/2])`` of every head of one token."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HEAD_DIM // 2)
    offs = h * HEAD_DIM + d
    x1 = tl.load(X + offs, mask=mask).to(tl.float32)
    x2 = tl.load(X + offs + HEAD_DIM // 2, mask=mask).to(tl.float32)
    tl.store(Out + offs, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(Out + offs + HEAD_DIM // 2, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QOut, KOut, Cache, Positions,
    stride_qt, stride_kt, stride_cache, q_heads, k_heads,
    HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM // 2
    # cos/sin are rounded to q's dtype first, as HF casts them.
    row = Cache + pos * stride_cache + d
    cos = tl.load(row, mask=d_mask).to(QOut.dtype.element_ty).to(tl.float32)[None, :]
    sin = tl.load(row + HEAD_DIM // 2, mask=d_mask).to(QOut.dtype.element_ty).to(tl.float32)[None, :]
    _rotate_heads(Q + t * stride_qt, QOut + t * q_heads * HEAD_DIM, cos, sin, q_heads, HEAD_DIM, BLOCK_HQ, BLOCK_D)
    _rotate_heads(K + t * stride_kt, KOut + t * k_heads * HEAD_DIM, cos, sin, k_heads, HEAD_DIM, BLOCK_HK, BLOCK_D)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated, contiguous copies of ``q`` ``[T, H*D]`` and ``k`` ``[T, Hkv*D]``
    for ``positions`` ``[T]``; the input rows may be strided (views of the qkv
    output). ``cos_sin_cache`` is ``[max_position, D]``: the cos, then the sin."""
    tokens = q.shape[0]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens:
        q, k = q.reshape(tokens, -1), k.reshape(tokens, -1)  # views for [T, H*D] and [T, H, D] rows
        q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
        _rope_kernel[(tokens,)](
            q, k, q_out, k_out, cos_sin_cache, positions,
            q.stride(0), k.stride(0), cos_sin_cache.stride(0), q_heads, k_heads,
            HEAD_DIM=head_dim, BLOCK_HQ=triton.next_power_of_2(q_heads), BLOCK_HK=triton.next_power_of_2(k_heads),
            BLOCK_D=triton.next_power_of_2(head_dim // 2),
        )
    return q_out, k_out
