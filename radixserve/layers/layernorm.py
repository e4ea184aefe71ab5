"""RMSNorm, with the residual add of the next sublayer fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_kernels
from radixserve.layers.triton_ops import use_triton


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension (as in HF ``LlamaRMSNorm``).

    ``forward(x)`` returns the normalised ``x``. ``forward(x, residual)`` first
    adds ``residual`` to ``x`` and returns ``(norm(x + residual), x + residual)``,
    the pre-norm decoder layout where the sum is the next layer's residual.
    The statistics are computed in float32 whatever the input dtype.
    CUDA tensors take one fused Triton kernel, float32 CPU ones a C kernel
    (``cpu_kernels.py``, one pass over the rows); ``forward_native`` is the
    torch reference (the CPU path where the C kernels are off).
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_triton(x, residual):
            from radixserve.layers.triton_ops.norm import rms_norm

            return rms_norm(x, self.weight, self.variance_epsilon, residual)
        if cpu_kernels.elementwise_takes(x, residual) and self.weight.dtype == torch.float32:
            out, summed = cpu_kernels.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
            return out if residual is None else (out, summed)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        out = self._norm(x)
        return out if residual is None else (out, residual)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32 (one fused op), then the weight in x's dtype, as HF does
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.variance_epsilon)
        return self.weight * normed.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
