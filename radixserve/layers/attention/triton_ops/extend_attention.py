"""Extend (prefill) attention over a cached, paged prefix: a flash-attention
style kernel.

Grid ``(request, head, query block)``. Request ``b``'s new tokens are rows
``extend_start[b] .. + extend_len[b]`` of q/k/v; new token ``i`` sits at
position ``prefix_len[b] + i`` and sees::

    keys:  0 ........ prefix_len-1 | prefix_len ... prefix_len+i
           cached prefix, gathered  | new tokens, contiguous rows of k/v,
           via req_to_token (paged) | causal

A program loads one block of ``BLOCK_M`` queries of one head, walks the prefix
in ``BLOCK_N`` blocks (slot indices from ``req_to_token``), then the new keys
up to the block's last query, keeping the softmax running max and sum in fp32.
Query blocks past a request's end exit at once. Works for ``prefix_len == 0``
and for ``extend_len == 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.decode_attention import dot_dtype
from radixserve.layers.attention.triton_ops.launch import CachedLaunch
from radixserve.mem_cache.memory_pool import FP8_DTYPES

LOG2E = 1.4426950408889634


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold scores ``s [M, N]`` (base-2 logits, -inf where masked) and values
    ``v [N, DV]`` into the running max ``m_i``, sum ``l_i`` and output ``acc``."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, K_base, V_base, rows, offs_n, offs_m, n_end, kv_head,
    stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, v_scale,
    offs_d, d_mask, offs_dv, dv_mask,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr, KV_FP8: tl.constexpr,
):
    """One key block: keys at ``rows`` (int64 ``[BLOCK_N]``) of the ``[rows,
    kv_heads, dim]`` buffers ``K_base``/``V_base``. ``MASKED``: keys at ``offs_n >= n_end`` are
    padding; ``CAUSAL``: key ``offs_n`` is visible to query ``offs_m`` only if
    ``offs_n <= offs_m``. Full blocks inside the range skip both. The dots run
    in ``q``'s dtype; ``KV_FP8``: the buffers are an fp8 pool, V scaled by
    ``v_scale`` (see decode_attention's kernel for why it is a runtime value)."""
    if MASKED:
        n_mask = offs_n < n_end
        k = tl.load(
            K_base + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=n_mask[None, :] & d_mask[:, None], other=0.0,
        )
        v = tl.load(
            V_base + rows[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
            mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
        )
    else:
        k = tl.load(K_base + rows[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None], mask=d_mask[:, None], other=0.0)
        v = tl.load(V_base + rows[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :], mask=dv_mask[None, :], other=0.0)
    s = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if MASKED:
        visible = (offs_n < n_end)[None, :]
        if CAUSAL:
            visible = visible & (offs_n[None, :] <= offs_m[:, None])
        s = tl.where(visible, s, float("-inf"))
    if KV_FP8:
        v = v.to(q.dtype) * tl.cast(v_scale, q.dtype)
    return _online_softmax_step(s, v.to(q.dtype), m_i, l_i, acc, DOT_PRECISION)


# one scalar per request and program, as decode_attention.PER_REQUEST_ARGS: no kernel per alignment
@triton.jit(do_not_specialize_on_alignment=("Req_pool_indices", "Prefix_lens", "Extend_lens", "Extend_start"))
def _extend_kernel(
    Q, K, V, O, K_buf, V_buf, Req_to_token, Req_pool_indices, Prefix_lens, Extend_lens, Extend_start,  # noqa: E741
    qk_scale,  # softmax scale * log2(e)
    v_scale,  # fp8 pools: V's scale (1.0: values are stored unscaled)
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_kbt, stride_kbh, stride_vbt, stride_vbh,
    stride_r2t,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, POOL_DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_block = tl.program_id(2)
    extend_len = tl.load(Extend_lens + b).to(tl.int32)
    if m_block * BLOCK_M < extend_len:
        prefix_len = tl.load(Prefix_lens + b).to(tl.int32)
        first = tl.load(Extend_start + b).to(tl.int64)  # row of the request's first new token
        kv_head = head // GROUP

        offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_mask = offs_dv < DV

        q = tl.load(
            Q + (first + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
            mask=m_mask[:, None] & d_mask[None, :], other=0.0,
        )
        q_pool = q.to(POOL_DOT_DTYPE)  # the prefix's dots: float16 over an fp8 pool, else q itself
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

        # 1. The cached prefix, gathered slot by slot; every query sees all of
        #    it, so only the last, partial block needs a mask.
        row_ptr = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_r2t
        prefix_full = prefix_len // BLOCK_N * BLOCK_N
        for n0 in range(0, prefix_full, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            slots = tl.load(row_ptr + offs_n).to(tl.int64)
            m_i, l_i, acc = _attend_block(
                q_pool, m_i, l_i, acc, K_buf, V_buf, slots, offs_n, offs_m, prefix_len, kv_head,
                stride_kbt, stride_kbh, stride_vbt, stride_vbh, qk_scale, v_scale, offs_d, d_mask, offs_dv, dv_mask,
                MASKED=False, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8,
            )
        for n0 in range(prefix_full, prefix_len, BLOCK_N):  # at most once
            offs_n = n0 + tl.arange(0, BLOCK_N)
            slots = tl.load(row_ptr + offs_n, mask=offs_n < prefix_len, other=0).to(tl.int64)
            m_i, l_i, acc = _attend_block(
                q_pool, m_i, l_i, acc, K_buf, V_buf, slots, offs_n, offs_m, prefix_len, kv_head,
                stride_kbt, stride_kbh, stride_vbt, stride_vbh, qk_scale, v_scale, offs_d, d_mask, offs_dv, dv_mask,
                MASKED=True, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, KV_FP8=KV_FP8,
            )

        # 2. The new tokens, causally. Keys before this query block are seen by
        #    all its queries (no mask); the diagonal blocks need the causal mask.
        block_start = m_block * BLOCK_M  # BLOCK_M is a multiple of BLOCK_N
        causal_end = tl.minimum(extend_len, block_start + BLOCK_M)
        for n0 in range(0, block_start, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            rows = first + offs_n
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, K, V, rows, offs_n, offs_m, extend_len, kv_head,
                stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, 1.0, offs_d, d_mask, offs_dv, dv_mask,
                MASKED=False, CAUSAL=False, DOT_PRECISION=DOT_PRECISION, KV_FP8=False,
            )
        for n0 in range(block_start, causal_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            rows = first + offs_n
            m_i, l_i, acc = _attend_block(
                q, m_i, l_i, acc, K, V, rows, offs_n, offs_m, extend_len, kv_head,
                stride_kt, stride_kh, stride_vt, stride_vh, qk_scale, 1.0, offs_d, d_mask, offs_dv, dv_mask,
                MASKED=True, CAUSAL=True, DOT_PRECISION=DOT_PRECISION, KV_FP8=False,
            )

        out = acc / l_i[:, None]
        tl.store(
            O + (first + offs_m)[:, None] * stride_ot + head * stride_oh + offs_dv[None, :],
            out.to(O.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :],
        )


# Launch parameters for 16-bit inputs; fp32 (debugging) takes smaller tiles to
# stay within shared memory. BLOCK_M must be a multiple of BLOCK_N.
EXTEND_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
EXTEND_CONFIG_FP32 = {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

_launch_extend = CachedLaunch(_extend_kernel)


def extend_attention_fwd(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], new tokens of all requests
    k: torch.Tensor,  # [num_tokens, kv_heads, head_dim]
    v: torch.Tensor,  # [num_tokens, kv_heads, v_head_dim]
    out: torch.Tensor,  # [num_tokens, num_heads, v_head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, v_head_dim]
    req_to_token: torch.Tensor,  # [rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs]
    prefix_lens: torch.Tensor,  # [bs]
    extend_lens: torch.Tensor,  # [bs]
    extend_start: torch.Tensor,  # [bs], row of each request's first new token
    max_extend_len: int,
    sm_scale: float,
) -> torch.Tensor:
    """Causal attention of every new token over its request's cached prefix
    (read from the pool through ``req_to_token``) and the new tokens before
    it (read from ``k``/``v``); writes and returns ``out``."""
    bs = int(req_pool_indices.shape[0])
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, v_head_dim = k.shape[1], v.shape[2]
    for t in (q, k, v, out, k_buffer, v_buffer, req_to_token):
        if t.stride(-1) != 1:
            raise ValueError(f"extend attention needs unit stride in the last dimension, got strides {t.stride()}")
    if bs == 0 or max_extend_len == 0:
        return out
    config = EXTEND_CONFIG_FP32 if q.dtype == torch.float32 else EXTEND_CONFIG
    if config["BLOCK_M"] % config["BLOCK_N"]:
        raise ValueError(f"extend attention: BLOCK_M must be a multiple of BLOCK_N, got {config}")
    grid = (bs, num_heads, triton.cdiv(max_extend_len, config["BLOCK_M"]))
    _launch_extend(grid,
        q, k, v, out, k_buffer, v_buffer, req_to_token, req_pool_indices, prefix_lens, extend_lens, extend_start,
        sm_scale * LOG2E, 1.0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // kv_heads,
        D=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DV=v_head_dim, BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        POOL_DOT_DTYPE=dot_dtype(q.dtype, k_buffer.dtype), KV_FP8=k_buffer.dtype in FP8_DTYPES,
        **config,
    )
    return out
