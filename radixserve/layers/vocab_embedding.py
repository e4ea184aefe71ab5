"""Token embedding and LM head (TP would split the vocabulary)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import default_weight_loader


class VocabParallelEmbedding(nn.Module):
    """``weight[input_ids]`` with ``weight: [vocab_size, hidden_size]``."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; applied by :class:`LogitsProcessor`, never called directly."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor, not called")
