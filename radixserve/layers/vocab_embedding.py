"""Token embedding and LM head, the vocabulary split over tensor-parallel ranks.

The vocabulary is padded to a multiple of ``tp_size`` (padding rows are zero)
and rank ``r`` holds rows ``vocab_start .. vocab_end - 1`` of the padded
matrix. A lookup reads the ids this rank holds and gives zeros for the others;
an all-reduce then sums the ranks' rows into the full embedding. As an LM
head, each rank multiplies by its rows, giving its slice of the logits, which
``LogitsProcessor`` gathers. At tp size 1 nothing is padded or communicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed import TPGroup, padded_vocab_size
from radixserve.layers.linear import copy_checked, cpu_prepacked_weight, swap_in_prepacked_weight


class VocabParallelEmbedding(nn.Module):
    """``weight[input_ids]`` with ``weight: [vocab_size, hidden_size]`` (this
    rank's rows of it, see the module docstring)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp_group: TPGroup | None = None):
        super().__init__()
        self.tp_group = tp_group or TPGroup()
        self.vocab_size = vocab_size
        self.padded_vocab_size = padded_vocab_size(vocab_size, self.tp_group.size)
        rows = self.padded_vocab_size // self.tp_group.size
        self.vocab_start = self.tp_group.rank * rows
        self.vocab_end = self.vocab_start + rows
        self.weight = nn.Parameter(torch.empty(rows, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shards = [(None, (vocab_size, hidden_size))]
        self.packed_weight: torch.Tensor | None = None  # CPU-prepacked copy for the LM head, if made

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size == 1:
            return F.embedding(input_ids, self.weight)
        elsewhere = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local_ids = (input_ids - self.vocab_start).masked_fill_(elsewhere, 0)
        out = F.embedding(local_ids, self.weight).masked_fill_(elsewhere.unsqueeze(-1), 0)
        return self.tp_group.all_reduce(out)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id=None) -> None:
        """Copy this rank's rows of the ``[vocab_size, hidden]`` checkpoint tensor; zero the padding."""
        if shard_id is not None:
            raise ValueError(f"this parameter has no shards, got shard_id {shard_id!r}")
        if loaded_weight.dim() != 2 or loaded_weight.shape[0] != self.vocab_size:
            raise ValueError(
                f"weight shape mismatch: checkpoint {tuple(loaded_weight.shape)}, expected {self.vocab_size} rows"
            )
        end = min(self.vocab_end, self.vocab_size)
        real = max(0, end - self.vocab_start)
        with torch.no_grad():
            copy_checked(param.data[:real], loaded_weight[self.vocab_start : self.vocab_start + real])
            param.data[real:].zero_()

    def lm_head_weight(self) -> torch.Tensor:
        """The weight the LM head multiplies by: the CPU-prepacked copy if made."""
        return self.weight if self.packed_weight is None else self.packed_weight

    def prepack_lm_head_for_cpu(self) -> bool:
        """Keep a CPU-prepacked copy for the LM head (a tied embedding still
        looks tokens up in the plain weight)."""
        self.packed_weight = cpu_prepacked_weight(self.weight.data)
        return self.packed_weight is not None

    def extra_repr(self) -> str:
        return f"vocab={self.vocab_size}, rows {self.vocab_start}..{self.vocab_end - 1} on this rank"


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; applied by :class:`LogitsProcessor`, never called directly."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")

    def prepack_lm_head_for_cpu(self) -> bool:
        """Nothing looks tokens up here: the packed weight replaces the plain one."""
        return swap_in_prepacked_weight(self)
