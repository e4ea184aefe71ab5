"""Paged decode attention with split KV (flash-decoding), in two kernels.

Stage 1, grid ``(batch, kv_head, splits)``: one program takes one request,
all query heads of one KV group (so GQA heads share each K/V load) and one
contiguous chunk of the request's context. It gathers the chunk's K/V rows
through ``req_to_token`` block by block, keeps a running max and sum in fp32
(online softmax) and writes its partial output, already normalised, and its
log-sum-exp to scratch buffers.

Stage 2, grid ``(batch, head)``: merges a request's partial outputs, each
weighted by ``exp(lse_split - lse_total)``. Where the grid has one split a
request (batches of ``4 * SMs / kv_heads`` requests or more), stage 1
writes the output itself (``WRITE_OUT``) and stage 2 does not run.

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

Prefix-grouped decode (``SharedPrefixes``, docs/prefix_grouped_decode.md)
adds a first kernel, ``_prefix_split_kernel``: each tile of a group's members
reads each chunk of the group's prefix once for all their query rows and
writes a partial per member and chunk; stage 1 then reads only each
request's own suffix (``HAS_START``), and the prefix's partials are merged
by stage 2, or by stage 1 itself when a request has one split
(``WRITE_OUT`` with ``HAS_START``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.launch import CachedLaunch
from radixserve.layers.triton_ops import num_sms, pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait
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
# Prefix-grouped decode: a group's prefix is cut into at most PREFIX_SPLITS
# chunks of at least MIN_PREFIX_SPLIT tokens, and each chunk is read once per
# tile of TILE_QUERY_ROWS query rows (members x the query heads of a KV head).
# Chosen on an H200 at W4's shape (benchmarks/grouped_decode_kernel.py --sweep:
# 16 groups of 16, 2,048-token prefixes; 4 splits of 512 and blocks of 32
# were the fastest of 18 configurations).
PREFIX_SPLITS = 4
MIN_PREFIX_SPLIT = 512
TILE_QUERY_ROWS = 64
PREFIX_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
# The suffixes of a grouped batch are short (a question and the tokens decoded
# so far): smaller blocks let more programs share a multiprocessor.
SUFFIX_CONFIG = {"BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
LOG2E = 1.4426950408889634
# Tensors of one value per request, each read as one scalar a program, so their alignment buys
# nothing; Triton would still compile a kernel per alignment. A mixed step passes its riders'
# rows as a slice of the batch's (int64 ``seq_lens[n:]`` is 16-byte aligned only for even n),
# and each new alignment compiled a kernel, for most of a second, while the server was serving
# (benchmarks/README.md, "Compiles while serving").
PER_REQUEST_ARGS = ("Req_pool_indices", "Seq_lens", "Starts", "Num_kv_splits")
MERGE_PER_REQUEST_ARGS = ("Num_kv_splits", "Prefix_lens")


@triton.jit
def _attend_span(
    q, m_i, l_i, acc, K_buf, V_buf, row_ptr, start, end, kv_head, qk_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, offs_dv, dv_mask,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Online softmax of the query rows ``q`` over positions ``[start, end)``
    of the ``req_to_token`` row at ``row_ptr`` (one KV head), ``BLOCK_N``
    tokens a step, carried in ``(m_i, l_i, acc)`` (base-2 running max, sum,
    unnormalised output) and returned."""
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
    return m_i, l_i, acc


