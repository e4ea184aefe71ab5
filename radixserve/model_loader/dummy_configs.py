"""Built-in model shapes that need no files: random weights, real dimensions.

Throughput and latency do not depend on weight values, so these named configs
(used with ``--load-format dummy``) are the standard for speed figures; the
``tiny-*`` ones keep CPU tests fast while exercising each architecture's quirks
(llama3 rope scaling, qwen2 qkv biases, qwen3 q/k norms, tied embeddings,
mixtures of experts with a dense layer among them).
"""

from __future__ import annotations

from typing import Any, Callable

from transformers import LlamaConfig, MixtralConfig, PretrainedConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}

_QWEN3_COMMON: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 151936,
    "head_dim": 128,
    "num_key_value_heads": 8,
    "rope_theta": 1_000_000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "dtype": "bfloat16",
}

_TINY_COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "dtype": "float32",
}

# name -> (config class, constructor kwargs). Kept as data so that every call
# builds a fresh config object: configs are mutable and callers may edit them.
_TABLE: dict[str, tuple[Callable[..., PretrainedConfig], dict[str, Any]]] = {
    "llama-3.1-8b": (LlamaConfig, {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "vocab_size": 128256,
        "rope_theta": 500_000.0,
        "rope_scaling": _LLAMA3_ROPE,
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
        "dtype": "bfloat16",
    }),
    "qwen3-0.6b": (Qwen3Config, {
        **_QWEN3_COMMON,
        "hidden_size": 1024,
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "intermediate_size": 3072,
        "tie_word_embeddings": True,
    }),
    "qwen3-8b": (Qwen3Config, {
        **_QWEN3_COMMON,
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "intermediate_size": 12288,
        "tie_word_embeddings": False,
    }),
    "tiny-llama": (LlamaConfig, {
        **_TINY_COMMON,
        "architectures": ["LlamaForCausalLM"],
        "rope_theta": 500_000.0,
        "rope_scaling": {**_LLAMA3_ROPE, "original_max_position_embeddings": 256},
        "tie_word_embeddings": False,
    }),
    "tiny-qwen2": (Qwen2Config, {
        **_TINY_COMMON,
        "architectures": ["Qwen2ForCausalLM"],
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    }),
    "tiny-qwen3": (Qwen3Config, {
        **_TINY_COMMON,
        "architectures": ["Qwen3ForCausalLM"],
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    }),
}

# Mixtures of experts (docs/moe.md): the real geometries, and tiny ones (8 experts, top 2).
_TABLE.update({
    "qwen3-30b-a3b": (Qwen3MoeConfig, {
        **_QWEN3_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "intermediate_size": 6144,  # dense layers' MLP (none here: mlp_only_layers is empty)
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }),
    "mixtral-8x7b": (MixtralConfig, {
        "architectures": ["MixtralForCausalLM"],
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "vocab_size": 32000,
        "rope_theta": 1_000_000.0,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "dtype": "bfloat16",
    }),
    "tiny-qwen3-moe": (Qwen3MoeConfig, {
        **_TINY_COMMON,
        "architectures": ["Qwen3MoeForCausalLM"],
        "num_hidden_layers": 3,
        "moe_intermediate_size": 32,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "norm_topk_prob": True,
        "mlp_only_layers": [1],  # a dense layer between two MoE ones
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": True,
    }),
    "tiny-mixtral": (MixtralConfig, {
        **_TINY_COMMON,
        "architectures": ["MixtralForCausalLM"],
        "intermediate_size": 32,
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "rope_theta": 1_000_000.0,
        "tie_word_embeddings": False,
    }),
})

DUMMY_MODEL_NAMES: tuple[str, ...] = tuple(_TABLE)


def is_dummy_name(name: str | None) -> bool:
    """True when ``name`` is one of the built-in config names."""
    return name in _TABLE


def dummy_config(name: str) -> PretrainedConfig:
    """A fresh ``transformers`` config for the built-in model ``name``."""
    if name not in _TABLE:
        raise KeyError(f"unknown dummy model {name!r}; built-in names: {', '.join(DUMMY_MODEL_NAMES)}")
    config_cls, kwargs = _TABLE[name]
    return config_cls(**kwargs)
