"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (q/k norms),
and in each layer that ``decoder_sparse_step`` selects and ``mlp_only_layers``
does not list, a mixture of experts routed with ``norm_topk_prob``."""

from __future__ import annotations

from transformers import PretrainedConfig

from radixserve.models.qwen3 import Qwen3ForCausalLM
from radixserve.models.sparse_moe import MoEForCausalLM, num_experts_of


def qwen_moe_layer_is_sparse(config: PretrainedConfig, layer_id: int) -> bool:
    """HF's rule (Qwen2-MoE and Qwen3-MoE): experts unless the layer is MLP-only or off the sparse step."""
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return (layer_id not in (getattr(config, "mlp_only_layers", None) or [])
            and num_experts_of(config) > 0 and (layer_id + 1) % step == 0)


class Qwen3MoeForCausalLM(MoEForCausalLM):
    attention_options = Qwen3ForCausalLM.attention_options

    @classmethod
    def is_sparse_layer(cls, config: PretrainedConfig, layer_id: int) -> bool:
        return qwen_moe_layer_is_sparse(config, layer_id)
