"""Qwen2 / Qwen2.5: the Llama architecture with biases on q, k and v."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixserve.models.llama import AttentionOptions, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_options(cls, config: PretrainedConfig) -> AttentionOptions:
        return AttentionOptions(qkv_bias=True, o_bias=False)
