"""Neox RoPE of q and k in one launch, in the order of
:meth:`radixserve.layers.rotary_embedding.RotaryEmbedding.forward_native`;
optionally after Qwen3's per-head RMSNorm of q and k, in the same launch and
with the roundings of the norm kernel (``norm.py``) followed by this one."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait


@triton.jit
def _rotate_heads(X, Out, cos, sin, heads, W, eps,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr):
    """Rotates the pairs ``(x[i], x[i + D/2])`` of every head of one token;
    with NORM, each head is first RMS-normed and scaled by ``W`` [D]."""
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < HEAD_DIM // 2)
    offs = h * HEAD_DIM + d
    x1 = tl.load(X + offs, mask=mask, other=0.0)
    x2 = tl.load(X + offs + HEAD_DIM // 2, mask=mask, other=0.0)
    if NORM:
        # As the norm kernel: x * rsqrt(mean(x^2) + eps) in float32, rounded to
        # x's dtype, times the weight, rounded to the output's dtype.
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(f1 * f1, axis=1) + tl.sum(f2 * f2, axis=1)) / HEAD_DIM + eps)[:, None]
        w1 = tl.load(W + d, mask=d < HEAD_DIM // 2, other=0.0).to(tl.float32)
        w2 = tl.load(W + d + HEAD_DIM // 2, mask=d < HEAD_DIM // 2, other=0.0).to(tl.float32)
        x1 = ((f1 * rstd).to(x1.dtype).to(tl.float32) * w1).to(Out.dtype.element_ty)
        x2 = ((f2 * rstd).to(x2.dtype).to(tl.float32) * w2).to(Out.dtype.element_ty)
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(Out + offs, (x1 * cos - x2 * sin).to(Out.dtype.element_ty), mask=mask)
    tl.store(Out + offs + HEAD_DIM // 2, (x2 * cos + x1 * sin).to(Out.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QOut, KOut, Cache, Positions, QW, KW,
    stride_qt, stride_kt, stride_cache, q_heads, k_heads, eps,
    HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM // 2
    # cos/sin are rounded to q's dtype first, as HF casts them.
    row = Cache + pos * stride_cache + d
    cos = tl.load(row, mask=d_mask).to(QOut.dtype.element_ty).to(tl.float32)[None, :]
    sin = tl.load(row + HEAD_DIM // 2, mask=d_mask).to(QOut.dtype.element_ty).to(tl.float32)[None, :]
    _rotate_heads(Q + t * stride_qt, QOut + t * q_heads * HEAD_DIM, cos, sin, q_heads, QW, eps, HEAD_DIM, BLOCK_HQ,
                  BLOCK_D, NORM)
    _rotate_heads(K + t * stride_kt, KOut + t * k_heads * HEAD_DIM, cos, sin, k_heads, KW, eps, HEAD_DIM, BLOCK_HK,
                  BLOCK_D, NORM)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated, contiguous copies of ``q`` ``[T, H*D]`` and ``k`` ``[T, Hkv*D]``
    for ``positions`` ``[T]``; the input rows may be strided (views of the qkv
    output). ``cos_sin_cache`` is ``[max_position, D]``: the cos, then the sin.
    ``norm_weights`` (q's and k's ``[D]``): RMSNorm each head first (``eps``),
    the outputs then in the dtype the norm gives (torch's promotion)."""
    tokens = q.shape[0]
    q_dtype, k_dtype = q.dtype, k.dtype
    if norm_weights is not None:
        q_dtype, k_dtype = (torch.promote_types(w.dtype, x.dtype) for w, x in zip(norm_weights, (q, k)))
    q_out = torch.empty(q.shape, dtype=q_dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k_dtype, device=k.device)
    if tokens:
        q, k = q.reshape(tokens, -1), k.reshape(tokens, -1)  # views for [T, H*D] and [T, H, D] rows
        q_heads, k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
        qw, kw = (q, k) if norm_weights is None else norm_weights  # stand-ins the kernel ignores without a norm
        _rope_kernel[(tokens,)](
            q, k, q_out, k_out, cos_sin_cache, positions, qw, kw,
            q.stride(0), k.stride(0), cos_sin_cache.stride(0), q_heads, k_heads, eps,
            HEAD_DIM=head_dim, BLOCK_HQ=triton.next_power_of_2(q_heads), BLOCK_HK=triton.next_power_of_2(k_heads),
            BLOCK_D=triton.next_power_of_2(head_dim // 2), NORM=norm_weights is not None, **pdl(q.device, tokens),
        )
    return q_out, k_out
