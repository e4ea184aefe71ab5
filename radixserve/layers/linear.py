"""Linear layers whose weights may be stored merged (q/k/v, gate/up).

Every weight parameter carries a ``weight_loader(param, loaded_weight,
shard_id=None)`` that copies one checkpoint tensor into its place, so a model's
``load_weights`` only maps names. Everything runs at tensor-parallel size 1;
the ``*Parallel*`` names mark where a TP build would split the output
(column) or the input (row) dimension, inside these loaders and forwards.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into ``param`` (shapes must match)."""
    if shard_id is not None:
        raise ValueError(f"this parameter has no shards, got shard_id {shard_id!r}")
    with torch.no_grad():
        _copy_checked(param.data, loaded_weight)


# -- CPU weight prepacking ---------------------------------------------------
# On a CPU, oneDNN's GEMM over a weight reordered once into its blocked layout
# runs at close to the cores' peak for any row count, where a plain
# ``F.linear`` drops to about half of it for the tens of rows of a decode step
# (and for the LM head's huge N). The packed weight is an opaque ``mkldnn``
# tensor of the same shape; ``.to_dense()`` gives the matrix back.


def cpu_prepacked_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` ([out, in], on the CPU) reordered for oneDNN's GEMM, or
    None where this build or CPU has no oneDNN GEMM for its dtype."""
    if weight.is_mkldnn:
        return weight
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return None
    supported = {
        torch.float32: True,
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }
    if not supported.get(weight.dtype, False):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
    except RuntimeError as e:  # an odd build: keep the plain weight
        logger.warning("CPU weight prepacking unavailable (%s); using plain GEMMs", e)
        return None


def swap_in_prepacked_weight(module: nn.Module) -> bool:
    """Replace ``module.weight`` by its oneDNN-packed form (see
    :func:`cpu_prepacked_weight`); True if it was packed."""
    packed = cpu_prepacked_weight(module.weight.data)
    if packed is not None:
        module.weight = nn.Parameter(packed, requires_grad=False)
    return packed is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain or a CPU-prepacked weight."""
    if weight.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def prepack_linears_for_cpu(model: nn.Module) -> int:
    """Prepack every linear layer of ``model`` and its LM head (``model.lm_head``)
    for CPU GEMMs; returns how many weights were packed. Call once, after the
    weights are loaded."""
    packed = 0
    for module in model.modules():
        if isinstance(module, ColumnParallelLinear):
            packed += module.prepack_for_cpu()
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "prepack_lm_head_for_cpu"):
        packed += head.prepack_lm_head_for_cpu()
    return packed


class ColumnParallelLinear(nn.Module):
    """``y = x @ W.T + b`` with ``W: [output_size, input_size]`` (TP would split the output)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False):
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size), requires_grad=False)
            self.bias.weight_loader = self.weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

    def prepack_for_cpu(self) -> bool:
        return swap_in_prepacked_weight(self)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded_weight, shard_id)

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_size}, bias={self.bias is not None}"


class RowParallelLinear(ColumnParallelLinear):
    """A plain linear layer whose input dimension TP would split (o_proj, down_proj)."""


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked along the output, e.g.
    ``gate_up_proj = [gate_proj; up_proj]``; shard ``i`` is ``output_sizes[i]`` rows."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False):
        super().__init__(input_size, sum(output_sizes), bias)
        self.output_sizes = list(output_sizes)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"shard_id must be an index below {len(self.output_sizes)}, got {shard_id!r}")
        offset = sum(self.output_sizes[:shard_id])
        with torch.no_grad():
            _copy_checked(param.data.narrow(0, offset, self.output_sizes[shard_id]), loaded_weight)


class QKVParallelLinear(MergedColumnParallelLinear):
    """The q, k and v projections stacked along the output: rows
    ``[q (num_heads*head_dim) | k (num_kv_heads*head_dim) | v (same)]``,
    loaded with shard ids ``"q"``, ``"k"``, ``"v"``."""

    SHARDS = ("q", "k", "v")

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False):
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        super().__init__(hidden_size, [self.q_size, self.kv_size, self.kv_size], bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.SHARDS:
            raise ValueError(f"QKV shard_id must be one of {self.SHARDS}, got {shard_id!r}")
        super().weight_loader(param, loaded_weight, self.SHARDS.index(shard_id))
