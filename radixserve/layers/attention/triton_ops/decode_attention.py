"""Paged decode attention with split KV (flash-decoding), in two kernels.

Stage 1, grid ``(batch, kv_head, splits)``: one program takes one request,
all query heads of one KV group (so GQA heads share each K/V load) and one
contiguous chunk of the request's context. It gathers the chunk's K/V rows
through ``req_to_token`` block by block, keeps a running max and sum in fp32
(online softmax) and writes its partial output, already normalised, and its
log-sum-exp to scratch buffers.

Stage 2, grid ``(batch, head)``: merges a request's partial outputs, each
weighted by ``exp(lse_split - lse_total)``.

Split layout of one request of ``seq_len`` tokens and ``n`` splits::

    chunk = roundup(cdiv(seq_len, n), BLOCK_N)
    split s covers positions [s * chunk, min((s + 1) * chunk, seq_len))

Rounding to whole blocks can leave the last splits empty; they write
``lse = -inf`` and the merge gives them weight 0. ``n`` is a per-request
device tensor (``num_kv_splits``) and the grid's third axis ``S`` is a host
int that depends on the batch size alone (``splits_grid``), so a CUDA graph
captured for one batch size serves any sequence lengths. ``S`` shrinks as the
batch grows, so the scratch (``[bs, heads, S, dim]``) never needs more than
``max(bs * S)`` rows of splits (``scratch_splits``). Log-sum-exps are kept in
base 2 (``exp2``).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.launch import CachedLaunch
from radixserve.mem_cache.memory_pool import FP8_DTYPES

MAX_KV_SPLITS = 64  # splits per request at most
MIN_TOKENS_PER_SPLIT = 64  # a shorter chunk is not worth its own program
# Stage-1 launch: BLOCK_N context tokens per step inside a program. Chosen on
# an H200 by benchmarks/decode_attention_sweep.py (27 configs; W1's qwen3-0.6b
# at 64 and 256 requests and W2's llama-3.1-8b at 256: 3-10% faster than
# BLOCK_N 64). SMALL_BLOCK_N instead for heads wider than 128 or float32 (two
# stages of K and V tiles must fit in shared memory), and for batches with
# fewer (request, KV head) pairs than multiprocessors, whose programs come
# from splitting contexts: smaller blocks leave more splits non-empty.
STAGE1_CONFIG = {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
SMALL_BLOCK_N = 64
LOG2E = 1.4426950408889634
# Tensors of one value per request, each read as one scalar a program, so their alignment buys
# nothing; Triton would still compile a kernel per alignment. A mixed step passes its riders'
# rows as a slice of the batch's (int64 ``seq_lens[n:]`` is 16-byte aligned only for even n),
# and each new alignment compiled a kernel, for most of a second, while the server was serving
# (benchmarks/README.md, "Compiles while serving").
PER_REQUEST_ARGS = ("Req_pool_indices", "Seq_lens", "Num_kv_splits")


@triton.jit(do_not_specialize_on_alignment=PER_REQUEST_ARGS)
def _decode_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Num_kv_splits, Mid_o, Mid_lse,
    qk_scale,  # softmax scale * log2(e)
    v_scale,  # fp8 pools: V's scale (see KV_FP8)
    stride_qb, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.load(Num_kv_splits + b)
    if split < num_splits:
        seq_len = tl.load(Seq_lens + b).to(tl.int32)
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        start = split * chunk
        end = tl.minimum(start + chunk, seq_len)

        offs_g = tl.arange(0, BLOCK_H)
        heads = kv_head * GROUP + offs_g
        h_mask = offs_g < GROUP
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < D
        offs_dv = tl.arange(0, BLOCK_DV)
        dv_mask = offs_dv < DV

        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
            mask=h_mask[:, None] & d_mask[None, :], other=0.0,
        ).to(DOT_DTYPE)
        row_ptr = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_r2t
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(row_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
            k = tl.load(
                K_buf + slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
                mask=n_mask[None, :] & d_mask[:, None], other=0.0,
            )
            s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V_buf + slots[:, None] * stride_vt + kv_head * stride_vh + offs_dv[None, :],
                mask=n_mask[:, None] & dv_mask[None, :], other=0.0,
            )
            if KV_FP8:
                # The dot needs V transposed through shared memory. Scaled by a
                # runtime value, the tile is converted where it is loaded and
                # transposed as float16; a bare conversion Triton moves past the
                # transpose, which then reads the fp8 tile a byte at a time.
                v = v.to(DOT_DTYPE) * tl.cast(v_scale, DOT_DTYPE)
            acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
            m_i = m_new

        nonempty = end > start
        l_i = tl.where(nonempty, l_i, 1.0)
        out = acc / l_i[:, None]
        mid = Mid_o + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_dv[None, :]
        tl.store(mid, out, mask=h_mask[:, None] & dv_mask[None, :])
        lse = tl.where(nonempty, m_i + tl.log2(l_i), float("-inf"))
        tl.store(Mid_lse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=h_mask)


@triton.jit(do_not_specialize_on_alignment=PER_REQUEST_ARGS)
def _decode_merge_kernel(
    Mid_o, Mid_lse, Out, Num_kv_splits,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_POW2: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = tl.load(Num_kv_splits + b)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    lse = tl.load(Mid_lse + b * stride_ml_b + h * stride_ml_h + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    valid = lse > float("-inf")
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    w = tl.where(valid, tl.exp2(lse - lse_max), 0.0)
    o = tl.load(
        Mid_o + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_dv[None, :],
        mask=valid[:, None] & dv_mask[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=dv_mask)


_launch_split, _launch_merge = CachedLaunch(_decode_split_kernel), CachedLaunch(_decode_merge_kernel)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_grid(batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """The grid's split axis for a batch: enough programs for a few per
    multiprocessor, at most ``MAX_KV_SPLITS``. Depends on the batch size only,
    so that a CUDA graph of one batch size fits every batch of that size."""
    target = 4 * num_sms
    return max(1, min(MAX_KV_SPLITS, triton.cdiv(target, batch_size * num_kv_heads)))


def scratch_splits(max_batch_size: int, num_kv_heads: int, num_sms: int) -> int:
    """``max(bs * splits_grid(bs))`` over batches up to ``max_batch_size``: the
    partial-output rows (per head) that the scratch buffers must hold."""
    return max(bs * splits_grid(bs, num_kv_heads, num_sms) for bs in range(1, max_batch_size + 1))


def num_kv_splits_(out: torch.Tensor, seq_lens: torch.Tensor, max_splits: int) -> torch.Tensor:
    """Each request's split count, written into ``out`` (int32, on the device,
    no host sync): one split per ``MIN_TOKENS_PER_SPLIT`` tokens, 1 to ``max_splits``."""
    wanted = torch.div(seq_lens + (MIN_TOKENS_PER_SPLIT - 1), MIN_TOKENS_PER_SPLIT, rounding_mode="floor")
    return out.copy_(wanted.clamp_(1, max_splits))


def decode_attention_fwd(
    q: torch.Tensor,  # [bs, num_heads, head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, v_head_dim]
    out: torch.Tensor,  # [bs, num_heads, v_head_dim]
    req_to_token: torch.Tensor,  # [rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs], context length including the new token
    num_kv_splits: torch.Tensor,  # [bs] int32, from num_kv_splits_
    max_splits: int,  # the grid's split axis, from splits_grid; >= num_kv_splits
    mid_o: torch.Tensor,  # [bs, num_heads, >= max_splits, v_head_dim] float32 scratch
    mid_lse: torch.Tensor,  # [bs, num_heads, >= max_splits] float32 scratch
    sm_scale: float,
) -> torch.Tensor:
    """Attention of one new query token per request over its whole paged
    context; writes and returns ``out``. The new token's K/V must already be
    in the pool."""
    bs, num_heads, head_dim = q.shape
    kv_heads, v_head_dim = k_buffer.shape[1], v_buffer.shape[2]
    group = num_heads // kv_heads
    _check_last_dim_contiguous(q, k_buffer, v_buffer, out, req_to_token, mid_o, mid_lse)
    if mid_lse.shape[2] < max_splits or mid_o.shape[2] < max_splits:
        raise ValueError(f"decode scratch holds {mid_lse.shape[2]} splits, the grid has {max_splits}")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    config = dict(STAGE1_CONFIG)
    if max(head_dim, v_head_dim) > 128 or q.dtype == torch.float32 or bs * kv_heads < _num_sms(q.device):
        config["BLOCK_N"] = min(config["BLOCK_N"], SMALL_BLOCK_N)
    _launch_split((bs, kv_heads, max_splits),
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, num_kv_splits, mid_o, mid_lse,
        sm_scale * LOG2E, 1.0,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        D=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DV=v_head_dim, BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)),
        DOT_PRECISION=precision, DOT_DTYPE=dot_dtype(q.dtype, k_buffer.dtype), KV_FP8=k_buffer.dtype in FP8_DTYPES,
        **config,
    )
    _launch_merge((bs, num_heads),
        mid_o, mid_lse, out, num_kv_splits,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        DV=v_head_dim, BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)),
        SPLITS_POW2=triton.next_power_of_2(max_splits),
        num_warps=4 if v_head_dim >= 128 else 2,
    )
    return out


@functools.cache  # asked at every kernel launch
def dot_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> tl.dtype:
    """The dtype the attention dots run in: the query's, except over an fp8
    pool, where float16: fp8 converts to it in one instruction per pair (to
    bfloat16 it takes one more per element), both fp8 formats convert exactly,
    and it keeps more of the query's and the probabilities' bits than
    bfloat16 (a query beyond float16's range, 65,504, would not fit)."""
    if kv_dtype in FP8_DTYPES and q_dtype != torch.float32:
        return tl.float16
    return {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[q_dtype]


def _check_last_dim_contiguous(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"decode attention needs unit stride in the last dimension, got strides {t.stride()}")
