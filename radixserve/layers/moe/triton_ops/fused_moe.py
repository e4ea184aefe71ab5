"""The fused MoE path on the GPU, in the design of SGLang's and vLLM's
``fused_moe``: four launches a layer, none of which waits on the host
(two for one token on the CUDA cores, below).

1. :func:`moe_align_block_size` sorts the ``T * k`` (token, choice) pairs by
   expert and pads each expert's run to a multiple of ``BLOCK_SIZE_M``, so
   that every block of ``BLOCK_SIZE_M`` rows belongs to one expert.
2. A grouped GEMM over those blocks: ``hidden @ w13[e].T`` for the gate and
   up rows at once, SiLU(gate) * up in registers -> ``[T * k, I]``.
3. A grouped GEMM for down, each row times its routing weight -> ``[T * k, H]``.
4. The sum over each token's k rows -> ``[T, H]``.

Region map of the sorted pairs (``BLOCK_SIZE_M`` = 4; pair ``p`` is token
``p // k``, choice ``p % k``; ``n`` = ``T * k`` marks a pad)::

    sorted_token_ids  | 0  5  n  n | 1  2  4  7 | 3  n  n  n | ...unused... |
    expert_ids        |  expert 0  |  expert 2  |  expert 3  |
                      <----------- num_tokens_post_padded ----------->

A pair whose id is -1 (or outside ``[0, E)``: under expert parallelism, an
expert another rank holds) is in no run; its rows of the GEMM outputs are
never written and the sum skips them. Shapes depend on ``T``, ``k`` and
``E`` only, never on the routing, so CUDA graphs can capture all of it.

One token (a decode step of batch 1) launches no sort (each choice is a
block of its own); with a configuration on the CUDA cores (``BLOCK_SIZE_M``
below 16) its down GEMM and the top-k sum are one launch too, which loops
over the k choices and adds them in registers: two launches in all.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import DTYPE_NAMES, device_name, interpreting, num_sms
from radixserve.layers.triton_ops.tile import tile_product

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
TABLE_COVERS_ALL = 1024  # a table tuned up to this many tokens serves any larger batch with its largest entry
CONFIG_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")

_ALIGN_CHUNK = 128  # pairs placed by one program of the align kernel
_ALIGN_COUNT_BLOCK = 1024  # pairs counted per step of its histogram loop
# Past this many programs the pairs are counted first, a chunk a program, and the counts summed up by
# torch: each program of the one-launch kernel counts every pair, n^2 / 128 in all. On an H100 at
# 131,072 tokens of top-8 (a million pairs) it took 118.5 ms a layer, counted first 1.78; at 1,024
# tokens (64 programs) one launch is faster (0.10 against 0.18 ms; benchmarks/README.md)
_ALIGN_ONE_LAUNCH_PROGRAMS = 64
_ALIGN_TILE = 8192  # elements of its [experts x something] tiles
_SUM_BLOCK = 1024
_SAFE_SHARED_MEMORY = 96 * 1024  # bytes a block may use on sm_80 and later (sm_89 has the least: 99 KB)


# ---------------------------------------------------------------------------
# 1. Sort and pad
# ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["n"])
def _moe_count_kernel(TopkIds, Counts, n, num_experts, E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    # Counts[pid]: the pairs of each expert in chunk pid (bin num_experts: the skipped ones)
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(TopkIds + offs, mask=offs < n, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < num_experts), e, num_experts)
    tl.store(Counts + pid * E_PAD + tl.arange(0, E_PAD), tl.histogram(e, E_PAD))


@triton.jit(do_not_specialize=["n"])  # one compiled kernel for every batch size
def _moe_align_kernel(
    TopkIds, SortedIds, ExpertIds, NumPostPadded, n, num_experts, Counts, CountsSummed,
    BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, CHUNK: tl.constexpr, COUNT_BLOCK: tl.constexpr,
    PAD_COLS: tl.constexpr, BLOCK_ROWS: tl.constexpr, COUNTED: tl.constexpr,
):
    # Every program needs every expert's count (for its start) and the pairs
    # of each expert before its chunk: COUNTED, from the chunks' counts and
    # their running sums over chunks; otherwise it counts all pairs itself.
    # It then places its chunk's pairs, the pads of the experts e with
    # e % programs == pid, and every programs-th block's expert.
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    chunk_start = pid * CHUNK
    bins = tl.arange(0, E_PAD)  # bin num_experts (< E_PAD) collects the skipped pairs
    if COUNTED:
        total = tl.load(CountsSummed + (programs - 1) * E_PAD + bins)
        before = tl.load(CountsSummed + pid * E_PAD + bins) - tl.load(Counts + pid * E_PAD + bins)
    else:
        total = tl.zeros([E_PAD], dtype=tl.int32)
        before = tl.zeros([E_PAD], dtype=tl.int32)
        for start in range(0, n, COUNT_BLOCK):
            offs = start + tl.arange(0, COUNT_BLOCK)
            e = tl.load(TopkIds + offs, mask=offs < n, other=-1).to(tl.int32)
            e = tl.where((e >= 0) & (e < num_experts), e, num_experts)
            total += tl.histogram(e, E_PAD)
            before += tl.histogram(tl.where(offs < chunk_start, e, num_experts), E_PAD)
    counts = tl.where(bins < num_experts, total, 0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    num_padded = tl.sum(padded, 0)
    if pid == 0:
        tl.store(NumPostPadded, num_padded)

    # This chunk's pairs, each after its expert's pairs in earlier chunks and
    # earlier in this chunk: a stable sort.
    rows = tl.arange(0, CHUNK)
    offs = chunk_start + rows
    e = tl.load(TopkIds + offs, mask=offs < n, other=-1).to(tl.int32)
    e = tl.where((e >= 0) & (e < num_experts), e, num_experts)
    earlier_same = (e[:, None] == e[None, :]) & (rows[None, :] < rows[:, None])
    rank = tl.sum(earlier_same.to(tl.int32), axis=1)
    dest = tl.gather(starts + before, e, 0) + rank
    tl.store(SortedIds + dest, offs, mask=e < num_experts)

    # Pads: the last padded - counts places of each expert's run hold n.
    mine = (bins < num_experts) & (bins % programs == pid)
    first_pad = starts + counts
    for j in range(0, BLOCK_M, PAD_COLS):
        cols = j + tl.arange(0, PAD_COLS)
        pad = mine[:, None] & (cols[None, :] < (padded - counts)[:, None])
        tl.store(SortedIds + first_pad[:, None] + cols[None, :], tl.zeros([E_PAD, PAD_COLS], tl.int32) + n, mask=pad)

    # Each block's expert: the number of runs that end at or before its first row.
    num_blocks = num_padded // BLOCK_M
    for b in range(pid * BLOCK_ROWS, num_blocks, programs * BLOCK_ROWS):
        blocks = b + tl.arange(0, BLOCK_ROWS)
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(ExpertIds + blocks, owner, mask=blocks < num_blocks)


def max_padded_pairs(num_pairs: int, num_experts: int, block_size: int) -> int:
    """Rows of ``sorted_token_ids`` that cover any routing: each expert with
    pairs pads at most ``block_size - 1`` rows, and at most ``min(E, T * k)``
    experts have pairs (rounded up to whole blocks)."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_size - 1)
    return triton.cdiv(worst, block_size) * block_size