@triton.jit(do_not_specialize_on_alignment=PER_REQUEST_ARGS)
def _decode_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Req_pool_indices, Seq_lens, Starts, Num_kv_splits, Mid_o, Mid_lse,
    Out, Mid_po, Mid_plse,  # WRITE_OUT: the output; with HAS_START, the shared prefixes' partials merged into it
    qk_scale,  # softmax scale * log2(e)
    v_scale,  # fp8 pools: V's scale (see KV_FP8)
    stride_qb, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ob, stride_oh,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr, HAS_START: tl.constexpr,
    WRITE_OUT: tl.constexpr, PREFIX_SPLITS: tl.constexpr, MIN_PREFIX_SPLIT: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    # The request's numbers in one round trip to memory, before the branch
    # that needs only the first (each a valid address for every program).
    num_splits = tl.load(Num_kv_splits + b)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    row_ptr = Req_to_token + tl.load(Req_pool_indices + b).to(tl.int64) * stride_r2t
    first = 0
    if HAS_START:  # prefix-grouped decode: only the request's own suffix
        first = tl.load(Starts + b).to(tl.int32)
    if split < num_splits:
        chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + split * chunk
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
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
        m_i, l_i, acc = _attend_span(
            q, m_i, l_i, acc, K_buf, V_buf, row_ptr, start, end, kv_head, qk_scale, v_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, offs_dv, dv_mask,
            BLOCK_N, DOT_PRECISION, DOT_DTYPE, KV_FP8,
        )
        pdl_trigger(USE_PDL)

        nonempty = end > start
        l_i = tl.where(nonempty, l_i, 1.0)
        out = acc / l_i[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(l_i), float("-inf"))
        if WRITE_OUT:
            # The request's only split (the grid has one): write the output, with no
            # merge kernel; a grouped request's prefix partials are merged first (its
            # suffix holds the new token, so its lse is finite).
            if HAS_START:
                prefix_len = tl.load(Starts + b).to(tl.int32)
                num_p = tl.where(prefix_len > 0,
                                 tl.minimum(tl.maximum(tl.cdiv(prefix_len, MIN_PREFIX_SPLIT), 1), PREFIX_SPLITS), 0)
                for p in tl.static_range(PREFIX_SPLITS):
                    p_mask = h_mask & (offs_g * 0 + p < num_p)  # a vector: the interpreter takes no scalar mask
                    plse = tl.load(Mid_plse + b * stride_pl_b + heads * stride_pl_h + p, mask=p_mask,
                                   other=float("-inf"))
                    po = tl.load(
                        Mid_po + b * stride_po_b + heads[:, None] * stride_po_h + p * stride_po_s + offs_dv[None, :],
                        mask=p_mask[:, None] & dv_mask[None, :], other=0.0,
                    )
                    m = tl.maximum(lse, plse)
                    w_own, w_p = tl.exp2(lse - m), tl.exp2(plse - m)
                    out = (out * w_own[:, None] + po * w_p[:, None]) / (w_own + w_p)[:, None]
                    lse = m + tl.log2(w_own + w_p)
            tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :],
                     out.to(Out.dtype.element_ty), mask=h_mask[:, None] & dv_mask[None, :])
        else:
            mid = Mid_o + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s + offs_dv[None, :]
            tl.store(mid, out, mask=h_mask[:, None] & dv_mask[None, :])
            tl.store(Mid_lse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=h_mask)


