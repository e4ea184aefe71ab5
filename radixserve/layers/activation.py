"""Gated activations over a fused ``gate_up`` projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.triton_ops import use_triton


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` = ``cat(gate, up)``;
    one Triton kernel on CUDA, ``forward_native`` (torch) elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x):
            from radixserve.layers.triton_ops.activation import silu_and_mul

            return silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)  # in place: one [tokens, d] tensor fewer
