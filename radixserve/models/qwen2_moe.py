"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases)
and Qwen3-MoE's layer rule, plus in each MoE layer a shared expert that every
token goes through, scaled by ``sigmoid(shared_expert_gate(x))``."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixserve.models.llama import AttentionOptions
from radixserve.models.qwen3_moe import qwen_moe_layer_is_sparse
from radixserve.models.sparse_moe import MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=bool(getattr(config, "qkv_bias", True)), o_bias=False)

    @classmethod
    def is_sparse_layer(cls, config: PretrainedConfig, layer_id: int) -> bool:
        return qwen_moe_layer_is_sparse(config, layer_id)

    @classmethod
    def shared_expert_size(cls, config: PretrainedConfig) -> int:
        return int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
