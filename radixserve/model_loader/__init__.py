"""Model sources: HF safetensors folders, GGUF files (converted, cached) and dummy configs.

``load_gguf`` is imported on first use, so that only GGUF models need the ``gguf`` package.
"""

from radixserve.model_loader.dummy_configs import DUMMY_MODEL_NAMES, dummy_config, is_dummy_name
from radixserve.model_loader.loader import (
    LOAD_FORMATS,
    SUPPORTED_ARCHITECTURES,
    default_model_path,
    get_model,
    resolve_dtype,
    resolve_model,
)
from radixserve.model_loader.weight_utils import fill_dummy_weights, iter_safetensors


def __getattr__(name: str):
    if name == "load_gguf":
        from radixserve.model_loader.gguf_cache import load_gguf

        return load_gguf
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "DUMMY_MODEL_NAMES",
    "LOAD_FORMATS",
    "SUPPORTED_ARCHITECTURES",
    "default_model_path",
    "dummy_config",
    "fill_dummy_weights",
    "get_model",
    "is_dummy_name",
    "iter_safetensors",
    "load_gguf",
    "resolve_dtype",
    "resolve_model",
]
