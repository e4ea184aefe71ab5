"""A tile product the GEMM kernels share (the skinny GEMM, the fused MoE's
grouped GEMMs): ``acc + a @ b`` on the CUDA cores or the tensor cores."""

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
