"""Adapter weights in device slots, per linear layer, and the torch path that
adds their deltas to a batch.

Each LoRA-enabled linear layer holds, for every slot, this rank's shard of
``A`` and ``B`` (``R = --max-lora-rank`` wide; a smaller rank fills the first
``r`` of them, the rest stays zero, and the delta reads only those ``r``):

```
column-parallel (qkv_proj, gate_up_proj), parts p = q|k|v or gate|up:
  A [slots, P*R, in]        rows p*R .. p*R+r: part p's A (inputs are whole on every rank)
  B [slots, out_rank, R]    part p's rows of B at the part's rows of the base weight (its shard)
row-parallel (o_proj, down_proj):
  A [slots, R, in_rank]     this rank's columns of A (the inputs it holds)
  B [slots, out, R]         whole: the partial deltas are summed by the base layer's all-reduce
```

A layer adds ``scaling * (x[rows] @ A_p.T) @ B_p.T`` to each part's output
columns of each adapter's rows, nothing to rows without an adapter, in one of
two ways (``--lora-backend``):

- ``triton`` (CUDA): the batch's table (``triton_ops.LoRAKernelTable``, its
  rows sorted by slot and cut into blocks) and segmented GEMMs for all
  adapters and parts, which CUDA graphs capture. Over a weight in the
  model's dtype the layer is *stacked*: every slot's ``A`` lies under the
  base weight (``[W; A_0; ...; A_S-1]``, :meth:`LoRALayer.stack`), so the
  base GEMM also computes each row's rank columns for every slot and one
  expand launch reads its own slot's (no shrink launch, and ``x`` is read
  once); an fp8 weight keeps ``A`` in the pool, and a shrink launch;
- ``torch_native``: the rows grouped by slot into segments, a loop over
  segments and parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.layers.linear import linear


@dataclass(frozen=True)
class LoRAPart:
    """One PEFT module inside a base layer: its rows of the layer's output on
    this rank (``offset``, ``size``), and which rows of the checkpoint's B they
    are (``start``; column-parallel only)."""

    module: str  # PEFT's name: q_proj, gate_proj, o_proj, ...
    offset: int
    size: int
    start: int


@dataclass
class LoRASegment:
    """The rows of a batch that one slot's adapter applies to."""

    slot: int
    rows: slice | torch.Tensor  # a slice where they are contiguous, else their indices on the device
    rank: int
    scaling: float


@dataclass
class LoRABatch:
    """One forward's LoRA: the segments sorted by slot (``torch_native``) or
    each row's slot (``triton``, -1: none) from which the kernels' table is
    built for the rows the forward runs; and the slots to fill first
    (``(slot, adapter uid)``: adapters not in their slot yet)."""

    segments: list[LoRASegment] = field(default_factory=list)
    loads: list[tuple[int, str]] = field(default_factory=list)
    row_slots: Any = None  # numpy int array, one per row (triton)
    table: Any = None  # triton_ops.LoRAKernelTable on the device, once built