@functools.cache
def one_token_layout(top_k: int, block_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids, num_tokens_post_padded)`` for one token's ``top_k``
    choices, each in a block of its own (the expert ids are then the choices
    themselves, -1 ones included: the GEMM skips their blocks). The top k
    experts of one token are distinct, so each expert's weights are read once,
    as with :func:`moe_align_block_size`; the layout depends on nothing else,
    so it is built once (by the warm-up runs before a CUDA graph's capture,
    whose static input it then is) and a step of one
    token launches no alignment kernel."""
    sorted_ids = torch.full((top_k * block_size,), top_k, dtype=torch.int32)
    sorted_ids[::block_size] = torch.arange(top_k, dtype=torch.int32)
    num_post = torch.tensor([top_k * block_size], dtype=torch.int32)
    return sorted_ids.to(device), num_post.to(device)


def moe_align_block_size(
    topk_ids: torch.Tensor, block_size: int, num_experts: int, *, count_first: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(sorted_token_ids, expert_ids, num_tokens_post_padded)`` for ``topk_ids [T, k]``.

    ``sorted_token_ids`` (int32, :func:`max_padded_pairs` rows) lists the pair
    indices ``t * k + j`` of expert 0, then expert 1, ..., each expert's run
    in increasing pair order and padded with ``T * k`` to a multiple of
    ``block_size``; ``expert_ids`` (int32, one per block) is the expert of
    each block; ``num_tokens_post_padded`` (int32 ``[1]``) is the length of
    the runs together. Entries past it are left unwritten. Ids outside
    ``[0, num_experts)`` (-1) are left out. No host sync: one launch up to
    ``64 * 128`` pairs; past that (or with ``count_first``) a launch counts
    each chunk's pairs and torch sums the counts over chunks first."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n = ids.numel()
    rows = max_padded_pairs(n, num_experts, block_size)
    sorted_ids = torch.empty(rows, dtype=torch.int32, device=ids.device)
    expert_ids = torch.empty(rows // block_size, dtype=torch.int32, device=ids.device)
    num_post = torch.empty(1, dtype=torch.int32, device=ids.device)
    if n == 0:
        num_post.zero_()
        return sorted_ids, expert_ids, num_post
    e_pad = triton.next_power_of_2(num_experts + 1)
    programs = triton.cdiv(n, _ALIGN_CHUNK)
    if count_first is None:
        count_first = programs > _ALIGN_ONE_LAUNCH_PROGRAMS
    counts = summed = num_post  # unread without count_first
    if count_first:
        counts = torch.empty(programs, e_pad, dtype=torch.int32, device=ids.device)
        _moe_count_kernel[(programs,)](ids, counts, n, num_experts, E_PAD=e_pad, CHUNK=_ALIGN_CHUNK)
        summed = counts.cumsum(0, dtype=torch.int32)
    _moe_align_kernel[(programs,)](
        ids, sorted_ids, expert_ids, num_post, n, num_experts, counts, summed,
        BLOCK_M=block_size, E_PAD=e_pad, CHUNK=_ALIGN_CHUNK, COUNT_BLOCK=_ALIGN_COUNT_BLOCK,
        PAD_COLS=max(1, min(triton.next_power_of_2(block_size), _ALIGN_TILE // e_pad)),
        BLOCK_ROWS=max(16, _ALIGN_TILE // e_pad), COUNTED=count_first, num_warps=8,
    )
    return sorted_ids, expert_ids, num_post


# ---------------------------------------------------------------------------
# 2-3. The grouped GEMMs
# ---------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _grouped_gemm_kernel(
    A, B, C, TopkWeights, SortedIds, ExpertIds, NumPostPadded,
    N, K, num_pairs, num_blocks, a_rows_per_pair,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    BLOCK_SIZE_M: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, GROUP_SIZE_M: tl.constexpr,
    GATED: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, EVEN_K: tl.constexpr, DOT_F32: tl.constexpr,
    FMA: tl.constexpr,
):
    # C[pair, :N] = A[pair // a_rows_per_pair] @ B[expert].T for the pairs of
    # one block. GATED: B holds 2N rows (gate, then up) and C gets
    # silu(gate) * up. Blocks are swizzled in groups of GROUP_SIZE_M so that
    # neighbouring programs share weight tiles in L2. FMA (BLOCK_SIZE_M below
    # 16: a decode step's one row per expert) multiplies on the CUDA cores:
    # no MMA padding the rows to 16, no weight tile through shared memory.
    pid = tl.program_id(0)
    blocks_n = tl.cdiv(N, BLOCK_SIZE_N)
    in_group = GROUP_SIZE_M * blocks_n
    first_m = (pid // in_group) * GROUP_SIZE_M
    group_m = tl.minimum(num_blocks - first_m, GROUP_SIZE_M)
    pid_m = first_m + (pid % in_group) % group_m
    pid_n = (pid % in_group) // group_m
    if pid_m * BLOCK_SIZE_M >= tl.load(NumPostPadded):
        return

    pair = tl.load(SortedIds + pid_m * BLOCK_SIZE_M + tl.arange(0, BLOCK_SIZE_M)).to(tl.int64)
    row_ok = pair < num_pairs
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    if expert < 0:  # a choice of another rank's expert (the one-token layout keeps them): nothing to compute
        return
    cols = pid_n * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    w_cols = cols % N  # in bounds without a mask; the extra columns are not stored
    ks = tl.arange(0, BLOCK_SIZE_K)
    a_ptrs = A + (pair // a_rows_per_pair)[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = B + expert * stride_be + w_cols[None, :] * stride_bn + ks[:, None] * stride_bk
    acc = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_SIZE_M, BLOCK_SIZE_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn)
        else:
            k_ok = ks < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
            if GATED:
                b_up = tl.load(b_ptrs + N * stride_bn, mask=k_ok[:, None], other=0.0)
        acc = tile_product(acc, a, b, FMA, DOT_F32)
        if GATED:
            acc_up = tile_product(acc_up, a, b_up, FMA, DOT_F32)
        a_ptrs += BLOCK_SIZE_K * stride_ak
        b_ptrs += BLOCK_SIZE_K * stride_bk

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_ROUTED_WEIGHT:
        acc = acc * tl.load(TopkWeights + pair, mask=row_ok, other=0.0).to(tl.float32)[:, None]
    c_ptrs = C + pair[:, None] * stride_cm + cols[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=row_ok[:, None] & (cols < N)[None, :])


def _grouped_gemm(a, b, c, topk_weights, sorted_ids, expert_ids, num_post, num_pairs, a_rows_per_pair, config,
                  *, gated: bool, mul_routed_weight: bool) -> None:
    n, k = c.shape[1], a.shape[1]
    bm, bn, bk = config["BLOCK_SIZE_M"], config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
    num_blocks = sorted_ids.numel() // bm
    # numpy has no bfloat16: Triton's interpreter computes bf16 dots wrongly, so there they run in float32.
    dot_f32 = a.dtype == torch.float32 or (interpreting() and a.dtype == torch.bfloat16)
    grid = (num_blocks * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](
        a, b, c, topk_weights, sorted_ids, expert_ids, num_post,
        n, k, num_pairs, num_blocks, a_rows_per_pair,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=config["GROUP_SIZE_M"],
        GATED=gated, MUL_ROUTED_WEIGHT=mul_routed_weight, EVEN_K=k % bk == 0, DOT_F32=dot_f32, FMA=bm < 16,
        num_warps=config["num_warps"], num_stages=config["num_stages"],
    )


# ---------------------------------------------------------------------------
# 4. The top-k sum
# ---------------------------------------------------------------------------


@triton.jit
def _moe_sum_kernel(X, TopkIds, Out, H, num_experts, stride_xm, stride_om, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        e = tl.load(TopkIds + t * TOP_K + j)
        if (e >= 0) & (e < num_experts):  # a skipped pair's row was never written
            acc += tl.load(X + (t * TOP_K + j) * stride_xm + cols, mask=in_row, other=0.0).to(tl.float32)
    tl.store(Out + t * stride_om + cols, acc.to(Out.dtype.element_ty), mask=in_row)


@triton.jit
def _one_token_down_sum_kernel(
    Act, W2, TopkWeights, TopkIds, Out, H, inter, num_experts, stride_am, stride_be, stride_bn, stride_bk,
    TOP_K: tl.constexpr, BLOCK_SIZE_N: tl.constexpr, BLOCK_SIZE_K: tl.constexpr, EVEN_K: tl.constexpr,
    TOPK_PAD: tl.constexpr,
):
    # One token: Out[0, cols] = sum over its k choices j of weight_j * Act[j] @ W2[expert_j, cols].T, the down
    # GEMM and the top-k sum in one launch, on the CUDA cores. All k experts' weight tiles are one load
    # ([choice, column, K]), so their reads are in flight together rather than one expert after another. Each
    # choice's weighted output is rounded to the model's dtype before the float32 sum, as in the two-launch
    # path; choices outside [0, E) read nothing and add nothing (their Act rows were never written).
    cols = tl.program_id(0) * BLOCK_SIZE_N + tl.arange(0, BLOCK_SIZE_N)
    w_cols = cols % H  # in bounds without a mask; the extra columns are not stored
    ks = tl.arange(0, BLOCK_SIZE_K)
    js = tl.arange(0, TOPK_PAD)
    e = tl.load(TopkIds + js, mask=js < TOP_K, other=-1).to(tl.int64)
    chosen = (e >= 0) & (e < num_experts)
    e = tl.where(chosen, e, 0)
    a_ptrs = Act + js[:, None] * stride_am + ks[None, :]
    b_ptrs = W2 + e[:, None, None] * stride_be + w_cols[None, :, None] * stride_bn + ks[None, None, :] * stride_bk
    acc = tl.zeros([TOPK_PAD, BLOCK_SIZE_N], dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_SIZE_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=chosen[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=chosen[:, None, None], other=0.0)
        else:
            k_ok = ks < inter - k0
            a = tl.load(a_ptrs, mask=chosen[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=chosen[:, None, None] & k_ok[None, None, :], other=0.0)
        acc += tl.sum(b.to(tl.float32) * a.to(tl.float32)[:, None, :], axis=2)
        a_ptrs += BLOCK_SIZE_K
        b_ptrs += BLOCK_SIZE_K * stride_bk
    weighted = acc * tl.load(TopkWeights + js, mask=chosen, other=0.0).to(tl.float32)[:, None]
    out = tl.sum(weighted.to(Out.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(Out + cols, out.to(Out.dtype.element_ty), mask=cols < H)


# ---------------------------------------------------------------------------
# Launch configurations
# ---------------------------------------------------------------------------


def config_file_name(num_experts: int, hidden: int, intermediate: int, dtype: torch.dtype, device_name: str) -> str:
    """The name of the tuned table for these shapes on this device, e.g.
    ``E=128,H=2048,I=768,dtype=bf16,device_name=NVIDIA_H200.json``."""
    return (f"E={num_experts},H={hidden},I={intermediate},dtype={DTYPE_NAMES[dtype]},"
            f"device_name={device_name.replace(' ', '_')}.json")


@functools.cache
def load_configs(path: str) -> dict[int, dict] | None:
    """A tuned table (batch tokens -> launch configuration), read once; None
    where there is no such file."""
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return {int(tokens): {key: int(cfg[key]) for key in CONFIG_KEYS} for tokens, cfg in json.load(f).items()}


def default_config(num_experts: int, tokens: int, top_k: int, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Untuned tiles by the pairs an expert gets on average, with no more
    pipeline stages than fit the shared memory of any GPU since Ampere."""
    per_expert = tokens * top_k / num_experts
    if per_expert <= 16:  # decode: weight reads dominate, rows are few
        cfg = dict(BLOCK_SIZE_M=16, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=1, num_warps=4, num_stages=4)
    elif per_expert <= 128:
        cfg = dict(BLOCK_SIZE_M=32, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=4)
    else:
        cfg = dict(BLOCK_SIZE_M=64, BLOCK_SIZE_N=64, BLOCK_SIZE_K=64, GROUP_SIZE_M=8, num_warps=4, num_stages=3)
    # a stage of the gate/up kernel holds one A tile and two B tiles
    stage = (cfg["BLOCK_SIZE_M"] + 2 * cfg["BLOCK_SIZE_N"]) * cfg["BLOCK_SIZE_K"] * dtype.itemsize
    cfg["num_stages"] = max(2, min(cfg["num_stages"], _SAFE_SHARED_MEMORY // stage))
    return cfg


def get_config(num_experts: int, hidden: int, intermediate: int, top_k: int, dtype: torch.dtype, tokens: int,
               device: torch.device | None = None, config_dir: str | Path = CONFIG_DIR) -> dict:
    """The launch configuration for ``tokens`` tokens: from the tuned table
    of these shapes and this device (the entry of the nearest batch size;
    past the table's largest only if that is a prefill-sized batch of
    :data:`TABLE_COVERS_ALL` tokens or more: a table tuned for a few tokens
    says nothing of more), else :func:`default_config`. Off a CUDA device (Triton's interpreter), the default."""
    if device is not None and torch.device(device).type == "cuda":
        name = device_name(torch.device(device))
        table = load_configs(str(Path(config_dir) / config_file_name(num_experts, hidden, intermediate, dtype, name)))
        if table and (tokens <= max(table) or max(table) >= TABLE_COVERS_ALL):
            return dict(table[min(table, key=lambda batch: (abs(batch - tokens), batch))])
    return default_config(num_experts, tokens, top_k, dtype)


# ---------------------------------------------------------------------------
# The layer's entry point
# ---------------------------------------------------------------------------


def fused_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    *, config: dict | None = None,
) -> torch.Tensor:
    """For each token, the sum over its k experts of ``weight * down(SiLU(gate) * up)``,
    as :func:`radixserve.layers.moe.native.moe_forward_native` computes it.

    ``hidden [T, H]`` (bf16, fp16 or fp32), ``w13 [E, 2I, H]`` (gate rows,
    then up rows), ``w2 [E, H, I]``, ``topk_weights float32 [T, k]``,
    ``topk_ids int32 [T, k]`` (-1: skipped). Both GEMMs accumulate in
    float32; SiLU * up is rounded once to ``hidden``'s dtype, each expert's
    weighted output once more, and the k of them are summed in float32.
    ``config`` overrides the launch configuration (:func:`get_config`)."""
    tokens, hidden_size = hidden.shape
    num_experts, two_i, _ = w13.shape
    intermediate, top_k = two_i // 2, topk_ids.shape[1]
    if w13.shape[2] != hidden_size or w2.shape != (num_experts, hidden_size, intermediate):
        raise ValueError(f"w13 {tuple(w13.shape)} and w2 {tuple(w2.shape)} do not fit hidden {tuple(hidden.shape)}")
    if topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != tokens:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)}, topk_ids {tuple(topk_ids.shape)}, {tokens} tokens")
    out = torch.empty(tokens, hidden_size, dtype=hidden.dtype, device=hidden.device)
    if tokens == 0:
        return out
    if config is None:
        config = get_config(num_experts, hidden_size, intermediate, top_k, hidden.dtype, tokens, hidden.device)
    topk_ids, topk_weights = topk_ids.contiguous(), topk_weights.contiguous()
    num_pairs = tokens * top_k
    if tokens == 1:  # a decode step of one: each choice is a block of its own, no alignment launch
        sorted_ids, num_post = one_token_layout(top_k, config["BLOCK_SIZE_M"], hidden.device)
        expert_ids = topk_ids.reshape(-1)
    else:
        sorted_ids, expert_ids, num_post = moe_align_block_size(topk_ids, config["BLOCK_SIZE_M"], num_experts)
    act = torch.empty(num_pairs, intermediate, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(hidden, w13, act, topk_weights, sorted_ids, expert_ids, num_post, num_pairs, top_k, config,
                  gated=True, mul_routed_weight=False)
    if tokens == 1 and config["BLOCK_SIZE_M"] < 16:  # on the CUDA cores: down and the top-k sum in one launch
        bn, bk = config["BLOCK_SIZE_N"], config["BLOCK_SIZE_K"]
        # its programs split only the hidden columns (the k choices are summed within one): narrower
        # tiles than the gate/up GEMM's, until there are about four programs an SM to stream the experts
        programs = 4 * num_sms(hidden.device) if hidden.is_cuda else 1
        while bn > 1 and triton.cdiv(hidden_size, bn) < programs:
            bn //= 2
        _one_token_down_sum_kernel[(triton.cdiv(hidden_size, bn),)](
            act, w2, topk_weights, topk_ids, out, hidden_size, intermediate, num_experts,
            act.stride(0), w2.stride(0), w2.stride(1), w2.stride(2),
            TOP_K=top_k, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, EVEN_K=intermediate % bk == 0,
            TOPK_PAD=triton.next_power_of_2(top_k),
            num_warps=config["num_warps"], num_stages=config["num_stages"])
        return out
    down = torch.empty(num_pairs, hidden_size, dtype=hidden.dtype, device=hidden.device)
    _grouped_gemm(act, w2, down, topk_weights, sorted_ids, expert_ids, num_post, num_pairs, 1, config,
                  gated=False, mul_routed_weight=True)
    block = min(_SUM_BLOCK, triton.next_power_of_2(hidden_size))
    _moe_sum_kernel[(tokens, triton.cdiv(hidden_size, block))](
        down, topk_ids, out, hidden_size, num_experts, down.stride(0), out.stride(0), TOP_K=top_k, BLOCK=block)
    return out
