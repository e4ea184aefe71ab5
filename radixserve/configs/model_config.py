"""The model's shape and where its weights come from, resolved once at start-up."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PretrainedConfig


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
