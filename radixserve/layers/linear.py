"""Linear layers split over tensor-parallel ranks; their weights may be
stored merged (q/k/v, gate/up).

- :class:`ColumnParallelLinear` splits the output dimension: rank ``r`` holds
  its slice of the rows of ``W`` (and of the bias) and outputs its slice of
  ``y``; nothing is communicated.
- :class:`RowParallelLinear` splits the input dimension: rank ``r`` holds its
  slice of the columns of ``W`` and takes its slice of ``x`` (a column-parallel
  output); an all-reduce sums the partial products, then the bias is added once.
- :class:`MergedColumnParallelLinear` and :class:`QKVParallelLinear` stack
  several column-parallel projections, each split on its own, so a rank holds
  ``[gate_r; up_r]`` or ``[q_r; k_r; v_r]`` (KV heads replicated where there
  are fewer than ranks, see ``distributed/partition.py``).

Every weight parameter carries a ``weight_loader(param, loaded_weight,
shard_id=None)`` that takes a whole checkpoint tensor and copies this rank's
shard of it into place, so a model's ``load_weights`` only maps names, and
``checkpoint_shards``: the ``(shard_id, full shape)`` of the checkpoint
tensors it is loaded from (dummy weights draw those, so every tp size gets the
same model). At tp size 1 these are plain linear layers and no collective runs.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import TPGroup, divide, head_layout
from radixserve.layers.quantization import fp8_linear, gated_linear, quantize_fp8_rows, takes_skinny

logger = logging.getLogger(__name__)


def copy_checked(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape mismatch: parameter slice {tuple(dst.shape)}, checkpoint {tuple(src.shape)}")
    dst.copy_(src)


def narrow_checked(loaded: torch.Tensor, dim: int, start: int, length: int, full: int) -> torch.Tensor:
    """``loaded.narrow(dim, start, length)`` after checking that ``loaded`` is
    the whole checkpoint tensor (``full`` long along ``dim``)."""
    if loaded.dim() <= dim or loaded.shape[dim] != full:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded.shape)}, expected {full} along dim {dim}")
    return loaded.narrow(dim, start, length)


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
    """Copy a whole checkpoint tensor into ``param`` (shapes must match)."""
    if shard_id is not None:
        raise ValueError(f"this parameter has no shards, got shard_id {shard_id!r}")
    with torch.no_grad():
        copy_checked(param.data, loaded_weight)


# -- CPU weight prepacking ---------------------------------------------------
# On a CPU, oneDNN's GEMM over a weight reordered once into its blocked layout
# runs at close to the cores' peak for any row count, where a plain
# ``F.linear`` drops to about half of it for the tens of rows of a decode step
# (and for the LM head's huge N). The packed weight is an opaque ``mkldnn``
# tensor of the same shape; ``.to_dense()`` gives the matrix back.
#
# On a CPU without AVX-512, from about a thousand rows on (prefill chunks) the
# plain GEMM is the faster one again (176-186 GFLOP/s against 155-168 at 2,048
# rows of SmolLM2's shapes, 2 cores of an AVX2 EPYC), and unpacking the weight
# costs a fraction of a millisecond against the tens the GEMM takes: such
# inputs get the matrix back for the call. With AVX-512, oneDNN's GEMM stays
# the faster at every row count (207-223 GFLOP/s against the plain GEMM's
# 183-201 at 512 to 2,048 rows, 2 cores of an AVX-512 EPYC;
# benchmarks/cpu_gemm.py), so it takes all.
DENSE_GEMM_MIN_ROWS = 1024


@functools.cache
def dense_gemm_min_rows() -> float:
    """The rows from which a prepacked weight's GEMM unpacks it (see above):
    :data:`DENSE_GEMM_MIN_ROWS`, or never where torch runs AVX-512 kernels."""
    return math.inf if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else DENSE_GEMM_MIN_ROWS


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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for a plain, a CPU-prepacked or an fp8 weight
    (with its per-channel ``weight_scale``, ``layers/quantization.py``). A
    plain weight at a few rows takes the skinny kernel where its tuned table
    on this GPU says it beat ``F.linear`` (``triton_ops/skinny_gemm.py``)."""
    if weight_scale is not None:
        return fp8_linear(x, weight, weight_scale, bias)
    if weight.is_mkldnn:
        if x.numel() >= dense_gemm_min_rows() * x.shape[-1]:  # a prefill chunk: the plain GEMM on the matrix back
            return F.linear(x, weight.to_dense(), bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    x2 = x.reshape(-1, x.shape[-1])
    if takes_skinny(x2, weight):
        from radixserve.layers.triton_ops.skinny_gemm import skinny_linear

        return skinny_linear(x2, weight, None, bias).reshape(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def prepack_linears_for_cpu(model: nn.Module) -> int:
    """Prepack every linear layer of ``model`` and its LM head (``model.lm_head``)
    for CPU GEMMs; returns how many weights were packed. Call once, after the
    weights are loaded."""
    packed = 0
    for module in model.modules():
        if isinstance(module, LinearBase):
            packed += module.prepack_for_cpu()
    head = getattr(model, "lm_head", None)
    if head is not None and hasattr(head, "prepack_lm_head_for_cpu"):
        packed += head.prepack_lm_head_for_cpu()
    return packed


def quantize_linears(model: nn.Module) -> int:
    """Quantize every linear layer of ``model`` to fp8 (after
    ``quantization.check_quantization``); returns how many. Call once, after
    loading."""
    layers = [m for m in model.modules() if isinstance(m, LinearBase)]
    for layer in layers:
        layer.quantize_fp8()
    return len(layers)


class LinearBase(nn.Module):
    """A linear layer's weight ``[out, in]`` and bias (this rank's part of them),
    the plain, CPU-prepacked or fp8 GEMM, and the rank's TP group. After
    :meth:`quantize_fp8` the weight is fp8 and ``weight_scale`` ``[1, out]``
    holds its per-channel float32 scales (None before)."""

    # Whether the output must be contiguous: with LoRA a stacked GEMM's is else a view of its first columns
    contiguous_output = False

    def __init__(self, weight_shape: tuple[int, int], bias_size: int | None, tp_group: TPGroup):
        super().__init__()
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.empty(*weight_shape), requires_grad=False)
        self.bias = None if bias_size is None else nn.Parameter(torch.empty(bias_size), requires_grad=False)
        self.register_buffer("weight_scale", None, persistent=False)
        # --enable-lora: this layer's adapter slots (``lora/pool.py``), which add
        # the batch's LoRA deltas to its output; None: no LoRA here
        self.lora = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is None:
            return linear(x, self.weight, self.bias, self.weight_scale)
        return self.lora.forward(x, self.weight, self.bias, self.weight_scale, contiguous=self.contiguous_output)

    def prepack_for_cpu(self) -> bool:
        return self.weight_scale is None and swap_in_prepacked_weight(self)

    def quantize_fp8(self) -> None:
        """Replace this rank's weight by fp8 rows and their scales (once, after loading)."""
        if self.weight_scale is not None or self.weight.is_mkldnn:
            raise RuntimeError("quantize a linear layer once, before any CPU prepacking")
        q, scale = quantize_fp8_rows(self.weight.data)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale = scale.reshape(1, -1).contiguous()


@dataclass(frozen=True)
class OutputShard:
    """This rank's rows of one checkpoint tensor and where they sit in the parameter."""

    full: int  # rows of the checkpoint tensor
    start: int  # this rank's first row in it
    size: int  # rows this rank holds
    offset: int  # their first row in the parameter


class ColumnParallelLinear(LinearBase):
    """``y = x @ W.T + b`` with ``W: [output_size, input_size]``, the output
    dimension split over the ranks (each outputs its slice of ``y``)."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group: TPGroup | None = None):
        tp = tp_group or TPGroup()
        size = divide(output_size, tp.size, f"output size of a {type(self).__name__}")
        self._init_shards(input_size, {None: (output_size, tp.rank * size, size)}, bias, tp)

    def _init_shards(self, input_size: int, shards: dict, bias: bool, tp: TPGroup) -> None:
        """Allocate for ``shards`` (shard id -> (checkpoint rows, this rank's
        first row, its row count)), stacked along the output in that order."""
        table, offset = {}, 0
        for shard_id, (full, start, size) in shards.items():
            table[shard_id] = OutputShard(full, start, size, offset)
            offset += size
        LinearBase.__init__(self, (offset, input_size), offset if bias else None, tp)
        self.input_size, self.shards = input_size, table
        self.output_size = sum(s.full for s in table.values())
        for param, tail in ((self.weight, (input_size,)), (self.bias, ())):
            if param is not None:
                param.weight_loader = self.weight_loader
                param.checkpoint_shards = [(i, (s.full, *tail)) for i, s in table.items()]

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id not in self.shards:
            raise ValueError(f"shard_id must be one of {list(self.shards)}, got {shard_id!r}")
        s = self.shards[shard_id]
        piece = narrow_checked(loaded_weight, 0, s.start, s.size, s.full)
        with torch.no_grad():
            copy_checked(param.data.narrow(0, s.offset, s.size), piece)

    def extra_repr(self) -> str:
        rows = self.weight.shape[0]
        return f"in={self.input_size}, out={self.output_size} ({rows} on this rank), bias={self.bias is not None}"


class RowParallelLinear(LinearBase):
    """``y = x @ W.T + b`` with the input dimension split over the ranks (o_proj,
    down_proj): each rank multiplies its slice of ``x`` by its columns of
    ``W``, an all-reduce sums the products, and the bias is added after it."""

    contiguous_output = True  # added to the residual, or all-reduced

    def __init__(self, input_size: int, output_size: int, bias: bool = False, tp_group: TPGroup | None = None):
        tp = tp_group or TPGroup()
        cols = divide(input_size, tp.size, f"input size of a {type(self).__name__}")
        super().__init__((output_size, cols), output_size if bias else None, tp)
        self.input_size, self.output_size, self.input_size_per_rank = input_size, output_size, cols
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shards = [(None, (output_size, input_size))]
        if self.bias is not None:
            self.bias.weight_loader = default_weight_loader

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return super().forward(x)
        if self.lora is None:
            y = linear(x, self.weight, None, self.weight_scale)
        else:  # each rank's partial delta (its columns of A) is summed with the product
            y = self.lora.forward(x, self.weight, None, self.weight_scale, contiguous=True)
        y = self.tp_group.all_reduce(y)
        return y if self.bias is None else y.add_(self.bias)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None:
            raise ValueError(f"this parameter has no shards, got shard_id {shard_id!r}")
        size = self.input_size_per_rank
        with torch.no_grad():
            copy_checked(param.data, narrow_checked(loaded_weight, 1, self.tp_group.rank * size, size, self.input_size))

    def extra_repr(self) -> str:
        cols = self.input_size_per_rank
        return f"in={self.input_size} ({cols} on this rank), out={self.output_size}, bias={self.bias is not None}"


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several projections of the same input stacked along the output, e.g.
    ``gate_up_proj = [gate_proj; up_proj]``; shard ``i`` is ``output_sizes[i]``
    rows in the checkpoint, each split over the ranks on its own."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, tp_group: TPGroup | None = None):
        tp = tp_group or TPGroup()
        shards = {}
        for i, full in enumerate(output_sizes):
            size = divide(full, tp.size, f"output size {i} of a {type(self).__name__}")
            shards[i] = (full, tp.rank * size, size)
        self._init_shards(input_size, shards, bias, tp)
        self.output_sizes = list(output_sizes)

    def forward_gated(self, x: torch.Tensor, act_fn: nn.Module) -> torch.Tensor:
        """``act_fn(self(x))`` for a ``[gate; up]`` pair whose ``act_fn`` is
        SiLU-and-mul: at a few rows where the product takes the skinny kernel
        (and no LoRA) one launch that applies it in its epilogue, with the
        same roundings; with LoRA's triton kernels, the deltas' expand and the
        activation in one launch after the GEMM."""
        if len(self.output_sizes) != 2:
            return act_fn(self(x))
        if self.lora is None and not self.weight.is_mkldnn:
            y = gated_linear(x, self.weight, self.weight_scale, self.bias)
            if y is not None:
                return y
        if self.lora is not None:
            return self.lora.forward_silu_and_mul(x, self.weight, self.bias, self.weight_scale, act_fn)
        return act_fn(self(x))


class QKVParallelLinear(ColumnParallelLinear):
    """The q, k and v projections stacked along the output, loaded with shard
    ids ``"q"``, ``"k"``, ``"v"``. ``num_heads`` and ``num_kv_heads`` are the
    model's totals; this rank holds rows ``[q (its heads) | k (its KV heads) |
    v (same)]``, ``q_size`` and ``kv_size`` of them."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
        tp_group: TPGroup | None = None,
    ):
        tp = tp_group or TPGroup()
        layout = head_layout(num_heads, num_kv_heads, tp.size, tp.rank)
        q_size, kv_size = layout.num_heads * head_dim, layout.num_kv_heads * head_dim
        q = (num_heads * head_dim, layout.q_head_start * head_dim, q_size)
        kv = (num_kv_heads * head_dim, layout.kv_head_start * head_dim, kv_size)
        self._init_shards(hidden_size, {"q": q, "k": kv, "v": kv}, bias, tp)
        self.layout, self.q_size, self.kv_size = layout, q_size, kv_size
