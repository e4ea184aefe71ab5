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

A batch's rows are grouped by slot into segments (``LoRABatch``); a layer adds
``scaling * (x[rows] @ A_p.T) @ B_p.T`` to each part's output columns of each
segment's rows, nothing to rows without an adapter. On the GPU this is the
same torch code (no segmented kernels yet, docs/lora.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
    """One forward's LoRA: the segments, sorted by slot, and the slots to
    fill first (``(slot, adapter uid)``: adapters not in their slot yet)."""

    segments: list[LoRASegment] = field(default_factory=list)
    loads: list[tuple[int, str]] = field(default_factory=list)


class LoRALayer:
    """The LoRA of one linear layer: its slots' weights and the delta. The
    layer calls :meth:`add_delta` after its GEMM (``LinearBase.lora``);
    ``batch()`` returns the forward's ``LoRABatch`` (the manager's)."""

    def __init__(self, layer_id: int, parts: list[LoRAPart], row_parallel: bool, in_size: int, out_size: int,
                 num_slots: int, max_rank: int, tp_rank: int, dtype: torch.dtype, device: torch.device, batch):
        self.layer_id, self.parts, self.row_parallel = layer_id, parts, row_parallel
        self.max_rank, self.tp_rank, self.batch = max_rank, tp_rank, batch
        a_rows = max_rank if row_parallel else len(parts) * max_rank
        self.A = torch.zeros(num_slots, a_rows, in_size, dtype=dtype, device=device)
        self.B = torch.zeros(num_slots, out_size, max_rank, dtype=dtype, device=device)

    def fill(self, slot: int, weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Copy an adapter's weights of this layer (``weights``, whole, on the
        host) into ``slot``, this rank's shard of them; zero what it lacks."""
        self.A[slot].zero_()
        self.B[slot].zero_()
        for i, part in enumerate(self.parts):
            ab = weights.get((self.layer_id, part.module))
            if ab is None:
                continue
            a, b = ab
            r = a.shape[0]
            if self.row_parallel:
                cols = self.A.shape[2]
                self.A[slot, :r].copy_(a[:, self.tp_rank * cols : (self.tp_rank + 1) * cols], non_blocking=True)
                self.B[slot, :, :r].copy_(b, non_blocking=True)
            else:
                self.A[slot, i * self.max_rank : i * self.max_rank + r].copy_(a, non_blocking=True)
                rows = b[part.start : part.start + part.size]
                self.B[slot, part.offset : part.offset + part.size, :r].copy_(rows, non_blocking=True)

    def add_delta(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base layer's output for ``x``, this rank's part of it)
        plus each segment's delta, in place."""
        batch = self.batch()
        if batch is None:
            return y
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

    def __repr__(self) -> str:
        kind = "row" if self.row_parallel else "column"
        return f"LoRALayer(layer={self.layer_id}, {kind}, parts={[p.module for p in self.parts]}, R={self.max_rank})"
