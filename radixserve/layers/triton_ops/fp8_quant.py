"""Per-token fp8 quantization of activations, in the order of
:func:`radixserve.layers.quantization.quantize_fp8_rows`: each row's absolute
maximum, a float32 scale ``amax / fp8 max`` (at least ``MIN_SCALE``), and the
row divided by it, clamped and rounded to fp8."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _per_token_quant_fp8_kernel(X, Q, S, stride_x, K, FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row, q_row = X + row * stride_x, Q + row * K
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):  # a row is read twice: the second pass hits L2
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(S + row, scale)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(q_row + cols, q.to(Q.dtype.element_ty), mask=cols < K)


def per_token_quant_fp8(x: torch.Tensor, fp8_dtype: torch.dtype, min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[M, K]`` (unit stride along K) as fp8 ``[M, K]`` and float32
    scales ``[M, 1]``."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m and k:
        block = min(_BLOCK, triton.next_power_of_2(k))
        _per_token_quant_fp8_kernel[(m,)](x, q, scale, x.stride(0), k, FP8_MAX=torch.finfo(fp8_dtype).max,
                                          MIN_SCALE=min_scale, BLOCK=block, num_warps=8 if block >= 2048 else 4)
    return q, scale
