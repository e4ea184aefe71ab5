"""The model's shape and where its weights come from, resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from radixserve.distributed.expert_parallel import expert_layout
from radixserve.distributed.partition import HeadLayout, divide, head_layout


@dataclass(frozen=True)
class ModelConfig:
    """Everything the runner needs to know about a model.

    ``load_format`` is ``"safetensors"`` (weights in ``weights_dir``) or
    ``"dummy"`` (random weights made on the device). ``tokenizer_dir`` is a
    folder ``transformers.AutoTokenizer`` can load, or None for dummy models
    without a tokenizer.
    """

    model_path: str  # what the user passed (folder, .gguf file or dummy name)
    hf_config: PretrainedConfig
    load_format: str
    weights_dir: str | None
    tokenizer_dir: str | None
    dtype: torch.dtype

    @property
    def architectures(self) -> list[str]:
        return list(getattr(self.hf_config, "architectures", None) or [])

    @property
    def hidden_size(self) -> int:
        return self.hf_config.hidden_size

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.hf_config, "head_dim", None) or self.hidden_size // self.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def context_len(self) -> int:
        return int(getattr(self.hf_config, "max_position_embeddings", 4096))

    @property
    def intermediate_size(self) -> int:
        return self.hf_config.intermediate_size

    def head_layout(self, tp_size: int = 1, tp_rank: int = 0) -> HeadLayout:
        """The attention heads rank ``tp_rank`` of ``tp_size`` holds (its KV
        pool holds ``num_kv_heads`` of them)."""
        return head_layout(self.num_attention_heads, self.num_key_value_heads, tp_size, tp_rank)

    @property
    def num_experts(self) -> int:
        """Experts per MoE layer (Qwen's ``num_experts``, Mixtral's ``num_local_experts``); 0: a dense model."""
        return int(getattr(self.hf_config, "num_experts", None) or getattr(self.hf_config, "num_local_experts", None)
                   or 0)

    def check_tensor_parallel(self, tp_size: int, ep_size: int = 1) -> None:
        """A ValueError, naming the dimension or the flag, when the model cannot
        be split over ``tp_size`` ranks (heads, KV heads, the MLP's intermediate
        size) with ``ep_size`` expert-parallel ones (the experts, their
        intermediate size over ``tp_size / ep_size``)."""
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.head_layout(tp_size)
        divide(self.intermediate_size, tp_size, "intermediate_size")
        if not self.num_experts:
            if ep_size > 1:
                raise ValueError(f"ep_size {ep_size}: --ep-size splits a mixture of experts, and "
                                 f"{self.architectures or self.model_path} has none")
            return
        layout = expert_layout(self.num_experts, tp_size, 0, ep_size)
        moe_intermediate = int(getattr(self.hf_config, "moe_intermediate_size", None) or self.intermediate_size)
        if moe_intermediate % layout.moe_tp_size:
            raise ValueError(f"the experts' intermediate size {moe_intermediate} is not divisible by "
                             f"tp_size / ep_size = {layout.moe_tp_size} (--tp-size {tp_size}, --ep-size {ep_size})")
