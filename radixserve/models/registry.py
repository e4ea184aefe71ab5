"""Architecture name (``config.json``'s ``architectures``) -> model class."""

from __future__ import annotations

import importlib

from torch import nn


class ModelRegistry:
    """Resolves HF architecture names to model classes, importing lazily."""

    _MODELS = {
        "LlamaForCausalLM": "radixserve.models.llama:LlamaForCausalLM",
        "MistralForCausalLM": "radixserve.models.llama:MistralForCausalLM",
        "MixtralForCausalLM": "radixserve.models.mixtral:MixtralForCausalLM",
        "Qwen2ForCausalLM": "radixserve.models.qwen2:Qwen2ForCausalLM",
        "Qwen2MoeForCausalLM": "radixserve.models.qwen2_moe:Qwen2MoeForCausalLM",
        "Qwen3ForCausalLM": "radixserve.models.qwen3:Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM": "radixserve.models.qwen3_moe:Qwen3MoeForCausalLM",
    }

    @classmethod
    def supported(cls) -> list[str]:
        return sorted(cls._MODELS)

    @classmethod
    def resolve(cls, architectures: list[str]) -> type[nn.Module]:
        """The class of the first supported name in ``architectures``; ValueError if none is."""
        for arch in architectures or []:
            if arch in cls._MODELS:
                module_name, cls_name = cls._MODELS[arch].split(":")
                return getattr(importlib.import_module(module_name), cls_name)
        raise ValueError(
            f"model architecture(s) {list(architectures or [])} not supported; supported: {', '.join(cls.supported())}"
        )