class LoRALayer:
    """The LoRA of one linear layer: its slots' weights and the delta. The
    layer calls :meth:`forward` in place of its GEMM (``LinearBase.lora``);
    ``batch()`` returns the forward's ``LoRABatch`` and ``scaling`` is
    each slot's scaling on the device (the manager's).

    ``A`` and ``B`` are views (:meth:`bind`) into the manager's pool, one
    flat row per slot holding every layer's weights, so that filling a slot
    is one copy of an adapter packed for this rank (:meth:`pack`)."""

    def __init__(self, layer_id: int, parts: list[LoRAPart], row_parallel: bool, in_size: int, whole_in: int,
                 out_size: int, max_rank: int, tp_rank: int, device: torch.device, batch, scaling: torch.Tensor):
        self.layer_id, self.parts, self.row_parallel, self.whole_in = layer_id, parts, row_parallel, whole_in
        self.max_rank, self.tp_rank, self.batch, self.scaling = max_rank, tp_rank, batch, scaling
        self.a_shape = (max_rank if row_parallel else len(parts) * max_rank, in_size)
        self.b_shape = (out_size, max_rank)
        self.A = self.B = None
        # stacked (:meth:`stack`): [W; A of every slot] and its bias, whose first rows are the base layer's
        self.stacked_weight = self.stacked_bias = None
        self.out_size = out_size
        # The kernels' parts: the output columns each one's delta adds to
        self.part_bounds = torch.tensor([[p.offset, p.offset + p.size] for p in parts], dtype=torch.int32, device=device)

    @property
    def a_numel(self) -> int:
        return self.a_shape[0] * self.a_shape[1]

    @property
    def numel(self) -> int:
        """Elements a slot of the pool holds for this layer: ``A`` and ``B``, or ``B`` alone once stacked."""
        return self.b_shape[0] * self.b_shape[1] + (0 if self.stacked else self.a_numel)

    @property
    def stacked(self) -> bool:
        return self.stacked_weight is not None

    def stack(self, module: torch.nn.Module, num_slots: int) -> None:
        """Lay the slots' ``A`` under ``module``'s weight (in the model's
        dtype), before :meth:`bind`: the weight becomes the first rows of
        ``[W; A_0; ...; A_S-1]`` (a view, so the layer and its loaders see
        it as before), the bias likewise with zeros under it, and ``A`` a
        view of the other rows."""
        rows, extra = module.weight.shape[0], num_slots * self.a_shape[0]

        def extended(param: torch.nn.Parameter) -> torch.Tensor:  # zeros under it; param becomes its first rows
            out = param.data.new_zeros(rows + extra, *param.shape[1:])
            out[:rows].copy_(param.data)
            param.data = out[:rows]
            return out

        self.stacked_weight = extended(module.weight)
        self.stacked_bias = None if module.bias is None else extended(module.bias)
        self.A = self.stacked_weight[rows:].unflatten(0, (num_slots, self.a_shape[0]))

    def bind(self, flat: torch.Tensor) -> None:
        """Take this layer's slots in the pool: ``flat`` [slots, numel]."""
        if self.stacked:
            self.B = flat.unflatten(-1, self.b_shape)
        else:
            self.A, self.B = flat[:, : self.a_numel].unflatten(-1, self.a_shape), flat[:, self.a_numel :].unflatten(
                -1, self.b_shape)

    def pack(self, a_flat: torch.Tensor, b_flat: torch.Tensor,
             weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]], where: str) -> None:
        """Write an adapter's weights of this layer (``weights``, whole, on
        the host), this rank's shard of them, into ``a_flat`` [a_numel] and
        ``b_flat`` (zeros), as a slot holds them. ValueError (naming
        ``where``) for a shape that does not fit the model."""
        A, B = a_flat.unflatten(0, self.a_shape), b_flat.unflatten(0, self.b_shape)
        in_size, out_size = self.a_shape[1], self.b_shape[0]
        for i, part in enumerate(self.parts):
            ab = weights.get((self.layer_id, part.module))
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            want_out = out_size if self.row_parallel else part.start + part.size
            if a.shape[1] != self.whole_in or b.shape[0] < want_out or (self.row_parallel and b.shape[0] != out_size):
                raise ValueError(f"{where}: layer {self.layer_id} {part.module}: lora_A {tuple(a.shape)} and lora_B "
                                 f"{tuple(b.shape)} do not fit the model's projection")
            if self.row_parallel:
                A[:r].copy_(a[:, self.tp_rank * in_size : (self.tp_rank + 1) * in_size])
                B[:, :r].copy_(b)
            else:
                A[i * self.max_rank : i * self.max_rank + r].copy_(a)
                B[part.offset : part.offset + part.size, :r].copy_(b[part.start : part.start + part.size])

    def _kernel_table(self, batch: LoRABatch | None, x: torch.Tensor):
        """The triton backend's table of this forward (a graph's, or an eager
        forward's, built at its first layer); None for the torch path."""
        if batch is None or (batch.row_slots is None and batch.table is None):
            return None
        if batch.table is None:
            from radixserve.lora.triton_ops import build_table

            batch.table = build_table(batch.row_slots, x.shape[0]).to(x.device)
        return batch.table

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                weight_scale: torch.Tensor | None, contiguous: bool = False) -> torch.Tensor:
        """The base layer's product for ``x`` (``linear`` over its ``weight``,
        ``bias`` and ``weight_scale``, this rank's part of it) plus each row's
        delta. A stacked layer computes both in one GEMM and the expand;
        ``contiguous``: its output must be (a row-parallel layer's, which is
        added to the residual or all-reduced), else it may be a view."""
        table = self._kernel_table(self.batch(), x) if self.stacked else None
        if table is None:
            return self.add_delta(x, linear(x, weight, bias, weight_scale))
        from radixserve.lora.triton_ops import stacked_delta

        return stacked_delta(self._stacked_product(x, bias), self.out_size, self.B, table, self.scaling,
                             self.part_bounds, self.max_rank, self.a_shape[0], contiguous)

    def _stacked_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ [W; A_0; ...].T`` (plus the bias, zeros under it): the output, then every slot's rank columns."""
        return linear(x, self.stacked_weight, None if bias is None else self.stacked_bias)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base layer's output for ``x``, this rank's part of it)
        plus each segment's delta, in place (an unstacked layer)."""
        batch = self.batch()
        if batch is None:
            return y
        table = self._kernel_table(batch, x)
        if table is not None:
            from radixserve.lora.triton_ops import lora_delta

            return lora_delta(x, y, self.A, self.B, table, self.scaling, self.part_bounds, self.max_rank)
        R = self.max_rank
        for seg in batch.segments:
            xs, r = x[seg.rows], seg.rank
            for i, part in enumerate(self.parts):
                a = self.A[seg.slot, :r] if self.row_parallel else self.A[seg.slot, i * R : i * R + r]
                b = self.B[seg.slot, part.offset : part.offset + part.size, :r]
                delta = (xs @ a.T) @ b.T
                out = y[:, part.offset : part.offset + part.size]
                if isinstance(seg.rows, slice):
                    out[seg.rows].add_(delta, alpha=seg.scaling)
                else:
                    out.index_add_(0, seg.rows, delta, alpha=seg.scaling)
        return y

    def forward_silu_and_mul(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             weight_scale: torch.Tensor | None, act_fn) -> torch.Tensor:
        """``act_fn`` (SiLU-and-mul) of :meth:`forward`'s ``[T, 2 * I]`` =
        ``[gate | up]``: with the triton backend the expand and the
        activation in one launch (``triton_ops.expand_silu_and_mul``)."""
        table = self._kernel_table(self.batch(), x)
        if table is None:
            return act_fn(self.add_delta(x, linear(x, weight, bias, weight_scale)))
        from radixserve.lora.triton_ops import expand_silu_and_mul

        if self.stacked:
            y_ext = self._stacked_product(x, bias)
            y, t = y_ext[:, : self.out_size], y_ext[:, self.out_size :]
        else:
            y, t = linear(x, weight, bias, weight_scale), None
        return expand_silu_and_mul(x, y, self.A, self.B, table, self.scaling, self.part_bounds, self.max_rank,
                                   stacked_t=t)

    def __repr__(self) -> str:
        kind = "row" if self.row_parallel else "column"
        return f"LoRALayer(layer={self.layer_id}, {kind}, parts={[p.module for p in self.parts]}, R={self.max_rank})"
