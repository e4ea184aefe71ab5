"""Mixtral (8x7B, 8x22B): Mistral's attention and, in every layer, a mixture
of experts whose top-k weights are always renormalised over the chosen k.
Its checkpoints name the block ``block_sparse_moe`` and an expert's gate, down
and up projections ``w1``, ``w2`` and ``w3`` (``sparse_moe.py`` maps them)."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixserve.models.sparse_moe import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    @classmethod
    def renormalize(cls, config: PretrainedConfig) -> bool:
        return True
