"""Attention backends, chosen by name at start-up (imports are lazy so that a
CPU install never imports GPU-only code)."""

from __future__ import annotations

import importlib

from radixserve.layers.attention.base import AttentionBackend

# name -> "module:class"
_BACKENDS = {
    "torch_native": "radixserve.layers.attention.torch_native_backend:TorchNativeAttnBackend",
    "triton": "radixserve.layers.attention.triton_backend:TritonAttnBackend",
}


def create_attention_backend(name: str, model_runner) -> AttentionBackend:
    """Instantiate the backend called ``name`` for ``model_runner``."""
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {sorted(_BACKENDS)}")
    module_name, cls_name = _BACKENDS[name].split(":")
    return getattr(importlib.import_module(module_name), cls_name)(model_runner)


__all__ = ["AttentionBackend", "create_attention_backend"]
