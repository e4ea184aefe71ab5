"""Token embedding and LM head (TP would split the vocabulary)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import cpu_prepacked_weight, default_weight_loader, swap_in_prepacked_weight


class VocabParallelEmbedding(nn.Module):
    """``weight[input_ids]`` with ``weight: [vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader
        self.packed_weight: torch.Tensor | None = None  # CPU-prepacked copy for the LM head, if made

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)

    def lm_head_weight(self) -> torch.Tensor:
        """The weight the LM head multiplies by: the CPU-prepacked copy if made."""
        return self.weight if self.packed_weight is None else self.packed_weight

    def prepack_lm_head_for_cpu(self) -> bool:
        """Keep a CPU-prepacked copy for the LM head (a tied embedding still
        looks tokens up in the plain weight)."""
        self.packed_weight = cpu_prepacked_weight(self.weight.data)
        return self.packed_weight is not None


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; applied by :class:`LogitsProcessor`, never called directly."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")

    def prepack_lm_head_for_cpu(self) -> bool:
        """Nothing looks tokens up here: the packed weight replaces the plain one."""
        return swap_in_prepacked_weight(self)
