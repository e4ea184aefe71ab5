"""Qwen3 (dense): the Llama architecture with an RMSNorm over each head of q
and k before rotary, and an explicit ``head_dim``."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixserve.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        bias = bool(getattr(config, "attention_bias", False))
        return AttentionOptions(qkv_bias=bias, o_bias=bias, qk_norm=True)
