"""RMSNorm and fused residual-add + RMSNorm, in the order of
:meth:`radixserve.layers.layernorm.RMSNorm.forward_native`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait


@triton.jit
def _rms_norm_kernel(
    X, Res, Y, ResOut, W,
    n_rows, heads, stride_xt, stride_xh, stride_rt, stride_rh, eps,
    N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    # Row r of the input is (token r // heads, head r % heads); outputs are contiguous.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < N)[None, :]
    t, h = rows // heads, rows % heads
    out_offs = rows[:, None] * N + cols[None, :]
    x = tl.load(X + (t * stride_xt + h * stride_xh)[:, None] + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(Res + (t * stride_rt + h * stride_rh)[:, None] + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + res.to(tl.float32)).to(ResOut.dtype.element_ty)
        tl.store(ResOut + out_offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)
    # Cast back to the input dtype before the weight multiply, as HF does.
    normed = (xf * rstd[:, None]).to(x.dtype)
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    tl.store(Y + out_offs, (normed.to(tl.float32) * w.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or ``(norm(x + residual), x + residual)`` when ``residual``
    is given; the dtypes are torch's promotions. A 3-D ``x`` ``[T, H, D]`` is
    read through its strides, so Qwen3's per-head norm over a view of the qkv
    output needs no copy."""
    shape, n = x.shape, x.shape[-1]
    x3 = x if x.dim() == 3 else x.reshape(-1, 1, n)
    res3, new_residual = x3, None  # stand-ins the kernel ignores without a residual
    if residual is not None:
        res3 = residual if residual.dim() == 3 else residual.reshape(-1, 1, n)
        new_residual = torch.empty(shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    normed_dtype = x.dtype if residual is None else new_residual.dtype
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, normed_dtype), device=x.device)
    n_rows = x3.shape[0] * x3.shape[1]
    if n_rows:
        block_n = triton.next_power_of_2(n)
        block_m = max(1, 2048 // block_n)  # several short rows (head_dim) per program
        block = block_m * block_n
        _rms_norm_kernel[(triton.cdiv(n_rows, block_m),)](
            x3, res3, out, out if new_residual is None else new_residual, weight,
            n_rows, x3.shape[1], x3.stride(0), x3.stride(1), res3.stride(0), res3.stride(1), eps,
            N=n, BLOCK_M=block_m, BLOCK_N=block_n, HAS_RESIDUAL=residual is not None,
            num_warps=4 if block < 2048 else 8 if block < 8192 else 16, **pdl(x.device, x3.shape[0]),
        )
    return out if residual is None else (out, new_residual)
