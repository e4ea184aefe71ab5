"""Neox RoPE of q and k in one launch, in the order of
:meth:`radixserve.layers.rotary_embedding.RotaryEmbedding.forward_native`;
optionally after Qwen3's per-head RMSNorm of q and k, in the same launch and
with the roundings of the norm kernel (``norm.py``) followed by this one;
optionally storing the rotated K and the V rows into the KV pool too, with
the roundings of the store kernel (``attention/triton_ops/kv_store.py``), so
a forward step has no store launch per layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.kv_store import pool_limit, to_pool
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait
from radixserve.model_executor.forward_batch_info import KVStore


@triton.jit
def _rotate_heads(X, Out, cos, sin, heads, W, eps, Buf,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, NORM: tl.constexpr,
                  STORE: tl.constexpr = False, LIMIT: tl.constexpr = 0.0):
    """Rotates the pairs ``(x[i], x[i + D/2])`` of every head of one token;
    with NORM, each head is first RMS-normed and scaled by ``W`` [D]; with
    STORE, the rotated heads (rounded to ``Out``'s dtype first) also go to
    ``Buf``, a pool slot's row."""
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
    y1 = (x1 * cos - x2 * sin).to(Out.dtype.element_ty)
    y2 = (x2 * cos + x1 * sin).to(Out.dtype.element_ty)
    tl.store(Out + offs, y1, mask=mask)
    tl.store(Out + offs + HEAD_DIM // 2, y2, mask=mask)
    if STORE:
        tl.store(Buf + offs, to_pool(y1, Buf, LIMIT), mask=mask)
        tl.store(Buf + offs + HEAD_DIM // 2, to_pool(y2, Buf, LIMIT), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QOut, KOut, Cache, Positions, QW, KW, V, KBuf, VBuf, Loc,
    stride_qt, stride_kt, stride_cache, stride_vt, stride_kb, stride_vb, q_heads, k_heads, eps,
    HEAD_DIM: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
    NORM: tl.constexpr, STORE: tl.constexpr = False, V_ROW: tl.constexpr = 1, BLOCK_V: tl.constexpr = 1,
    LIMIT: tl.constexpr = 0.0, USE_PDL: tl.constexpr = False,
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
    _rotate_heads(Q + t * stride_qt, QOut + t * q_heads * HEAD_DIM, cos, sin, q_heads, QW, eps, QOut, HEAD_DIM,
                  BLOCK_HQ, BLOCK_D, NORM)
    slot = 0
    if STORE:
        slot = tl.load(Loc + t).to(tl.int64)
    _rotate_heads(K + t * stride_kt, KOut + t * k_heads * HEAD_DIM, cos, sin, k_heads, KW, eps,
                  KBuf + slot * stride_kb, HEAD_DIM, BLOCK_HK, BLOCK_D, NORM, STORE, LIMIT)
    if STORE:
        offs_v = tl.arange(0, BLOCK_V)
        v = tl.load(V + t * stride_vt + offs_v, mask=offs_v < V_ROW)
        tl.store(VBuf + slot * stride_vb + offs_v, to_pool(v, VBuf, LIMIT), mask=offs_v < V_ROW)


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor, head_dim: int,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None, eps: float = 0.0,
    v: torch.Tensor | None = None, kv_store: KVStore | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated, contiguous copies of ``q`` ``[T, H*D]`` and ``k`` ``[T, Hkv*D]``
    for ``positions`` ``[T]``; the input rows may be strided (views of the qkv
    output). ``cos_sin_cache`` is ``[max_position, D]``: the cos, then the sin.
    ``norm_weights`` (q's and k's ``[D]``): RMSNorm each head first (``eps``),
    the outputs then in the dtype the norm gives (torch's promotion).
    ``kv_store``: also store the rotated k and ``v`` ``[T, Hkv*Dv]`` (rows
    with unit stride along them) at its slots, as ``store_kv`` would."""
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
        if kv_store is None:
            k_buf, v_buf, loc, v, store = k_out, k_out, positions, k, {}  # stand-ins the kernel ignores
        else:
            (k_buf, v_buf, loc), v = kv_store, v.reshape(tokens, -1)
            store = dict(STORE=True, V_ROW=v.shape[1], BLOCK_V=triton.next_power_of_2(v.shape[1]),
                         LIMIT=pool_limit(k_buf.dtype))
        _rope_kernel[(tokens,)](
            q, k, q_out, k_out, cos_sin_cache, positions, qw, kw, v, k_buf, v_buf, loc,
            q.stride(0), k.stride(0), cos_sin_cache.stride(0), v.stride(0), k_buf.stride(0), v_buf.stride(0),
            q_heads, k_heads, eps,
            HEAD_DIM=head_dim, BLOCK_HQ=triton.next_power_of_2(q_heads), BLOCK_HK=triton.next_power_of_2(k_heads),
            BLOCK_D=triton.next_power_of_2(head_dim // 2), NORM=norm_weights is not None, **store,
            **pdl(q.device, tokens),
        )
    return q_out, k_out
