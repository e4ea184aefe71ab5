"""SiLU-and-mul over the fused ``gate_up`` output, in the order of
:meth:`radixserve.layers.activation.SiluAndMul.forward_native`."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gdc import pdl_trigger, pdl_wait

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_xt, D, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_wait(USE_PDL)
    pdl_trigger(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    gate = tl.load(X + t * stride_xt + cols, mask=mask).to(tl.float32)
    up = tl.load(X + t * stride_xt + D + cols, mask=mask)
    # silu is rounded to the input dtype before the product, as torch's two ops are.
    act = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Y + t * D + cols, (act.to(tl.float32) * up.to(tl.float32)).to(Y.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x`` ``[..., 2 * d]`` = ``cat(gate, up)``."""
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    out = torch.empty(x.shape[:-1] + (d,), dtype=x.dtype, device=x.device)
    if rows.shape[0] and d:
        block = min(_BLOCK, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](rows, out, rows.stride(0), d, BLOCK=block,
                                                                       **pdl(x.device, rows.shape[0]))
    return out
