"""Pipeline parallelism, the model side (``--pp-size``): which decoder layers
each stage holds, and what passes from one stage to the next.

Stage ``i`` of ``pp_size`` holds the contiguous layers ``[start, end)``
(:func:`pp_layer_range`); the first stage also holds the token embedding, the
last the final norm, the LM head and the logits processor. Each stage's KV
pool holds its own layers only. A stage other than the last hands the next
its :class:`PPHidden`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
from torch import nn

from radixserve.distributed.group_ops import StagePosition

PP_LAYER_PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"  # e.g. "5,6,6,5": layers per stage, as in SGLang


def pp_layer_range(num_layers: int, pp_rank: int, pp_size: int) -> tuple[int, int]:
    """The layers ``[start, end)`` that stage ``pp_rank`` of ``pp_size`` holds.

    SGLang's rule (``get_pp_indices``): an even split, where the last
    ``num_layers % pp_size`` stages take one layer more; or, when
    ``$SGLANG_PP_LAYER_PARTITION`` is set, its comma-separated layer count per
    stage. ValueError when a stage would get no layer, or when the variable
    does not give ``pp_size`` counts of at least one summing to ``num_layers``.
    One stage holds every layer whatever the variable says.
    """
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pp_rank must be in [0, {pp_size}), got {pp_rank}")
    if pp_size > num_layers:
        raise ValueError(f"pp_size {pp_size} is larger than the model's {num_layers} layers: "
                         "every pipeline stage needs one layer at least")
    if pp_size == 1:
        return 0, num_layers
    counts = _partition_from_env(num_layers, pp_size)
    if counts is None:
        base, extra = divmod(num_layers, pp_size)
        counts = [base + (rank >= pp_size - extra) for rank in range(pp_size)]
    start = sum(counts[:pp_rank])
    return start, start + counts[pp_rank]


def _partition_from_env(num_layers: int, pp_size: int) -> list[int] | None:
    value = os.environ.get(PP_LAYER_PARTITION_ENV)
    if value is None:
        return None
    try:
        counts = [int(part) for part in value.split(",")]
    except ValueError:
        counts = []
    if len(counts) != pp_size or min(counts) < 1 or sum(counts) != num_layers:
        raise ValueError(f"{PP_LAYER_PARTITION_ENV}={value!r} must be {pp_size} comma-separated layer counts "
                         f"(pp_size), each at least 1, summing to the model's {num_layers} layers")
    return counts


@dataclass(frozen=True)
class PPStage(StagePosition):
    """One pipeline stage: rank ``rank`` of ``size``, holding the decoder
    layers ``[start, end)`` (global indices). ``PPStage(0, num_layers)`` is the
    whole model, as without pipeline parallelism."""

    start: int
    end: int
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if not 0 <= self.rank < self.size or not 0 <= self.start < self.end:
            raise ValueError(f"invalid pipeline stage: rank {self.rank} of {self.size}, layers {self.start}..{self.end}")

    @classmethod
    def of(cls, num_layers: int, pp_rank: int = 0, pp_size: int = 1) -> PPStage:
        """Stage ``pp_rank`` of ``pp_size`` of a model of ``num_layers`` layers (:func:`pp_layer_range`)."""
        return cls(*pp_layer_range(num_layers, pp_rank, pp_size), pp_rank, pp_size)

    @property
    def num_layers(self) -> int:
        return self.end - self.start

    def holds(self, layer_id: int) -> bool:
        return self.start <= layer_id < self.end


@dataclass
class PPHidden:
    """What a stage other than the last returns and the next stage takes
    (``ForwardBatch.pp_hidden``): its last layer's ``(mlp output, residual)``,
    whose sum is that layer's output (the next norm adds them), one row per
    token of the batch."""

    hidden_states: torch.Tensor  # [num_tokens, hidden_size]
    residual: torch.Tensor  # [num_tokens, hidden_size]


class PPMissingLayer(nn.Module):
    """The place of a decoder layer another stage holds: no parameters, never run,
    so that the layers this stage does hold keep their global index."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this decoder layer is held by another pipeline stage")
