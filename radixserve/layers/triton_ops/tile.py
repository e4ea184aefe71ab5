"""Tile products the GEMM kernels share: ``acc + a @ b`` on the CUDA cores
or the tensor cores (the skinny GEMM, the fused MoE's grouped GEMMs), and a
weight tile times a few rows, a row at a time (the skinny GEMM's row loop,
the MoE router's GEMM)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_product(acc, a, b, FMA: tl.constexpr, DOT_F32: tl.constexpr):
    """``acc + a @ b`` for tiles ``a`` ``[M, K]`` and ``b`` ``[K, N]``:
    with FMA on the CUDA cores (products summed along K, for tiles of a row
    or a few), with DOT_F32 a float32 dot (float32 inputs, and the
    interpreter, whose numpy has no bfloat16), else a tensor-core dot in
    ``b``'s dtype (``a`` converted in registers, as an fp8 weight is).

    On the CUDA cores, where ``a`` is one row (a decode step's token
    against a weight tile ``b``), the products are a 2-D tile of ``b``'s
    shape, so the weight tile stays in the registers it was loaded into:
    for the 3-D product of several rows the compiler moves the whole weight
    tile through shared memory, element by element, each K step."""
    if FMA:
        if a.shape[0] == 1:
            return acc + tl.sum(tl.trans(a.to(tl.float32)) * b.to(tl.float32), axis=0)[None, :]
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a.to(b.dtype), b, acc)


@triton.jit
def rows_product(acc, w, x_row0, stride_xm, k_ok, M, rm, BLOCK_M: tl.constexpr):
    """``acc`` ``[BLOCK_N, BLOCK_M]`` plus the weight tile ``w`` ``[BLOCK_N,
    BLOCK_K]`` times each row of x (``x_row0``: row 0's pointers over this
    K tile) on the CUDA cores, a row at a time: the tile is converted to
    float32 once, and each row's products are summed along K as one row's
    are."""
    wf = w.to(tl.float32)
    for m in tl.static_range(BLOCK_M):
        row_ok = k_ok.to(tl.int32) * 0 + m < M  # [BLOCK_K]: this row is one of x's
        xm = tl.load(x_row0 + m * stride_xm, mask=k_ok & row_ok, other=0.0)
        part = tl.sum(wf * xm.to(tl.float32)[None, :], axis=1)
        acc += tl.where(rm[None, :] == m, part[:, None], 0.0)
    return acc
