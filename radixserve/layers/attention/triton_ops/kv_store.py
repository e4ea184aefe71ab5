"""One kernel that stores a forward's new K and V rows into the KV pool
(instead of two indexed copies, plus two casts when the dtypes differ). An
fp8 pool's values saturate at its largest finite value, as
``memory_pool.to_kv_dtype`` does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.launch import CachedLaunch
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait
from radixserve.mem_cache.memory_pool import FP8_DTYPES


@triton.jit
def to_pool(x, Buf, LIMIT: tl.constexpr):
    """``x`` in the pool's dtype (``Buf``'s); an fp8 pool's values saturate
    at LIMIT (:func:`pool_limit`), others are cast as they are."""
    if LIMIT > 0:
        x = tl.clamp(x.to(tl.float32), -LIMIT, LIMIT)
    return x.to(Buf.dtype.element_ty)


def pool_limit(dtype: torch.dtype) -> float:
    """The kernels' LIMIT for a pool of ``dtype``: the largest finite value
    of an fp8 dtype, 0 (no clamp) for the others."""
    return torch.finfo(dtype).max if dtype in FP8_DTYPES else 0.0


@triton.jit
def _store_kv_kernel(
    K, V, K_buf, V_buf, Loc,
    stride_kt, stride_vt, stride_kbt, stride_vbt,
    K_ROW: tl.constexpr, BLOCK_K: tl.constexpr, V_ROW: tl.constexpr, BLOCK_V: tl.constexpr,
    LIMIT: tl.constexpr,  # the largest finite value of an fp8 pool; 0 for other dtypes
    USE_PDL: tl.constexpr = False,
):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    t = tl.program_id(0)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    k = tl.load(K + t.to(tl.int64) * stride_kt + offs_k, mask=offs_k < K_ROW)
    offs_v = tl.arange(0, BLOCK_V)
    v = tl.load(V + t.to(tl.int64) * stride_vt + offs_v, mask=offs_v < V_ROW)
    tl.store(K_buf + slot * stride_kbt + offs_k, to_pool(k, K_buf, LIMIT), mask=offs_k < K_ROW)
    tl.store(V_buf + slot * stride_vbt + offs_v, to_pool(v, V_buf, LIMIT), mask=offs_v < V_ROW)


_launch_store = CachedLaunch(_store_kv_kernel)


def can_store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor) -> bool:
    """Whether :func:`store_kv` handles these layouts: each token's heads
    contiguous in ``k``/``v`` (``[n, heads, dim]``) and each slot's in the pool."""
    return all(t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (k, v, k_buffer, v_buffer))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor) -> None:
    """``k_buffer[loc] = k; v_buffer[loc] = v`` (cast to the pool's dtype);
    ``k``/``v`` are ``[n, kv_heads, dim]``, see :func:`can_store_kv`."""
    n = k.shape[0]
    if n == 0:
        return
    k_row, v_row = k.shape[1] * k.shape[2], v.shape[1] * v.shape[2]
    _launch_store((n,),
        k, v, k_buffer, v_buffer, loc,
        k.stride(0), v.stride(0), k_buffer.stride(0), v_buffer.stride(0),
        K_ROW=k_row, BLOCK_K=triton.next_power_of_2(k_row), V_ROW=v_row, BLOCK_V=triton.next_power_of_2(v_row),
        LIMIT=pool_limit(k_buffer.dtype),
        num_warps=4, **pdl(k.device, n),
    )