@triton.jit(do_not_specialize_on_alignment=MERGE_PER_REQUEST_ARGS)
def _decode_merge_kernel(
    Mid_o, Mid_lse, Out, Num_kv_splits,
    Prefix_lens, Mid_po, Mid_plse,  # prefix-grouped decode (HAS_PREFIX): the shared prefix's partials
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    stride_ob, stride_oh,
    DV: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS_POW2: tl.constexpr,
    HAS_PREFIX: tl.constexpr, PREFIX_SPLITS: tl.constexpr, PREFIX_SPLITS_POW2: tl.constexpr,
    MIN_PREFIX_SPLIT: tl.constexpr, USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_splits = tl.load(Num_kv_splits + b)
    offs_s = tl.arange(0, SPLITS_POW2)
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    lse = tl.load(Mid_lse + b * stride_ml_b + h * stride_ml_h + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    valid = lse > float("-inf")
    lse_max = tl.max(lse, 0)
    if HAS_PREFIX:  # a grouped request's prefix partials, as many as prefix_splits() gave its group
        prefix_len = tl.load(Prefix_lens + b).to(tl.int32)
        num_p = tl.where(prefix_len > 0,
                         tl.minimum(tl.maximum(tl.cdiv(prefix_len, MIN_PREFIX_SPLIT), 1), PREFIX_SPLITS), 0)
        offs_p = tl.arange(0, PREFIX_SPLITS_POW2)
        plse = tl.load(Mid_plse + b * stride_pl_b + h * stride_pl_h + offs_p, mask=offs_p < num_p,
                       other=float("-inf"))
        pvalid = plse > float("-inf")
        lse_max = tl.maximum(lse_max, tl.max(plse, 0))
    lse_max = tl.where(lse_max > float("-inf"), lse_max, 0.0)
    w = tl.where(valid, tl.exp2(lse - lse_max), 0.0)
    # Masked by the split count, not by the lse: issued with the lse's load.
    # An empty split stored zeros, which its weight 0 leaves out.
    o = tl.load(
        Mid_o + b * stride_mo_b + h * stride_mo_h + offs_s[:, None] * stride_mo_s + offs_dv[None, :],
        mask=(offs_s < num_splits)[:, None] & dv_mask[None, :], other=0.0,
    )
    total = tl.sum(w, 0)
    acc = tl.sum(o * w[:, None], 0)
    if HAS_PREFIX:
        pw = tl.where(pvalid, tl.exp2(plse - lse_max), 0.0)
        po = tl.load(
            Mid_po + b * stride_po_b + h * stride_po_h + offs_p[:, None] * stride_po_s + offs_dv[None, :],
            mask=pvalid[:, None] & dv_mask[None, :], other=0.0,
        )
        total += tl.sum(pw, 0)
        acc += tl.sum(po * pw[:, None], 0)
    out = acc / tl.where(total > 0, total, 1.0)
    pdl_trigger(USE_PDL)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_dv, out.to(Out.dtype.element_ty), mask=dv_mask)


@triton.jit
def _prefix_split_kernel(
    Q, K_buf, V_buf, Req_to_token, Tiles, Num_tiles, Members, Mid_po, Mid_plse,
    qk_scale, v_scale,
    stride_qb, stride_qh,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_r2t, stride_tiles,
    stride_po_b, stride_po_h, stride_po_s,
    stride_pl_b, stride_pl_h,
    GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
    PREFIX_SPLITS: tl.constexpr, MIN_PREFIX_SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_DTYPE: tl.constexpr, KV_FP8: tl.constexpr,
):
    """Grid ``(programs, kv_heads)``. Work item ``i`` is split ``i % PREFIX_SPLITS``
    of tile ``i // PREFIX_SPLITS``; each program takes items ``pid, pid +
    programs, ...`` below ``num_tiles * PREFIX_SPLITS`` (the count is on the
    device, so a CUDA graph serves any table). A tile is up to ``BLOCK_M //
    GROUP`` members of one group: their queries of this KV head, ``BLOCK_M``
    rows, against one read of a chunk of the group's prefix."""
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    items = tl.load(Num_tiles) * PREFIX_SPLITS
    offs_m = tl.arange(0, BLOCK_M)
    member = offs_m // GROUP
    heads = kv_head * GROUP + offs_m % GROUP
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < D
    offs_dv = tl.arange(0, BLOCK_DV)
    dv_mask = offs_dv < DV
    for item in range(pid, items, tl.num_programs(0)):
        tile = item // PREFIX_SPLITS
        split = item % PREFIX_SPLITS
        prefix_len = tl.load(Tiles + 1 * stride_tiles + tile).to(tl.int32)
        num_splits = tl.minimum(tl.maximum(tl.cdiv(prefix_len, MIN_PREFIX_SPLIT), 1), PREFIX_SPLITS)
        if split < num_splits:
            chunk = tl.cdiv(tl.cdiv(prefix_len, num_splits), BLOCK_N) * BLOCK_N
            start = split * chunk
            end = tl.minimum(start + chunk, prefix_len)
            row = tl.load(Tiles + tile).to(tl.int64)
            first = tl.load(Tiles + 2 * stride_tiles + tile)
            count = tl.load(Tiles + 3 * stride_tiles + tile)
            m_mask = member < count
            rows = tl.load(Members + first + member, mask=m_mask, other=0).to(tl.int64)
            q = tl.load(
                Q + rows[:, None] * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0,
            ).to(DOT_DTYPE)
            row_ptr = Req_to_token + row * stride_r2t
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            m_i, l_i, acc = _attend_span(
                q, m_i, l_i, acc, K_buf, V_buf, row_ptr, start, end, kv_head, qk_scale, v_scale,
                stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, offs_dv, dv_mask,
                BLOCK_N, DOT_PRECISION, DOT_DTYPE, KV_FP8,
            )
            nonempty = end > start
            l_i = tl.where(nonempty, l_i, 1.0)
            out = acc / l_i[:, None]
            mid = Mid_po + rows[:, None] * stride_po_b + heads[:, None] * stride_po_h + split * stride_po_s
            tl.store(mid + offs_dv[None, :], out, mask=m_mask[:, None] & dv_mask[None, :])
            lse = tl.where(nonempty, m_i + tl.log2(l_i), float("-inf"))
            tl.store(Mid_plse + rows * stride_pl_b + heads * stride_pl_h + split, lse, mask=m_mask)


_launch_split, _launch_merge = CachedLaunch(_decode_split_kernel), CachedLaunch(_decode_merge_kernel)
_launch_prefix = CachedLaunch(_prefix_split_kernel)


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


@dataclass
class SharedPrefixes:
    """Prefix-grouped decode (docs/prefix_grouped_decode.md): the shared
    prefixes of a batch cut into tiles, each read once for its members.

    ``tiles`` rows: the prefix's ``req_to_token`` row, its length, the tile's
    first index into ``members`` and its member count (0: a spare tile of a
    CUDA graph's static buffers); ``num_tiles`` the tiles in use, on the
    device. A request's suffix starts at ``prefix_lens[b]`` (0 in no group).
    """

    prefix_lens: torch.Tensor  # [bs], each request's shared length
    tiles: torch.Tensor  # [4, T] int64
    num_tiles: torch.Tensor  # [1] int64
    members: torch.Tensor  # [M] int64, batch rows, tile by tile
    mid_o: torch.Tensor  # [bs, num_heads, PREFIX_SPLITS, v_head_dim] float32 scratch
    mid_lse: torch.Tensor  # [bs, num_heads, PREFIX_SPLITS] float32 scratch
    programs: int  # the prefix kernel grid's first axis, from prefix_programs


def members_per_tile(group: int) -> int:
    """Members of a group one prefix program takes: as many as fill
    ``TILE_QUERY_ROWS`` query rows (``group`` query heads each), at least one."""
    return max(1, TILE_QUERY_ROWS // group)


def prefix_programs(num_kv_heads: int, num_sms: int) -> int:
    """The prefix kernel's programs per KV head: a few per multiprocessor in all."""
    return max(1, triton.cdiv(4 * num_sms, num_kv_heads))


def decode_attention_fwd(
    q: torch.Tensor,  # [bs, num_heads, head_dim]
    k_buffer: torch.Tensor,  # [num_slots, kv_heads, head_dim]
    v_buffer: torch.Tensor,  # [num_slots, kv_heads, v_head_dim]
    out: torch.Tensor,  # [bs, num_heads, v_head_dim]
    req_to_token: torch.Tensor,  # [rows, max_context_len] int32
    req_pool_indices: torch.Tensor,  # [bs]
    seq_lens: torch.Tensor,  # [bs], context length including the new token
    num_kv_splits: torch.Tensor,  # [bs] int32, from num_kv_splits_ (of the suffix lengths, when grouped)
    max_splits: int,  # the grid's split axis, from splits_grid; >= num_kv_splits
    mid_o: torch.Tensor,  # [bs, num_heads, >= max_splits, v_head_dim] float32 scratch
    mid_lse: torch.Tensor,  # [bs, num_heads, >= max_splits] float32 scratch
    sm_scale: float,
    shared: SharedPrefixes | None = None,
) -> torch.Tensor:
    """Attention of one new query token per request over its whole paged
    context; writes and returns ``out``. The new token's K/V must already be
    in the pool. With ``shared``, each group's prefix is read once for all
    its members and each request reads only its own suffix; the merge
    combines both exactly (the log-sum-exps of all partials)."""
    bs, num_heads, head_dim = q.shape
    kv_heads, v_head_dim = k_buffer.shape[1], v_buffer.shape[2]
    group = num_heads // kv_heads
    _check_last_dim_contiguous(q, k_buffer, v_buffer, out, req_to_token, mid_o, mid_lse)
    if mid_lse.shape[2] < max_splits or mid_o.shape[2] < max_splits:
        raise ValueError(f"decode scratch holds {mid_lse.shape[2]} splits, the grid has {max_splits}")
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    dtypes = dict(DOT_PRECISION=precision, DOT_DTYPE=dot_dtype(q.dtype, k_buffer.dtype),
                  KV_FP8=k_buffer.dtype in FP8_DTYPES)
    dims = dict(D=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
                DV=v_head_dim, BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)))
    kv_strides = (k_buffer.stride(0), k_buffer.stride(1), v_buffer.stride(0), v_buffer.stride(1))
    if shared is not None:
        po, pl = shared.mid_o, shared.mid_lse
        _check_last_dim_contiguous(po, pl, shared.tiles, shared.members)
        _launch_prefix((shared.programs, kv_heads),
            q, k_buffer, v_buffer, req_to_token, shared.tiles, shared.num_tiles, shared.members, po, pl,
            sm_scale * LOG2E, 1.0,
            q.stride(0), q.stride(1), *kv_strides, req_to_token.stride(0), shared.tiles.stride(0),
            po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
            GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(members_per_tile(group) * group)),
            PREFIX_SPLITS=PREFIX_SPLITS, MIN_PREFIX_SPLIT=MIN_PREFIX_SPLIT, **dims, **dtypes, **PREFIX_CONFIG,
        )
    config = dict(STAGE1_CONFIG if shared is None else SUFFIX_CONFIG)
    if max(head_dim, v_head_dim) > 128 or q.dtype == torch.float32 or bs * kv_heads < num_sms(q.device):
        config["BLOCK_N"] = min(config["BLOCK_N"], SMALL_BLOCK_N)
    starts = seq_lens if shared is None else shared.prefix_lens  # read only when HAS_START
    po, pl = (mid_o, mid_lse) if shared is None else (shared.mid_o, shared.mid_lse)
    fused = max_splits == 1  # one split a request: the split kernel writes the output
    prefix_args = dict(PREFIX_SPLITS=PREFIX_SPLITS, MIN_PREFIX_SPLIT=MIN_PREFIX_SPLIT)
    _launch_split((bs, kv_heads, max_splits),
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, starts, num_kv_splits, mid_o, mid_lse,
        out, po, pl,
        sm_scale * LOG2E, 1.0,
        q.stride(0), q.stride(1), *kv_strides, req_to_token.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        po.stride(0), po.stride(1), po.stride(2), pl.stride(0), pl.stride(1),
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)), HAS_START=shared is not None,
        WRITE_OUT=fused, **prefix_args, **dims, **dtypes, **config, **pdl(q.device, bs),
    )
    if fused:
        return out
    _launch_merge((bs, num_heads),
        mid_o, mid_lse, out, num_kv_splits, starts, po, pl,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        po.stride(0), po.stride(1), po.stride(2),
        pl.stride(0), pl.stride(1),
        out.stride(0), out.stride(1),
        DV=v_head_dim, BLOCK_DV=max(16, triton.next_power_of_2(v_head_dim)),
        SPLITS_POW2=triton.next_power_of_2(max_splits),
        HAS_PREFIX=shared is not None, PREFIX_SPLITS_POW2=triton.next_power_of_2(PREFIX_SPLITS), **prefix_args,
        num_warps=4 if v_head_dim >= 128 else 2, **pdl(q.device, bs),
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
