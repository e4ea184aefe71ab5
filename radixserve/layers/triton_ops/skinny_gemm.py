"""The linear layers' GEMM at a few rows (decode batches of one to a few
dozen): ``y = x @ (W * s).T + b`` at the bandwidth of reading ``W``.

At a few rows a GEMM reads every weight byte for a handful of products: it
is bound by the weight read, and what counts is streaming ``W`` from HBM
with every SM busy. ``torch._scaled_mm`` (``--quantization fp8``) does not:
it wants the activations in fp8 (one more kernel) and its tiles are sized for
large M, so batch 1 in fp8 decoded no faster than in bf16 with half the bytes.

Here ``W`` ``[N, K]`` (fp8 with float32 per-row scales ``s``, or the
activations' own dtype with no scale) is read once, each tile converted to
the activations' dtype in registers; ``x`` ``[M, K]`` stays as it is (bf16),
so nothing is quantized on the way in. The tile product runs on the tensor
cores with the weight as the left operand and the rows padded to 16, so the
output tile is ``y``'s transpose: the weight fills the MMA's large dimension
and the few rows its small one.

Programs tile N. Where N's tiles are too few to keep every SM streaming, K is
split too: each split writes a float32 partial ``[split, M, N]`` and a second
launch sums the partials in order (the result does not depend on timing),
applies the scale and the bias and casts. With one split the first launch
does that itself.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import interpreting, num_sms

MAX_ROWS = 64  # beyond this the GEMM is no longer bound by the weight read


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch's tiles: rows (padded, 16 to 64), N and K tiles, K splits,
    warps and software-pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


@triton.jit
def _skinny_gemm_kernel(X, W, Scale, Bias, Y, Part, M, N, K, stride_xm, stride_wn, stride_ym, k_per_split,
                        HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr, DOT_F32: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = X + rm[None, :] * stride_xm + (k_lo + rk)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # y's tile, transposed
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = rk < k_hi - k0
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if DOT_F32:
            acc = tl.dot(w.to(tl.float32), x.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(x.dtype), x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if PARTIAL:
        part = Part + (pid_k * M + rm[None, :]) * N + rn[:, None]
        tl.store(part, acc, mask=n_ok[:, None] & m_ok[None, :])
    else:
        _epilogue(acc, Scale, Bias, Y, rn, rm, n_ok, m_ok, stride_ym, HAS_SCALE, HAS_BIAS)


@triton.jit
def _epilogue(acc, Scale, Bias, Y, rn, rm, n_ok, m_ok, stride_ym, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    if HAS_SCALE:
        acc = acc * tl.load(Scale + rn, mask=n_ok, other=0.0)[:, None]
    if HAS_BIAS:
        acc = acc + tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    y = Y + rm[None, :] * stride_ym + rn[:, None]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


@triton.jit
def _split_sum_kernel(Scale, Bias, Y, Part, M, N, stride_ym, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    n_ok, m_ok = rn < N, rm < M
    mask = n_ok[:, None] & m_ok[None, :]
    part = Part + rm[None, :] * N + rn[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for s in tl.static_range(SPLIT):
        acc += tl.load(part + s * M * N, mask=mask, other=0.0)
    _epilogue(acc, Scale, Bias, Y, rn, rm, n_ok, m_ok, stride_ym, HAS_SCALE, HAS_BIAS)


def split_for(n: int, k: int, block_n: int, block_k: int, programs: int) -> int:
    """K splits that bring N's tiles up to about ``programs`` programs, each
    split at least two K tiles long."""
    return max(1, min(triton.cdiv(programs, triton.cdiv(n, block_n)), k // (2 * block_k)))


def default_config(m: int, n: int, k: int, sms: int) -> SkinnyConfig:
    """Tiles for ``[m, k] @ [n, k].T``: the rows padded to 16 at least, N
    tiles of 64 rows of W, K tiles of 128, and K split until there are about
    four programs an SM: the best tiles of a sweep over llama-3.1-8b's
    projections at 1 to 16 rows on an H100 (benchmarks/README.md)."""
    block_n, block_k = 64, 128
    return SkinnyConfig(max(16, triton.next_power_of_2(m)), block_n, block_k, split_for(n, k, block_n, block_k, 4 * sms))


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None,
                  bias: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """``x @ (weight * scale).T + bias`` for ``x`` ``[M, K]`` with M at most
    :data:`MAX_ROWS` (unit stride along K); ``weight`` ``[N, K]`` (unit
    stride along K) in fp8 with float32 ``scale`` (N values) or in ``x``'s
    dtype without one. The output is ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear takes at most {MAX_ROWS} rows, got {m}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    cfg = config or default_config(m, n, k, num_sms(x.device) if x.is_cuda else 1)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    part = torch.empty((split, m, n), dtype=torch.float32, device=x.device) if split > 1 else y
    flags = dict(HAS_SCALE=scale is not None, HAS_BIAS=bias is not None)
    scale_arg = scale if scale is not None else y  # an unused pointer where a flag is off
    bias_arg = bias if bias is not None else y
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, weight, scale_arg, bias_arg, y, part, m, n, k, x.stride(0), weight.stride(0), y.stride(0), k_per_split,
        PARTIAL=split > 1, DOT_F32=x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **flags)
    if split > 1:
        _split_sum_kernel[(triton.cdiv(n, 128),)](scale_arg, bias_arg, y, part, m, n, y.stride(0), SPLIT=split,
                                                  BLOCK_M=cfg.block_m, BLOCK_N=128, num_warps=4, **flags)
    return y
